"""Progress of long local work (inner steps, checkpoint downloads) for a person watching.

On a terminal: a bar on stderr redrawn in place. Otherwise (a log file, a pipe): a plain
log line at each quarter. With --json: nothing, the events are the output.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, TextIO

log = logging.getLogger("p2ptrain.train.progress")
WIDTH = 30
REDRAW = 0.1  # seconds between redraws of a bar


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class Progress:
    def __init__(self, label: str, unit: str = "", show: Callable[[int], str] = str, tty: bool | None = None,
                 out: TextIO | None = None) -> None:
        self.label = label
        self.unit = unit
        self.show = show
        self.out = out or sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.quarter = 0
        self.last_draw = 0.0

    def __call__(self, done: int, total: int) -> None:
        total = max(total, 1)
        done = min(max(done, 0), total)
        what = f"{self.show(done)}/{self.show(total)}{' ' + self.unit if self.unit else ''}"
        if self.tty:
            now = time.monotonic()
            if done < total and now - self.last_draw < REDRAW:
                return
            self.last_draw = now
            bar = "#" * (WIDTH * done // total)
            self.out.write(f"\r{self.label}: [{bar:<{WIDTH}}] {what}" + ("\n" if done == total else ""))
            self.out.flush()
            return
        q = 4 * done // total
        if q > self.quarter:  # one line per quarter reached
            self.quarter = q
            log.info("%s: %s (%d%%)", self.label, what, 100 * done // total)


def make(label: str, json_mode: bool, unit: str = "", show: Callable[[int], str] = str) -> Progress | None:
    return None if json_mode else Progress(label, unit, show)


def download(label: str, json_mode: bool) -> Progress | None:
    return make(label, json_mode, show=_mb)
