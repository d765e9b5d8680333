"""The inner phases of an overlapped run (issue 17): where they run and when they end.

`Phase` is one phase's start point and the start points that land on it between two inner
steps (the committed state of the round it overlaps, or the hand-over's eager start);
`run_phase` runs its inner steps (extending while its round is in flight under
train.max_inner_steps). `PhaseWorker` runs the phases of an overlapped loop back to back in
one thread of its own at lower CPU priority: when a phase ends and the round it overlaps has
landed with `go_on`, the worker snapshots the params and trains on at once, while a
normal-priority thread computes the phase's contribution and the next start point beside
it. Before, each phase boundary went through trio (a result hop, a `to_thread` hop and a new
thread), then through a hand-over computed before the next phase: 5-110 ms of idle per
phase on contended cores, what kept utilization at 0.95-0.96 (BENCHMARKS.md)"""

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
    """One inner phase's start point and the start points that land on it between inner
    steps: the committed state of the round it overlaps (`post`, from trio), or a better
    start computed after the phase began (`shift`: the hand-over's eager start, PhaseWorker).
    The worker thread calls `land`; the others post (a lock: they run in other threads).
    `awaits_round`: a round is in flight and will post, so the phase may extend until it
    does (`run_phase`, train.max_inner_steps).

    A landing moves the local params and the start point by the same vector, target - start
    (overlap_math.rebase), so the phase's contribution, start - params, is its own progress
    whatever landed. Posters compute that offset, so the worker's landing is one in-place
    add per tensor; before any inner step it is an exact copy of the target instead (the
    params are then the start itself, and a round that lands there makes the phase exactly
    synchronous DiLoCo)."""

    def __init__(self, start: torch.Tensor, awaits_round: bool = False, exact: bool = True) -> None:
        self.start = start
        """Where the params' progress is measured from: the last start point landed."""
        self.awaits_round = awaits_round
        self.exact = exact
        """The params equal `start` before the first step, so a landing there copies (False in
        streaming runs: each fragment's start point is its own, p2ptrain.train.fragments)."""
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (target, target - start)
        self._lands = 0  # landings so far: an offset computed against an older start is stale
        self._round = False  # the committed state is posted (landed or pending)
        self._lock = threading.Lock()
        self._posted = threading.Event()
        self.go_on = False
        """Posted with the state: may the next phase start from it without the trio side?"""
        self.landed_at: int | None = None
        """Inner steps done when the committed state landed (None: not yet)."""
        self.shifted_at: int | None = None
        """Inner steps done when a shifted start point landed (None: none did)."""

    def post(self, committed: torch.Tensor, go_on: bool = False) -> None:
        """The round is over: `committed` is the state the peer now holds."""
        self._set(committed, True, go_on)
        self._posted.set()

    def shift(self, target: torch.Tensor) -> None:
        """Start from `target` instead (dropped once the committed state is posted: it wins)."""
        self._set(target, False)

    def _set(self, target: torch.Tensor, committed: bool, go_on: bool = False) -> None:
        # The offset is computed outside the lock, so the worker never waits for it; a landing
        # in between moves the start, and it is computed again (under the lock the third time).
        for attempt in range(3):
            with self._lock:
                start, lands = self.start, self._lands
            offset = None if attempt == 2 else target - start
            with self._lock:
                if lands != self._lands:
                    continue
                if self._round and not committed:
                    return
                self._pending = (target, target - self.start if offset is None else offset)
                if committed:
                    self._round, self.go_on = True, go_on
                return

    def has_pending(self) -> bool:
        with self._lock:
            return self._pending is not None

    def wait_posted(self) -> bool:
        """Block until the round this phase overlaps is over; its `go_on`."""
        self._posted.wait()
        return self.go_on

    def waiting(self) -> bool:
        """Is the round this phase overlaps still in flight (nothing posted)?"""
        with self._lock:
            return self.awaits_round and not self._round

    def land(self, params: list[torch.Tensor], at_step: int) -> None:
        """Move `params` by the pending offset (`at_step` inner steps into the phase)."""
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is None:
                return
            self.start, self._lands = pending[0], self._lands + 1
            if self._round and self.landed_at is None:
                self.landed_at = at_step
            elif not self._round:
                self.shifted_at = at_step
        if at_step == 0 and self.exact:
            dev.scatter_from_host(pending[0], params)
        else:
            dev.scatter_from_host(pending[1], params, add=True)


EXTRA_WINDOWS = 1 << 48
"""Data-window index of a phase's extra steps: disjoint from the regular ones (phase * H + i)."""


def run_phase(local, phase_no: int, phase: Phase, progress=None) -> tuple[float, int, float, int]:
    """H inner steps on phase `phase_no`'s data windows, landing what was posted (`Phase`) at
    the first step boundary after it; then, while the round it overlaps is still in flight,
    extra steps up to `local.max_H` rather than idle (on windows of their own, at the
    schedule's current learning rate). (mean loss, tokens, seconds in inner steps with their
    data windows, steps). Each step's batch is made before the landing check, so a start
    point the hand-over is still computing (PhaseWorker) has that long to arrive."""
    from p2ptrain.train.data import train_batch

    params = list(local.model.parameters())
    local.seek_schedule(phase_no)  # the run's lr at this phase, wherever this peer started
    local.model.train()
    losses: list = []
    busy, i = 0.0, 0
    while i < local.H or (i < local.max_H and phase.waiting()):
        regular = i < local.H
        window = phase_no * local.H + i if regular else EXTRA_WINDOWS + phase_no * local.max_H + i
        t0 = time.perf_counter()  # data windows count, as in the sequential loop's phase
        tokens = dev.to_device(train_batch(local.ds, local.peer_id, window, local.batch, local.seq_len, local.seed),
                               local.device)
        t1 = time.perf_counter()
        if phase.has_pending():  # outer work: not counted
            phase.land(params, i)
        t2 = time.perf_counter()
        local.inner_step(tokens, losses, schedule=regular)
        busy += t1 - t0 + time.perf_counter() - t2
        i += 1
        if progress is not None and regular:
            progress(i, local.H)
    local.inner_done += i
    mean = float(torch.stack(losses).double().mean())
    return mean, i * local.batch * local.seq_len, busy, i


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

    The hand-over takes only a snapshot of the params: the next phase starts training from
    them at once, while a normal-priority thread (`Urgent`) runs `turn(phase, end, nxt, no)`,
    which returns the contribution and gives `nxt` its start point with `Phase.shift` (it
    lands between two steps, usually before the first). Computed before the next phase
    could start, the hand-over took 5-110 ms per 0.9 s phase on contended cores, most of
    what kept utilization at 0.95-0.96 (BENCHMARKS.md). Without `go_on`, `finish(phase,
    steps)` lands and contributes, and the trio side decides what comes next."""

    def __init__(self, local, turn, finish, nice: int, send, emit, progress, successor=None) -> None:
        self.local, self.turn, self.finish, self.nice, self.send = local, turn, finish, nice, send
        self.successor = successor or (lambda phase, end, no: Phase(end, awaits_round=True))
        """(phase, its end params, its number) -> the next phase, before its first step."""
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
        params = list(self.local.model.parameters())
        while (job := self.jobs.get()) is not None:
            no, phase = job
            try:
                while phase is not None:
                    self._soon(self.emit, "inner_phase_started", phase=no, overlaps_round=no - 1,
                               t=round(time.time(), 3))
                    res = run_phase(self.local, no, phase, self.progress(no))
                    ended = time.time()
                    if phase.wait_posted():
                        end = dev.gather_to_host(params)
                        nxt = self.successor(phase, end, no)  # the params are there already
                        self.urgent.submit(self._handover, no, res, phase, end, nxt, ended)
                    else:
                        nxt = None
                        delta = self.urgent(self.finish, phase, res[3])
                        self._soon(self.send.send_nowait, (no, res, phase, delta, None, ended))
                    no, phase = no + 1, nxt
            except BaseException as exc:  # re-raised on the trio side
                self._soon(self.send.send_nowait, exc)

    def _handover(self, no: int, res: tuple, phase: Phase, end: torch.Tensor, nxt: Phase, ended: float) -> None:
        try:
            delta = self.turn(phase, end, nxt, no)
        except BaseException as exc:  # re-raised on the trio side
            self._soon(self.send.send_nowait, exc)
        else:
            self._soon(self.send.send_nowait, (no, res, phase, delta, nxt, ended))


class Urgent:
    """A thread at normal priority that runs the phase worker's hand-over work (the next
    start point and the contribution): at nice +10 behind the process's other work, that
    took 5-85 ms per phase on contended cores. `submit` queues a job; calling waits for it."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._body, name="p2ptrain-phase-handover", daemon=True).start()

    def submit(self, fn, *args) -> None:
        self.jobs.put((fn, args, None, None))

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
            if done is None:  # submitted: fn reports its own outcome
                fn(*args)
                continue
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc
            finally:
                done.set()
