"""Our loss gate inside a round (rules L1, L2: `p2ptrain.run.lossgate`), as the all-reduce
service runs it in its worker thread, between the data plane and the votes.

Two things are the round's business, not the gate's: the seconds it scores are kept out of
the round's data budget (scoring is our own work, not a slow sender's), and once another
member's abort vote arrives the attempt is over, so the gate stops at its next forward pass
(`checkpoint` raises). Scoring on, a member the others had left out (its evidence failed)
learned it only when its own scoring ended, ~10 s later on 2 loaded cores with the tests'
tiny model, and the others' next election waited for it that long
(tests/test_checkpoint_join.py's newcomer run)."""

from __future__ import annotations

import threading
import time

from p2ptrain.reduce.schedule import RingError


class GateRun:
    """One attempt's gate: `run(gate, result)` in the worker thread; `aborted` is set by the
    service's abort watcher; `spent` and `under_way()` are read by its budget timer."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.spent = 0.0
        """Seconds our gate has scored in this attempt."""
        self._since: float | None = None

    def under_way(self) -> float:
        """Seconds the scoring under way has taken so far (0 when none is)."""
        since = self._since
        return time.perf_counter() - since if since is not None else 0.0

    def checkpoint(self) -> None:
        """Raises RingError once another member aborted the attempt."""
        if self.aborted.is_set():
            raise RingError("a member's abort vote arrived while our loss gate scored")

    def run(self, gate, result) -> str | None:
        """`gate(result, checkpoint)`: a reason not to sign, or None; raises RingError when
        an abort vote stopped it."""
        self._since = time.perf_counter()
        try:
            return gate(result, self.checkpoint)
        finally:
            self.spent += time.perf_counter() - self._since
            self._since = None
