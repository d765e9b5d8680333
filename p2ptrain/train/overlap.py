"""The overlapped outer loop (issue 17): round t reduces while the inner steps of t+1 train.

Per outer step t (the arithmetic is `p2ptrain.train.overlap_math`):
  1. the next phase's start point is set by the run's scheme (delayed: the local params as
     they are; eager: the outer step with this peer's own delta standing in for the average).
     The phase worker computes it beside the next phase's first steps, which train from the
     last phase's end until it lands (`phases.PhaseWorker`; usually before the first step);
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

import numpy as np
import torch
import trio

from p2ptrain.train import device as dev
from p2ptrain.train import overlap_math as om
from p2ptrain.train.fragments import Fragments
from p2ptrain.train.phases import Phase, PhaseWorker, run_phase

log = logging.getLogger("p2ptrain.train.overlap")


class OverlappedLoop:
    def __init__(self, trainer) -> None:
        self.tr, self.local = trainer, trainer.local
        self.scheme = trainer.spec.train.overlap_scheme
        self.nice = trainer.config.phase_nice
        self.local.detached = True
        self.frags = getattr(self.local, "frags", None) or Fragments(self.local.outer.numel)
        """Streaming runs (train.fragments): step t reduces and restarts fragment t mod P only."""
        self.prev: Phase | None = None  # the last phase created: its start points carry on
        self.warm_step: int | None = None  # W1: the step whose phase warmed a fresh optimizer (zeros)

    def _params(self) -> list[torch.Tensor]:
        return list(self.local.model.parameters())

    def _first_phase(self) -> Phase:
        """Phase starting from the committed state (the model may hold an older one after a
        catch-up: `detached` adopts states without touching it)."""
        start = self.local.outer.outer.clone()
        dev.scatter_from_host(start, self._params())
        self.prev = Phase(start)
        return self.prev

    def _next_phase(self, delta: torch.Tensor, t: int) -> Phase:
        """The phase beside round t (contribution `delta`, full length), from the trio side."""
        out, fr = self.local.outer, self.frags
        local = dev.gather_to_host(self._params())
        start = om.phase_start(self.scheme, fr.part(out.outer, t), fr.part(out.momentum, t), fr.part(local, t),
                               fr.part(delta, t), out.cfg.lr, out.cfg.momentum, out.cfg.nesterov)
        if fr.P > 1:  # only fragment f(t) restarts; the others keep their start points
            frag, start = start, self.prev.start.clone()
            fr.put(start, t, frag)
            fr.put(local, t, frag)
        if self.scheme != "delayed":  # delayed starts where the model already is
            dev.scatter_from_host(start if fr.P == 1 else local, self._params())
        self.prev = Phase(start, awaits_round=True, exact=fr.P == 1)
        return self.prev

    def _successor(self, phase: Phase, end: torch.Tensor, no: int) -> Phase:
        """The phase after `phase` (number `no`) in the worker, before its first step: its start
        points are `phase`'s, with step `no`'s fragment restarting from where it ended (the
        hand-over then shifts it to the scheme's start, `_turn`)."""
        if self.frags.P == 1:
            return Phase(end, awaits_round=True)
        start = phase.start.clone()
        self.frags.put(start, no, self.frags.part(end, no))
        return Phase(start, awaits_round=True, exact=False)

    def _finish(self, phase: Phase, steps: int) -> np.ndarray:
        """Land a state that arrived after the phase's last step; the phase's contribution."""
        phase.land(self._params(), steps)
        local = dev.gather_to_host(self._params())
        return np.ascontiguousarray(om.contribution(phase.start, local).numpy(), np.float32)

    def _turn(self, phase: Phase, end: torch.Tensor, nxt: Phase, no: int) -> np.ndarray:
        """The hand-over (PhaseWorker, beside phase `nxt`, which trains from `end` already):
        `phase`'s contribution (to step `no`), and `nxt`'s start point by the run's scheme,
        shifted onto it. The committed state was posted to `phase` (go_on), landed or not:
        the contribution is start - end either way (a landing moves both), and a state that
        did not land is in the start point (delayed: rebased onto it; eager: the step from
        it). Streaming: only fragment f(no) restarts; every other fragment's target is the
        committed state, which lands a state `phase` did not (elsewhere the offset is 0)."""
        delta = om.contribution(phase.start, end)
        out, fr = self.local.outer, self.frags
        if self.scheme != "delayed":
            part = om.phase_start(self.scheme, fr.part(out.outer, no), fr.part(out.momentum, no), fr.part(end, no),
                                  fr.part(delta, no), out.cfg.lr, out.cfg.momentum, out.cfg.nesterov)
        elif phase.landed_at is None or fr.P > 1:
            part = om.rebase(fr.part(end, no), fr.part(phase.start, no), fr.part(out.outer, no))
        else:
            part = None
        if part is not None and fr.P == 1:
            nxt.shift(part)
        elif part is not None:
            target = out.outer.clone()
            fr.put(target, no, part)
            nxt.shift(target)
        return np.ascontiguousarray(delta.numpy(), np.float32)

    async def _join_ahead(self) -> None:
        """Join two steps ahead (`Trainer._join_ahead`). Others post their ready record for
        step t+1 when round t starts, before state t is even published, so a peer that adopts
        state t is too late for rounds t and t+1."""
        await self.tr._join_ahead(2, and_next=True)

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
            warm = await tr.warms_up(local.step)  # the phase warms a fresh optimizer: zeros
            res = await trio.to_thread.run_sync(run_phase, local, local.step, phase, tr._progress(local.step))
            tr.events.emit("inner_phase", phase=local.step, seconds=round(res[2], 4), steps=res[3], landed_at=None)
            delta = await trio.to_thread.run_sync(self._finish, phase, res[3])
            if warm:
                res, joining, delta = (math.nan, 0, 0.0, 0), True, np.zeros_like(delta)
                self.warm_step = local.step
        send, self._results = trio.open_memory_channel(math.inf)
        worker = PhaseWorker(local, self._turn, self._finish, self.nice, send, tr.events.emit, tr._progress,
                             self._successor)
        elected, ahead, retry = None, None, False
        try:
            while not tr.done():
                t = local.step
                tr.events.emit("outer_step_started", step=t, joining=joining, overlap=self.scheme)
                if ahead is None:  # the worker waits for its next run of phases
                    ahead = await trio.to_thread.run_sync(self._next_phase, torch.from_numpy(delta), t)
                    worker.submit(t + 1, ahead)
                res, delta, ahead, skipped, elected = await self._cycle(t, ahead, delta, joining, res, elected, retry)
                retry = skipped and local.step == t  # nobody committed step t: we try it again
                joining = False
                if skipped and local.step > t:
                    # Caught up past our round. Elected for the step we adopted (we announced
                    # it beside the round): join its round at once with zeros, as its group
                    # expects us. Otherwise, like a newcomer, we would be late for it. Either
                    # way the phase's progress belongs to a step the group is done with.
                    if elected is None or tr.me not in elected[0]:
                        elected = None
                        await self._join_ahead()
                    await trio.to_thread.run_sync(self._first_phase)  # (self.prev)
                    res, joining = (math.nan, 0, 0.0, 0), True
                    delta = np.zeros(local.outer.numel, np.float32)
        finally:
            worker.stop()

    async def _cycle(self, t: int, phase: Phase, delta: np.ndarray, joining: bool, res: tuple, elected,
                     retry: bool = False):
        """Round t (and the election for t+1) beside phase t+1, which the worker trains;
        (phase t+1's result, its contribution, phase t+2 when the worker went straight on,
        whether round t was skipped, the group elected for t+1 if we are at t+1). `retry`:
        a try of round t before this one committed nowhere (`Trainer.commit_step`)."""
        tr, local = self.tr, self.local
        nxt: dict = {}
        async with trio.open_nursery() as nursery:
            if not tr.last_step():
                # Ready record and election for step t+1 beside round t: its round starts
                # the moment phase t+1 ends (the roster confirmation checks the base).
                nursery.start_soon(self._announce, t + 1, nxt)
            skipped = await tr.commit_step(t, self.frags.part(delta, t), joining, *res[:3], elected=elected,
                                           inner_steps=res[3] or local.H, retry=retry, warm=t == self.warm_step)
            # Whatever the peer now holds: the new state, a caught-up one, or the old one. The
            # worker goes straight on only from a step we committed (a failed round retries
            # step t with phase t+1 again, a catch-up rejoins; both go through `run`).
            go_on = not skipped and local.step == t + 1 and not tr.done()
            await trio.to_thread.run_sync(lambda: phase.post(local.outer.outer.clone(), go_on))
        with trio.CancelScope(shield=True):  # the worker owns the model until it reports
            got = await self._results.receive()
        if isinstance(got, BaseException):
            raise got
        no, res, done_phase, delta, ahead, ended = got
        if (no, done_phase) != (t + 1, phase):
            raise RuntimeError(f"phase worker reported phase {no}, expected {t + 1}")
        self.prev = ahead or done_phase
        tr.events.emit("inner_phase", phase=t + 1, seconds=round(res[2], 4), steps=res[3], t=round(ended, 3),
                       landed_at=phase.landed_at if phase.landed_at is not None else res[3],
                       shifted_at=phase.shifted_at)
        return res, delta, ahead, skipped, nxt.get("elected") if local.step == t + 1 else None
