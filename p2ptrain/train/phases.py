"""The inner phases of an overlapped run (issue 17): where they run and when they end.

`Phase` is one phase's start point and the committed state that lands on it between two
inner steps; `run_phase` runs its inner steps (extending while its round is in flight under
train.max_inner_steps). `PhaseWorker` runs the phases of an overlapped loop back to back in
one thread of its own at lower CPU priority: when a phase ends and the round it overlaps has
landed with `go_on`, the worker computes the phase's contribution and the next phase's start
point itself and trains on, handing the contribution to the trio side. Before, each phase
boundary went through trio (a result hop, a `to_thread` hop and a new thread): 5-90 ms of
idle per phase on contended cores, part of what kept utilization at 0.95 (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time

import torch
import trio

from p2ptrain.train import device as dev
from p2ptrain.train import overlap_math as om

log = logging.getLogger("p2ptrain.train.phases")


class Phase:
    """One inner phase's start point and the committed state waiting to land on it. The
    worker thread calls `land` between inner steps; the trio side calls `post` (a lock:
    the two run in different threads). `awaits_round`: a round is in flight and will post,
    so the phase may extend until it does (`run_phase`, train.max_inner_steps)."""

    def __init__(self, start: torch.Tensor, awaits_round: bool = False) -> None:
        self.start = start
        self.awaits_round = awaits_round
        self._pending: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._posted = threading.Event()
        self.go_on = False
        """Posted with the state: may the next phase start from it without the trio side?"""
        self.landed_at: int | None = None
        """Inner steps done when the committed state landed (None: not yet)."""

    def post(self, committed: torch.Tensor, go_on: bool = False) -> None:
        with self._lock:
            self._pending, self.go_on = committed, go_on
        self._posted.set()

    def has_pending(self) -> bool:
        with self._lock:
            return self._pending is not None

    def wait_posted(self) -> bool:
        """Block until the round this phase overlaps is over; its `go_on`."""
        self._posted.wait()
        return self.go_on

    def waiting(self) -> bool:
        """Is the round this phase overlaps still in flight (nothing posted or landed)?"""
        with self._lock:
            return self.awaits_round and self._pending is None and self.landed_at is None

    def land(self, params: list[torch.Tensor], at_step: int) -> None:
        with self._lock:
            committed, self._pending = self._pending, None
        if committed is None:
            return
        local = dev.gather_to_host(params)
        dev.scatter_from_host(om.rebase(local, self.start, committed), params)
        self.start, self.landed_at = committed, at_step


EXTRA_WINDOWS = 1 << 48
"""Data-window index of a phase's extra steps: disjoint from the regular ones (phase * H + i)."""


def run_phase(local, phase_no: int, phase: Phase, progress=None, urgent=None) -> tuple[float, int, float, int]:
    """H inner steps on phase `phase_no`'s data windows, landing the committed state at the
    first step boundary after it was posted; then, while the round it overlaps is still in
    flight, extra steps up to `local.max_H` rather than idle (on windows of their own, at
    the schedule's current learning rate). (mean loss, tokens, seconds in inner steps with
    their data windows, steps). `urgent(fn, *args)` runs the landing (PhaseWorker: at
    normal priority)."""
    from p2ptrain.train.data import train_batch

    params = list(local.model.parameters())
    local.model.train()
    losses: list = []
    busy, i = 0.0, 0
    while i < local.H or (i < local.max_H and phase.waiting()):
        if phase.has_pending():  # the landing, at normal priority when a worker gives one
            (urgent or _call)(phase.land, params, i)
        regular = i < local.H
        window = phase_no * local.H + i if regular else EXTRA_WINDOWS + phase_no * local.max_H + i
        t0 = time.perf_counter()  # data windows count, as in the sequential loop's phase
        tokens = train_batch(local.ds, local.peer_id, window, local.batch, local.seq_len, local.seed)
        local.inner_step(dev.to_device(tokens, local.device), losses, schedule=regular)
        busy += time.perf_counter() - t0
        i += 1
        if progress is not None and regular:
            progress(i, local.H)
    local.inner_done += i
    mean = float(torch.stack(losses).double().mean())
    return mean, i * local.batch * local.seq_len, busy, i


def _call(fn, *args):
    return fn(*args)


def lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority by `nice` steps (Linux: a thread's own)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # e.g. a sandbox without setpriority: run at normal priority
        log.info("inner phase priority unchanged: %s", exc)


async def run_niced(nice: int, fn, *args):
    """`fn(*args)` in a thread of its own whose CPU priority is `nice` steps lower (Linux: a
    thread's nice value is its own). Inner steps are throughput work and the round beside
    them is latency work: on a host whose cores the two share, an even split stretched the
    round past the phase (issue 17: 4 peers on 2 cores, reduce 0.14 s alone, 0.34-0.47 s
    beside inner steps). A thread of its own because trio's worker threads are reused and an
    unprivileged process cannot raise a thread's priority back. Like `trio.to_thread`, the
    wait is not cancellable: the thread owns the model until it returns."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return await trio.to_thread.run_sync(fn, *args)
    token, done, box = trio.lowlevel.current_trio_token(), trio.Event(), {}

    def body() -> None:
        try:
            lower_priority(nice)
            box["value"] = fn(*args)
        except BaseException as exc:  # re-raised in trio
            box["error"] = exc
        finally:
            try:
                trio.from_thread.run_sync(done.set, trio_token=token)
            except trio.RunFinishedError:
                pass

    threading.Thread(target=body, name="p2ptrain-inner-phase", daemon=True).start()
    with trio.CancelScope(shield=True):
        await done.wait()
    if "error" in box:
        raise box["error"]
    return box["value"]


class PhaseWorker:
    """Phases back to back in one thread at `nice` steps lower priority (module docstring).
    `submit(no, phase)` starts a run of phases at phase `no`; the thread runs it, waits for
    its round's post, and continues with the next phase while the post says `go_on`. Every
    phase's outcome goes to `send` (a trio memory channel) as (no, result of `run_phase`,
    phase, contribution, next phase or None, end time), or the exception that ended it.
    `turn(phase, steps, go_on)` gives the contribution and the next phase (or None)."""

    def __init__(self, local, turn, nice: int, send, emit, progress) -> None:
        self.local, self.turn, self.nice, self.send = local, turn, nice, send
        self.emit, self.progress = emit, progress
        self.token = trio.lowlevel.current_trio_token()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.urgent = Urgent()  # started from trio's thread: normal priority
        threading.Thread(target=self._body, name="p2ptrain-inner-phases", daemon=True).start()

    def submit(self, no: int, phase: Phase) -> None:
        self.jobs.put((no, phase))

    def stop(self) -> None:
        self.jobs.put(None)
        self.urgent.stop()

    def _soon(self, fn, *args, **kw) -> None:
        try:
            self.token.run_sync_soon(functools.partial(fn, *args, **kw))
        except trio.RunFinishedError:
            pass

    def _body(self) -> None:
        lower_priority(self.nice)
        while (job := self.jobs.get()) is not None:
            no, phase = job
            try:
                while phase is not None:
                    self._soon(self.emit, "inner_phase_started", phase=no, overlaps_round=no - 1,
                               t=round(time.time(), 3))
                    res = run_phase(self.local, no, phase, self.progress(no), self.urgent)
                    ended = time.time()
                    delta, nxt = self.urgent(self.turn, phase, res[3], phase.wait_posted())
                    self._soon(self.send.send_nowait, (no, res, phase, delta, nxt, ended))
                    no, phase = no + 1, nxt
            except BaseException as exc:  # re-raised on the trio side
                self._soon(self.send.send_nowait, exc)


class Urgent:
    """A thread at normal priority that runs the phase worker's hand-over work for it (the
    landing, the contribution and next start point) while the worker waits: at nice +10
    behind the process's other work, that took 5-85 ms per phase on contended cores."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._body, name="p2ptrain-phase-handover", daemon=True).start()

    def __call__(self, fn, *args):
        box: dict = {}
        done = threading.Event()
        self.jobs.put((fn, args, box, done))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stop(self) -> None:
        self.jobs.put(None)

    def _body(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, args, box, done = job
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc
            finally:
                done.set()
