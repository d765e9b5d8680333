"""Wall-clock time that advances with trio's clock.

Records carry absolute expiry times (unix seconds) because they cross machines, yet expiry
logic must follow `trio.current_time()` so tests can run days of protocol time under
trio's autojump clock. Inside a trio run, wall time is the unix time at the run's first
call plus how far trio's clock has moved since; outside a run it is `time.time()`.

The simulator (`p2ptrain.sim`) pins the run's epoch (`pin_epoch`), so a seed replays bit for
bit, and gives each simulated peer a clock error of its own (`skewed`): a context variable,
so every task a peer starts inherits its peer's skew and nothing else changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import time

import trio

_offset: trio.lowlevel.RunVar = trio.lowlevel.RunVar("p2ptrain_wall_offset")
_skew: contextvars.ContextVar[float] = contextvars.ContextVar("p2ptrain_clock_skew", default=0.0)


def wall_time() -> float:
    try:
        now = trio.current_time()
    except RuntimeError:
        return time.time() + _skew.get()
    try:
        offset = _offset.get()
    except LookupError:
        offset = time.time() - now
        _offset.set(offset)
    return offset + now + _skew.get()


def pin_epoch(unix: float) -> None:
    """Inside a trio run: wall time is `unix` at trio time 0 (a deterministic replay)."""
    _offset.set(unix)


@contextlib.contextmanager
def skewed(seconds: float):
    """Tasks started inside see wall time off by `seconds` (a peer whose clock is wrong)."""
    token = _skew.set(seconds)
    try:
        yield
    finally:
        _skew.reset(token)
