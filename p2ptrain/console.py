"""The terminal's one live line (a progress bar redrawn in place) and the log lines around it.

A bar is drawn with a carriage return and no newline, so a log record written while it is on
screen used to continue the bar's line (issue 33). Here the bar registers itself as the live
line; the log handler clears it before a record and draws it again after, under one lock,
since the bar is drawn from the inner steps' worker thread while records come from any.
"""

from __future__ import annotations

import logging
import threading
from typing import TextIO

CLEAR = "\r\x1b[K"  # to the line's start, then erase to its end
_lock = threading.RLock()
_live: tuple[TextIO, str] | None = None  # (stream, text) of the line on screen now


def draw(out: TextIO, text: str, final: bool = False) -> None:
    """Draw `text` as the live line of `out`; `final` ends it with a newline (it stays)."""
    global _live
    with _lock:
        out.write(CLEAR + text + ("\n" if final else ""))
        out.flush()
        _live = None if final else (out, text)


def drop(out: TextIO) -> None:
    """Erase `out`'s live line, if it has one (its work ended without finishing)."""
    global _live
    with _lock:
        if _live is not None and _live[0] is out:
            out.write(CLEAR)
            out.flush()
            _live = None


class LiveLineHandler(logging.StreamHandler):
    """A StreamHandler that writes its records above the live line of its stream."""

    def emit(self, record: logging.LogRecord) -> None:
        with _lock:
            live = _live if _live is not None and _live[0] is self.stream else None
            if live is not None:
                self.stream.write(CLEAR)
            super().emit(record)
            if live is not None:
                self.stream.write(live[1])
                self.stream.flush()
