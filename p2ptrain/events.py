"""Events a node reports: JSON lines on stdout with --json, readable lines on stderr otherwise.

Every JSON event carries "event", "t" (unix seconds) and "peer" (the emitting node's own
peer id), so the lines of many peers can be merged into one stream and still be told apart.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Callable, TextIO

log = logging.getLogger("p2ptrain")


class EventSink:
    def __init__(self, peer: str, json_mode: bool, out: TextIO | None = None) -> None:
        self.peer = peer
        self.json_mode = json_mode
        self.out = out or sys.stdout
        self.history: list[dict[str, Any]] = []
        # In-process listeners (the dashboard), called with every record as it is emitted.
        self.subscribers: list[Callable[[dict[str, Any]], None]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "t": round(time.time(), 3), "peer": self.peer, **fields}
        self.history.append(record)
        if len(self.history) > 1000:
            del self.history[:500]
        for fn in list(self.subscribers):
            try:
                fn(record)
            except Exception:  # a listener's bug must not stop the node
                log.exception("event subscriber failed on %s", event)
        if self.json_mode:
            self.out.write(json.dumps(record, default=str) + "\n")
            self.out.flush()
        else:
            detail = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
            log.info("%s %s", event, detail)
        return record


def _short(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # libp2p is chatty at INFO; its warnings still show.
    for noisy in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)
