"""Wall-clock time that advances with trio's clock.

Records carry absolute expiry times (unix seconds) because they cross machines, yet expiry
logic must follow `trio.current_time()` so tests can run days of protocol time under
trio's autojump clock. Inside a trio run, wall time is the unix time at the run's first
call plus how far trio's clock has moved since; outside a run it is `time.time()`.
"""

from __future__ import annotations

import time

import trio

_offset: trio.lowlevel.RunVar = trio.lowlevel.RunVar("p2ptrain_wall_offset")


def wall_time() -> float:
    try:
        now = trio.current_time()
    except RuntimeError:
        return time.time()
    try:
        offset = _offset.get()
    except LookupError:
        offset = time.time() - now
        _offset.set(offset)
    return offset + now
