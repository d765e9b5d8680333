"""Shared test helpers: trio runner with a fake clock, and real-process helpers."""

from __future__ import annotations

import functools

import trio
import trio.testing


def trio_test(autojump: bool = True):
    """Run an async test under trio; with `autojump`, the clock jumps whenever all tasks
    sleep, so protocol timeouts and expiry take no real time."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            clock = trio.testing.MockClock(autojump_threshold=0) if autojump else None
            return trio.run(functools.partial(fn, *args, **kwargs), clock=clock)

        return wrapper

    return deco
