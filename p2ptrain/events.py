"""Events a node reports: JSON lines on stdout with --json, readable lines on stderr otherwise.

Every JSON event carries "event", "t" (unix seconds) and "peer" (the emitting node's own
peer id), so the lines of many peers can be merged into one stream and still be told apart.

Events and log messages carry strings peers chose (a blame reason in an abort vote, a
record's field): a newline in one forged a log line of its own. Every readable line is
written through `clean` (control characters escaped, length bounded): the text events here,
and every log record through the formatter `setup_logging` installs (`SafeFormatter`).
JSON lines escape control characters by themselves.
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
        return clean("[" + ", ".join(map(str, v)) + "]", MAX_FIELD)
    return clean(v, MAX_FIELD)


MAX_FIELD = 2000
"""Characters of one text event field (a member list of 64 peer ids fits)."""
MAX_LOG_MESSAGE = 4000


def _escape(ch: str) -> str:
    n = ord(ch)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


# C0 and C1 controls, DEL, and the line and paragraph separators some viewers break lines on.
_CONTROL = {n: _escape(chr(n)) for n in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)}


def clean(value: Any, limit: int = 200) -> str:
    """`value` as one line of text: control characters escaped (\\x0a for a newline), at most
    `limit` characters (then "..." and how many more). For strings peers chose."""
    text = str(value)
    over = len(text) - limit
    if over > 0:
        text = text[:limit]
    text = text.translate(_CONTROL)
    return text if over <= 0 else f"{text}...(+{over})"


class SafeFormatter(logging.Formatter):
    """Log messages as one line each (`clean`), whatever their arguments held; a traceback
    the record carries is ours and keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = clean(record.message, MAX_LOG_MESSAGE)
        return super().formatMessage(record)


def setup_logging(verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    # libp2p is chatty at INFO; its warnings still show.
    for noisy in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)
