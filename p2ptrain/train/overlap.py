"""The overlapped outer loop (issue 17): round t reduces while the inner steps of t+1 train.

Per outer step t (the arithmetic is `p2ptrain.train.overlap_math`):
  1. the next phase's start point is set by the run's scheme (delayed: the local params as
     they are; eager: the outer step with this peer's own delta standing in for the average);
  2. in one trio nursery: the inner steps of phase t+1 in a worker thread, the trainer's
     own round for step t (`Trainer.commit_step`: verified round, outer step on the
     committed average, state record -- or skip and catch up), and the ready record and
     election for step t+1 (`Trainer.announce`), so round t+1 starts the moment phase t+1
     ends (issue 17: ready + election were ~0.3-0.7 s of a round). The base hash is checked
     by round t+1's roster confirmation, not by the election;
  3. when the round is over, the peer's committed state (new, caught up, or unchanged after
     a failed round) is posted to the phase, which rebases the local params onto it between
     two inner steps (or after the phase, when the round took longer);
  4. the phase's contribution is its own progress, start - end.
The committed state (outer params, momentum, step) changes only in `commit_step`, exactly
as in the sequential loop, so members stay bit-identical and commit-or-abort holds; what
differs is only where the local params train. `LocalModel.detached` keeps outer steps,
adopted states and evaluation off the model the worker thread is training.

At most one round is in flight: a phase that ends before its round waits for it (round t+1
needs x_{t+1} as its base). A newcomer joins two steps ahead (`_join_ahead`: the election
for t+1 closes while round t runs) and contributes zeros to its first round while its first
phase trains. A member that skipped round t but caught up to t+1, for which it was already
elected, joins round t+1 with zeros rather than leave its group waiting for it. A failed
round lands as the state the peer then holds: when that is the old state, the phase's
progress is rebased onto it and contributed to the retried step; when the peer caught up
past it (and was not elected for that step), it rejoins ahead like a newcomer.
Known cost: a member whose early ready record went stale (its round t failed and it stayed
at t) is waited for by round t+1's group up to the join window before they drop it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time

import numpy as np
import torch
import trio

from p2ptrain.train import device as dev
from p2ptrain.train import overlap_math as om

log = logging.getLogger("p2ptrain.train.overlap")


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
        self.landed_at: int | None = None
        """Inner steps done when the committed state landed (None: not yet)."""

    def post(self, committed: torch.Tensor) -> None:
        with self._lock:
            self._pending = committed

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


def run_phase(local, phase_no: int, phase: Phase, progress=None) -> tuple[float, int, float, int]:
    """H inner steps on phase `phase_no`'s data windows, landing the committed state at the
    first step boundary after it was posted; then, while the round it overlaps is still in
    flight, extra steps up to `local.max_H` rather than idle (on windows of their own, at
    the schedule's current learning rate). (mean loss, tokens, seconds in inner steps with
    their data windows, steps)."""
    from p2ptrain.train.data import train_batch

    params = list(local.model.parameters())
    local.model.train()
    losses: list = []
    busy, i = 0.0, 0
    while i < local.H or (i < local.max_H and phase.waiting()):
        phase.land(params, i)
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
            tid = threading.get_native_id()
            try:
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
            except OSError as exc:  # e.g. a sandbox without setpriority: run at normal priority
                log.info("inner phase priority unchanged: %s", exc)
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


class OverlappedLoop:
    def __init__(self, trainer) -> None:
        self.tr, self.local = trainer, trainer.local
        self.scheme = trainer.spec.train.overlap_scheme
        self.nice = trainer.config.phase_nice
        self.local.detached = True

    def _params(self) -> list[torch.Tensor]:
        return list(self.local.model.parameters())

    def _first_phase(self) -> Phase:
        """Phase starting from the committed state (the model may hold an older one after a
        catch-up: `detached` adopts states without touching it)."""
        start = self.local.outer.outer.clone()
        dev.scatter_from_host(start, self._params())
        return Phase(start)

    def _next_phase(self, delta: torch.Tensor) -> Phase:
        out = self.local.outer
        local = dev.gather_to_host(self._params())
        start = om.phase_start(self.scheme, out.outer, out.momentum, local, delta, out.cfg.lr, out.cfg.momentum,
                               out.cfg.nesterov)
        if self.scheme != "delayed":  # delayed starts where the model already is
            dev.scatter_from_host(start, self._params())
        return Phase(start, awaits_round=True)

    def _finish(self, phase: Phase, steps: int) -> np.ndarray:
        """Land a state that arrived after the phase's last step; the phase's contribution."""
        phase.land(self._params(), steps)
        local = dev.gather_to_host(self._params())
        return np.ascontiguousarray(om.contribution(phase.start, local).numpy(), np.float32)

    def _turn(self, phase: Phase, steps: int, go_on: bool) -> tuple[np.ndarray, Phase | None]:
        """`_finish`, then (`go_on`: the committed state is the next phase's base) the next
        phase's start point from that contribution."""
        delta = self._finish(phase, steps)
        return delta, self._next_phase(torch.from_numpy(delta)) if go_on else None

    async def _join_ahead(self) -> None:
        """Join two steps ahead (`Trainer._join_ahead`). Others post their ready record for
        step t+1 when round t starts, before state t is even published, so a peer that adopts
        state t is too late for rounds t and t+1."""
        await self.tr._join_ahead(2)

    async def _announce(self, t: int, into: dict) -> None:
        into["elected"] = await self.tr.announce(t, False)

    async def run(self, joining: bool) -> None:
        tr, local = self.tr, self.local
        if joining:
            await self._join_ahead()
        phase = self._first_phase()
        if joining:  # others train this step already: join its round with zeros at once
            res = (math.nan, 0, 0.0, 0)
            delta = np.zeros(local.outer.numel, np.float32)
        else:
            res = await trio.to_thread.run_sync(run_phase, local, local.step, phase, tr._progress(local.step))
            tr.events.emit("inner_phase", phase=local.step, seconds=round(res[2], 4), steps=res[3], landed_at=None)
            delta = await trio.to_thread.run_sync(self._finish, phase, res[3])
        elected, ahead = None, None
        while not tr.done():
            t = local.step
            tr.events.emit("outer_step_started", step=t, joining=joining, overlap=self.scheme)
            phase = ahead or await trio.to_thread.run_sync(self._next_phase, torch.from_numpy(delta))
            nxt: dict = {}

            async def train_next() -> None:
                nxt["res"] = await run_niced(self.nice, run_phase, local, t + 1, phase, tr._progress(t + 1))

            async with trio.open_nursery() as nursery:
                tr.events.emit("inner_phase_started", phase=t + 1, overlaps_round=t)
                nursery.start_soon(train_next)
                if not tr.last_step():
                    # Ready record and election for step t+1 beside round t: its round starts
                    # the moment phase t+1 ends (the roster confirmation checks the base).
                    nursery.start_soon(self._announce, t + 1, nxt)
                skipped = await tr.commit_step(t, delta, joining, *res[:3], elected=elected,
                                               inner_steps=res[3] or local.H)
                # whatever the peer now holds: the new state, a caught-up one, or the old one
                phase.post(local.outer.outer.clone())
            elected = nxt.get("elected") if local.step == t + 1 else None
            res = nxt["res"]
            tr.events.emit("inner_phase", phase=t + 1, seconds=round(res[2], 4), steps=res[3],
                           landed_at=phase.landed_at if phase.landed_at is not None else res[3])
            joining = False
            caught_up = skipped and local.step > t
            # One thread hop for this phase's contribution and the next phase's start point:
            # on contended cores each hop cost 5-50 ms of idle between phases (issue 17).
            delta, ahead = await trio.to_thread.run_sync(self._turn, phase, res[3], not caught_up and not tr.done())
            if caught_up:
                # Caught up past our round. Elected for the step we adopted (we announced it
                # beside the round): join its round at once with zeros, as its group expects
                # us. Otherwise, like a newcomer, we would be late for it. Either way the
                # phase's progress belongs to a step the group is done with.
                if elected is None or tr.me not in elected[0]:
                    elected = None
                    await self._join_ahead()
                phase = await trio.to_thread.run_sync(self._first_phase)
                res, joining = (math.nan, 0, 0.0, 0), True
                delta = np.zeros(local.outer.numel, np.float32)
