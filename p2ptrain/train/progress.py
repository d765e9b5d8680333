"""Progress of long local work (inner steps, checkpoint downloads) for a person watching.

On a terminal: a bar on stderr redrawn in place (log records print above it:
`p2ptrain.console`). Otherwise (a log file, a pipe): a plain log line at each quarter. With
--json: nothing, the events are the output.

How far a peer is towards the steps it will train (`goal`) and when it gets there (`Pace`,
from the measured time between its commits) label the inner-step bar and the committed-step
lines: "outer step 11 (3 of 10) ... ETA 1m09s".
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from typing import Callable, TextIO

from p2ptrain import console
from p2ptrain.events import duration

log = logging.getLogger("p2ptrain.train.progress")
WIDTH = 30
REDRAW = 0.1  # seconds between redraws of a bar


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def goal(committed: int, step: int, max_outer_steps: int, planned_outer_steps: int | None) -> tuple[int, int] | None:
    """(outer steps done, outer steps in all) of what this peer trains towards: its committed
    steps of --max-outer-steps when set, else the run's step of its planned_outer_steps (the
    schedule's length) while within it; None when neither bounds the run."""
    if max_outer_steps:
        return min(committed, max_outer_steps), max_outer_steps
    if planned_outer_steps and step <= planned_outer_steps:
        return step, planned_outer_steps
    return None


def step_label(t: int, goal: tuple[int, int] | None) -> str:
    """The inner-step bar's label while step t trains: "outer step 11 (3 of 10)"."""
    if goal is None or goal[0] >= goal[1]:
        return f"outer step {t}"
    return f"outer step {t} ({goal[0] + 1} of {goal[1]})"


class Pace:
    """Where a peer is in its goal, the seconds per committed outer step measured between
    commits (the last `window` of them: a run speeds up or slows down as peers come and go),
    and the ETA. The first step's clock starts with its inner phase (`bar`), or else at the
    first commit."""

    def __init__(self, max_outer_steps: int = 0, planned_outer_steps: int | None = None, window: int = 5) -> None:
        self.max_outer_steps, self.planned = max_outer_steps, planned_outer_steps
        self.commits: deque[float] = deque(maxlen=window + 1)
        self.at = (0, 0)  # (committed, step) as last seen: the goal an ETA counts from

    def start(self, now: float) -> None:
        if not self.commits:
            self.commits.append(now)

    def goal(self, committed: int, step: int) -> tuple[int, int] | None:
        return goal(committed, step, self.max_outer_steps, self.planned)

    def commit(self, committed: int, step: int, now: float) -> dict:
        """Note a commit; returns what its event adds: goal_done, goal_total, step_seconds
        and eta_seconds (the last two once a step time is measured; nothing without a goal)."""
        self.commits.append(now)
        self.at = (committed, step)
        g = self.goal(committed, step)
        if g is None:
            return {}
        out = {"goal_done": g[0], "goal_total": g[1]}
        sps, eta = self.step_seconds(), self.eta(g[1] - g[0], now)
        if sps is not None:
            out["step_seconds"] = round(sps, 3)
        if eta is not None:
            out["eta_seconds"] = round(eta, 1)
        return out

    def bar(self, t: int, committed: int, step: int, json_mode: bool, now: float) -> "Progress | None":
        """The inner-step progress of step t, labelled with its place in the goal and
        showing the run's ETA (counted from the latest commit: in an overlapped run, step
        t-1 commits while step t's phase trains)."""
        self.start(now)
        self.at = (committed, step)
        g = self.goal(committed, step)
        ahead = max(0, t - step)  # overlapped runs: step t's phase starts before step t-1 commits
        return make(step_label(t, None if g is None else (g[0] + ahead, g[1])), json_mode, "inner steps",
                    eta=None if g is None else self.eta_now)

    def eta_now(self) -> float | None:
        g = self.goal(*self.at)
        return None if g is None else self.eta(g[1] - g[0], time.monotonic())

    def step_seconds(self) -> float | None:
        if len(self.commits) < 2:
            return None
        return (self.commits[-1] - self.commits[0]) / (len(self.commits) - 1)

    def eta(self, remaining: int, now: float) -> float | None:
        """Seconds until `remaining` more steps are committed: the measured step time each,
        less what the current step has already run (a current step slower than the mean
        counts as ending now: the ETA does not fall to 0 while steps remain)."""
        sps = self.step_seconds()
        if sps is None:
            return None
        if remaining <= 0:
            return 0.0
        return max(0.0, sps - (now - self.commits[-1])) + (remaining - 1) * sps


class Progress:
    def __init__(self, label: str, unit: str = "", show: Callable[[int], str] = str, tty: bool | None = None,
                 out: TextIO | None = None, eta: Callable[[], float | None] | None = None) -> None:
        """`eta`, when given, is the whole run's ETA in seconds (None until measured): shown
        instead of the time left in this piece of work, measured from its own rate."""
        self.label = label
        self.unit = unit
        self.show = show
        self.out = out or sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.eta = eta
        self.quarter = 0
        self.last_draw = 0.0
        self.started: float | None = None

    def _left(self, done: int, total: int, now: float) -> str:
        run_eta = self.eta() if self.eta is not None else None
        if run_eta is not None:
            return f", ETA {duration(run_eta)}"
        if self.started is None or done == 0 or done == total:
            return ""
        return f", {duration((now - self.started) * (total - done) / done)} left"

    def __call__(self, done: int, total: int) -> None:
        total = max(total, 1)
        done = min(max(done, 0), total)
        now = time.monotonic()
        if self.started is None:
            self.started = now
        what = f"{self.show(done)}/{self.show(total)}{' ' + self.unit if self.unit else ''}"
        if self.tty:
            if done < total and now - self.last_draw < REDRAW:
                return
            self.last_draw = now
            bar = "#" * (WIDTH * done // total)
            console.draw(self.out, f"{self.label}: [{bar:<{WIDTH}}] {what}{self._left(done, total, now)}",
                         final=done == total)
            return
        q = 4 * done // total
        if q > self.quarter:  # one line per quarter reached
            self.quarter = q
            log.info("%s: %s (%d%%)%s", self.label, what, 100 * done // total, self._left(done, total, now))


def make(label: str, json_mode: bool, unit: str = "", show: Callable[[int], str] = str,
         eta: Callable[[], float | None] | None = None) -> Progress | None:
    return None if json_mode else Progress(label, unit, show, eta=eta)


def download(label: str, json_mode: bool) -> Progress | None:
    return make(label, json_mode, show=_mb)
