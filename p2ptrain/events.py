"""Events a node reports: JSON lines on stdout with --json, readable lines on stderr otherwise.

Every JSON event carries "event", "t" (unix seconds) and "peer" (the emitting node's own
peer id), so the lines of many peers can be merged into one stream and still be told apart.

On stderr (no --json) a person watching sees what they need: committed steps with their
loss, joins, skips with their reasons, errors (`SHOWN`, `WARNED`). Every other event (timing
breakdowns, per-step checkpoint writes, round internals) is logged at DEBUG, shown with -v or
P2PTRAIN_DEBUG=1; --json always writes every event (issue 33).

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

# Logged at INFO in human mode.
SHOWN = frozenset({
    "listening", "bootstrap_connected", "dashboard_listening", "reachability", "run_joined", "peer_discovered",
    "joining_ahead", "rejoining_round", "caught_up", "data_fetched", "outer_step_committed", "outer_step_skipped", "left",
})
# Logged at WARNING in human mode: something went wrong that a person may have to act on.
WARNED = frozenset({
    "error", "checkpoint_failed", "checkpoint_rejected", "contribution_rejected", "peer_excluded",
})


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
            level = logging.WARNING if event in WARNED else logging.INFO if event in SHOWN else logging.DEBUG
            if log.isEnabledFor(level):
                log.log(level, "%s", human(event, fields))
        return record


def human(event: str, fields: dict[str, Any]) -> str:
    """One readable line for an event on stderr."""
    if event == "outer_step_committed":
        return _committed(fields)
    return f"{event} " + " ".join(f"{k}={_short(v)}" for k, v in fields.items())


def _committed(f: dict[str, Any]) -> str:
    of = f" ({f['goal_done']} of {f['goal_total']})" if f.get("goal_total") else ""
    parts = [f"step {f.get('step')} committed{of}:"]
    if f.get("loss") is not None:
        parts.append(f"loss {f['loss']:.4f}")
    if f.get("val_loss") is not None:
        parts.append(f"val {f['val_loss']:.4f}")
    if f.get("members") is not None:
        parts.append(f"{len(f['members'])} member(s)")
    if f.get("step_seconds") is not None:
        parts.append(f"{f['step_seconds']:.1f} s/step")
    if f.get("eta_seconds") is not None:
        parts.append(f"ETA {duration(f['eta_seconds'])}")
    parts.append(f"params {str(f.get('params_sha256', ''))[:12]}")
    return " ".join(parts)


def duration(seconds: float) -> str:
    """3s, 4m05s, 2h07m: an ETA a person reads at a glance."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


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
    """Logging on stderr: INFO, or DEBUG with `verbose` or P2PTRAIN_DEBUG=1."""
    import os

    from p2ptrain.console import LiveLineHandler

    verbose = verbose or os.environ.get("P2PTRAIN_DEBUG") == "1"
    handler = LiveLineHandler(sys.stderr)  # records print above a progress bar, not into it
    handler.setFormatter(SafeFormatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    # libp2p is chatty at INFO; its warnings still show.
    for noisy in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)
    if not verbose:
        logging.getLogger("libp2p.transport.tcp.tcp").addFilter(_reraised_dial_errors)


def _reraised_dial_errors(record: logging.LogRecord) -> bool:
    """py-libp2p logs a failed TCP dial at ERROR and then raises it (OpenConnectionError) to
    the dialler, which reports it in its own terms: the raw line is noise twice over."""
    return not str(record.msg).startswith(("Failed to open TCP stream", "Unexpected error opening TCP stream"))
