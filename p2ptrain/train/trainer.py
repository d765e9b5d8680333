"""A peer's DiLoCo loop over the network: inner steps, election, verified reduction, outer step.

Per outer step t:
  1. H inner AdamW steps (worker thread), then the pseudo-gradient (outer - current params).
  2. A `ready` record for step t; the group comes from the election (`p2ptrain.run.elect`).
  3. One contribution round (`p2ptrain.run.round`): roster confirmation, signed headers, the
     verified all-reduce, retries without the members caught cheating. Nothing is applied
     until a round commits on every member.
  4. Nesterov outer step on the committed average, published as a `state` record
     and served to newcomers; checkpoint written atomically.
A peer that misses a deadline skips the step and adopts the run's head; one alone commits only
while nobody trains near its step (`p2ptrain.train.lineage`, rules H1-H3 of docs/PROTOCOL.md).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import trio

from p2ptrain.ckpt import checkpoint
from p2ptrain.ckpt.download import CheckpointServer
from p2ptrain.ckpt.fetch import BlobServer
from p2ptrain.reduce.robust import RobustConfig
from p2ptrain.reduce.sparse import SparseReducer
from p2ptrain.records import State
from p2ptrain.run import elect, election
from p2ptrain.run.ledger import Ledger
from p2ptrain.run.evidence import BlobEvidence
from p2ptrain.run.lossgate import GateConfig
from p2ptrain.run.round import ContributionRound, Contributor, ReduceService
from p2ptrain.run.roundparts import RoundConfig, attempt_span, merge_budget, transfer_budget
from p2ptrain.run.spec import RunSpec
from p2ptrain.clock import wall_time
from p2ptrain.identity import peer_id_from_str
from p2ptrain.train import progress
from p2ptrain.train.lineage import CATCH_UP_WAIT, Lineage
from p2ptrain.train.scorer import make_scorer

log = logging.getLogger("p2ptrain.train.trainer")


@dataclass
class TrainerConfig:
    max_outer_steps: int = 0
    """Leave cleanly after this many committed outer steps (0 = train until interrupted)."""
    threads: int = 1  # torch threads for inner steps
    min_peers: int = 1
    """At a run's start, wait until this many trainers are ready (a run many start together then never begins alone)."""
    start_timeout: float = 300.0
    """Seconds to wait for min_peers before starting anyway."""
    eval_batches: int = 8
    """Held-out batches scored after each committed step (the val_loss the peer reports)."""
    phase_nice: int = 10
    """Overlapped runs: how much lower the inner-phase thread's CPU priority is than the
    round's (Linux nice steps, 0-19; 0 = the same), so communication is not slowed by the
    inner steps it overlaps on a shared CPU (`p2ptrain.train.phases.run_niced`)."""
    loss_gate: bool = True
    """Sign a round holding a member we have no standing with only if its step lowers the loss
    on a batch its signed headers draw (rule L1, `p2ptrain.run.lossgate`)."""

    def __post_init__(self) -> None:
        if self.max_outer_steps < 0 or self.threads < 1 or self.min_peers < 1 or self.eval_batches < 1:
            raise ValueError("max_outer_steps must be >= 0, threads >= 1, min_peers >= 1, eval_batches >= 1")
        if not 0 <= self.phase_nice <= 19:
            raise ValueError("phase_nice must be within 0..19")


def _lap(tm: dict, part: str, since: float, minus: float = 0.0) -> float:
    """Add the time since `since` (less `minus`, already counted in parts) to `tm[part]`."""
    now = trio.current_time()
    tm[part] = tm.get(part, 0.0) + now - since - minus
    return now


class Trainer(Lineage):
    def __init__(self, node, svc: ReduceService, blobs: BlobServer, writer: checkpoint.AsyncWriter, spec: RunSpec,
                 run_id: str, local, events, config: TrainerConfig, contributor: Contributor | None = None,
                 state_scorer=None) -> None:
        self.node, self.dht, self.spec, self.run_id = node, node.dht, spec, run_id
        self.local, self.events, self.config, self.writer = local, events, config, writer
        self.me = node.identity.peer_id_str
        self.ledger = Ledger(self.me, events)
        robust = RobustConfig() if spec.train.aggregation == "robust" else None
        scorer = make_scorer(local, GateConfig(enabled=config.loss_gate))
        self.state_scorer = state_scorer or scorer  # rules H1 and H3 (`checked_load`)
        # sparse runs (issue 18): compressed all-gather instead of the ring; per-peer error feedback
        sparse = (SparseReducer(spec.train.sparse_config(), local.n_params)
                  if spec.train.allreduce == "sparse" else None)
        merging = merge_budget(svc.config, spec.timeouts.exchange, spec.genesis.bytes)
        self.fetch_timeout = transfer_budget(svc.config, spec.genesis.bytes, CATCH_UP_WAIT)  # a catch-up's
        self.round = ContributionRound(run_id, node.identity, svc, RoundConfig(
            spec.train.allreduce, svc.config.sub_chunk_bytes, spec.timeouts.exchange, robust,
            abort_skew=svc.config.commit_timeout + spec.timeouts.exchange, attempt_span=attempt_span(
                svc.config, merging + spec.timeouts.exchange, 4 * local.n_params, spec.train.group_size)),
            self.ledger, contributor, sparse, bases=self, group_size=spec.train.group_size, merge_timeout=merging,
            scorer=scorer if robust is None else None,
            evidence=BlobEvidence(blobs) if robust is None and sparse is None else None,
            away=lambda t, *peers_tag_others: elect.away(self.dht, run_id, t, self.sightings.level(t), *peers_tag_others))
        self.elect_cfg = elect.ElectConfig(spec.timeouts.join_window, spec.train.group_size)
        self.sightings, self.committed = election.Sightings(), 0  # Sightings: first sight of each ready record
        self.weight = 0 if local.step == 0 else 1  # in merges (run.merge): its round's trainers; adopted 1
        self.last_roster: set[str] = set()
        self._ahead: dict[int, tuple[float, bool]] = {}  # join-ahead step -> (its ready_at, post it as joining)
        self._unsent: tuple | None = None  # (t, delta, loss, tokens, seconds, joining, warm) of a step we skipped
        self._refused: set[str] = set()  # members whose dial was refused (probed again when elected)
        self._expect: dict[int, set[str]] = {}  # step -> peers its election expects (E2), live
        self._warmed = False  # our first trained phase was decided (`warms_up`)
        self._untrained: int | None = None  # E19: a step we joined and nobody trained
        self._rejoined: int | None = None  # T10: a step whose retry we joined (T8) after our skip
        self._tries: dict[int, int] = {}  # step -> the try we post for it (T7: its round tag)
        self.ckpt_server = CheckpointServer(blobs, blobs.config.chunk_kib << 10)
        # Evaluation and the state record of a committed step run beside the next inner phase and round
        # (issue 17), on a copy of the params; the next outer step or catch-up waits for them.
        self._bg: trio.Nursery | None = None
        self._reported: trio.Event | None = None
        self.pace = progress.Pace(config.max_outer_steps, spec.train.planned_outer_steps)  # k of N, ETA

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await self.publish_state(params=await self.reattest())
        self.events.emit("run_joined", run=self.run_id, step=self.local.step, params=self.local.n_params)
        task_status.started()
        if self.local.step == 0 and self.config.min_peers > 1:
            await self.wait_for_peers()
        async with trio.open_nursery() as self._bg:
            joining = await self.sync_with_run()
            if self.spec.train.overlap_scheme != "none":  # issue 17: reduce while the next phase trains
                from p2ptrain.train.overlap import OverlappedLoop

                await OverlappedLoop(self).run(joining)
            else:
                while not self.done():
                    joining = await self.outer_step(joining)
            await self._wait_reported()
        self._bg = None

    def done(self) -> bool:
        """Whether this trainer has committed all the outer steps it was asked for."""
        return bool(self.config.max_outer_steps) and self.committed >= self.config.max_outer_steps

    def last_step(self) -> bool:
        """Whether committing step t would end our run (then we announce no step after it)."""
        return bool(self.config.max_outer_steps) and self.committed + 1 >= self.config.max_outer_steps

    async def outer_step(self, joining: bool) -> bool:
        """One outer step; returns whether the next one starts as a zero-contribution join."""
        t = self.local.step
        retry = self._unsent if self._unsent is not None and self._unsent[0] == t else None
        self._unsent = None
        if retry is not None:
            # We skipped step t and nobody committed it: what we trained for it is still our
            # contribution. Before, we came back as a joiner with zeros, and a peer left alone
            # in its run (the other one killed mid-step) never committed again.
            delta, loss, tokens, sec_inner, joining, warm = retry[1:]
            warm = warm and await self.someone_trains(t)  # W1: alone now, the warm-up's phase is ours to give
            self.events.emit("outer_step_started", step=t, joining=joining or warm, retry=True)
        else:
            if (moved := await self.fell_behind(t)) is not None:  # rule H3: our lineage cannot merge
                joining, t = moved, self.local.step
            if joining and self._rejoined != t and await self._round_underway(t):  # T10: we joined its retry
                await self._join_ahead()
                t = self.local.step
            elif joining and (self._untrained == t or not await self.someone_trains(t)):
                self._untrained = None
                joining = False  # nobody to join: we train the step ourselves
            warm = not joining and await self.warms_up(t)
            self.events.emit("outer_step_started", step=t, joining=joining or warm)
            if joining:
                loss, tokens, sec_inner = math.nan, 0, 0.0
                delta = np.zeros(self.local.outer.numel, np.float32)
            else:
                if (phase := await self.watched_phase(t)) is None:  # E17: the run left step t behind
                    return False
                loss, tokens, sec_inner = phase
                self.events.emit("inner_phase", phase=t, seconds=round(sec_inner, 4), steps=self.local.H)
                delta = await trio.to_thread.run_sync(self.local.pseudo_gradient)
        trained = (t, delta, loss, tokens, sec_inner, False)
        if warm:  # W1: the phase warmed our optimizer; we join the step with zeros (a trained record)
            delta, joining, loss, tokens = np.zeros_like(delta), True, math.nan, 0
        skipped = await self.commit_step(t, delta, joining, loss, tokens, sec_inner, retry=retry is not None, warm=warm)
        if skipped and (warm or not joining) and self.local.step == t:  # a retry keeps what we trained
            refused = not warm and self.round.refused_own == t  # T9: a delta a bound refused is not offered again
            self._unsent = (t, np.zeros_like(delta), math.nan, 0, 0.0, True, False) if refused else (*trained, warm)
        return skipped

    async def warms_up(self, t: int) -> bool:
        """Rule W1: is our first trained phase a warm-up (zeros contributed)? Yes, once per
        process, when we start past the genesis (a fresh AdamW: sign-like first steps, several
        times a warmed-up peer's norm, failed a veteran's probation bound) and others train
        this step: the members we just committed with (not a roster J3 restored), or anyone
        whose records say so. Alone, we contribute it. A warm-up nobody committed is retried
        as one while others still train; alone by then, we give what the phase trained."""
        if self._warmed:
            return False
        self._warmed = True  # decided at our first trained phase, whatever its step
        return t > 0 and (bool(self.committed and self.last_roster - {self.me}) or await self.someone_trains(t))

    async def announce(self, t: int, joining: bool, retry: bool = False, behind: bool = False) -> tuple[list, dict]:
        """Post our ready record for step t and wait out its election: (our group, seconds
        spent). The overlapped loop calls this as soon as step t's base is committed, while
        phase t still trains, so a round starts the moment its phase ends."""
        tm: dict[str, float] = {}
        lap = trio.current_time()
        ready_at, again_joining = self._ahead.pop(t, (None, False))
        self._tries = {k: n for k, n in self._tries.items() if k >= t - 2}
        await elect.publish_ready(self.dht, self.run_id, t, self.node.rpc.local_addrs(), joining or again_joining,
                                  self.elect_cfg.window, ready_at or self.round.contributor.ready_at(wall_time()),
                                  self._tries.get(t, 0))
        lap = _lap(tm, "ready", lap)
        if self.round.config.robust is not None:
            await self.ledger.apply_reputation(self.dht, self.run_id, t)
        # Expected at step t (E2): our last roster, and (overlapped: this election runs beside
        # round t-1) round t-1's group as it forms, added by `commit_step` to this live set.
        self._expect = {k: peers for k, peers in self._expect.items() if k >= t}  # the sets stay live
        expected = self._expect.setdefault(t, set())
        expected |= self.last_roster
        # ...and every candidate of our election of step t-1 (E2): the other groups' members
        # too, whose commits may come after our close. Expecting only our last roster, 16 real
        # processes on 2 cores closed each step on the few records out, and the groups dealt
        # from such partial views disagreed (9 groups at step 2, half the peers skipping it).
        expected |= set(self.sightings.closed.get(t - 1, {})) - {self.me}
        group = await elect.elect(self.dht, self.run_id, t, self.me, self.elect_cfg, self.ledger.ignored,
                                  expected, self._learn, self.sightings, gone=self.round.svc.unreachable,
                                  retry=retry, behind=(lambda: self.behind(t)) if behind else None)
        _lap(tm, "elect", lap)
        return group, tm

    async def commit_step(self, t: int, delta: np.ndarray, joining: bool, loss: float, tokens: int,
                          sec_inner: float, elected: tuple[list[str], dict[str, float]] | None = None,
                          inner_steps: int | None = None, retry: bool = False, warm: bool = False) -> bool:
        """Publish ready, elect, run the round and apply the committed average (or skip and catch up); returns
        whether the next step starts as a zero-contribution join. `elected`: what `announce(t, ...)` returned
        when it ran ahead (its seconds are then reported as "ready_ahead" / "elect_ahead": off the critical
        path). `inner_steps`: what the phase took when it is not H (train.max_inner_steps), signed in our
        header. `retry`: we train step t again after a try nobody committed. `warm` (W1): we
        trained the phase but contribute zeros (a trained ready record)."""
        t_comm = lap = trio.current_time()
        if retry:  # T6: a new election, timed afresh
            self.sightings.forget(t)
        if elected is None:
            group, tm = await self.announce(t, joining and not warm, retry, behind=True)
            lap = trio.current_time()
        else:
            group, tm = elected[0], {f"{k}_ahead": v for k, v in elected[1].items()}
        group = await self._drop_refused(group, retry)
        # T7: this try's round tag (the largest try the group posted); a try nobody commits
        # sends us to the next tag, so a retry never shares a round id with an earlier try
        tag = election.round_tag(self.sightings.closed.get(t, {}), group, self._tries.get(t, 0))
        self._tries[t] = tag + 1
        if not group:
            return await self._skip(t, "not ready by the deadline", untrained=joining and not warm)
        self.events.emit("group_formed", step=t, members=group)
        if t + 1 in self._expect:
            # Step t+1's election is already running beside this round (overlapped runs): its
            # E2 close waits for this group too, not only for the roster before it. Otherwise a
            # member that joined round t with zeros was left out of t+1's early close, skipped
            # t+1, rejoined t+2 with zeros, and so on: it never trained a committed step.
            self._expect[t + 1].update(group)
        base = await trio.to_thread.run_sync(self.local.outer.params_sha256)  # pre-step params
        lap = _lap(tm, "base_hash", lap)
        wait, cut = self._first_wait(t, elected is not None, retry)
        out = await self.round.run(t, delta, group, base, tokens, inner_steps or self.local.H, joining, wait,
                                   weight=self.weight, tag=tag, first_cut=cut,
                                   behind=self.behind_of(t, elected is not None))
        tm.update(out.seconds)
        # Members silent or gone in this round are probed when elected again (G2 left a crashed
        # one out within the round; a group elected ahead with it failed and cost `retry_wait`).
        self._refused |= self.round.silent_seen - {self.me}
        lap = _lap(tm, "round_other", lap, sum(out.seconds.values()))
        if out.result is None:
            return await self._skip(t, "no round committed")
        if out.alone and not await self.may_commit_alone(t, base):
            # Rule H2 (no lone lineage): others train near our step (they missed our deadline,
            # or are a few steps behind): our own delta alone would start a lineage of one
            # beside theirs. Skip, keep the delta for our next try of this step, and catch up
            # to what they commit (or meet them here: the next round merges our states).
            return await self._skip(t, "alone while others train near this step")
        if out.merged is not None:
            self.events.emit("states_merged", step=t, params_sha256=out.merged[1])
        if out.scores is not None:
            await self.ledger.note_outliers(self.dht, self.run_id, t, out.members, out.headers, out.scores)
        # the last step's evaluation and state record read the state we are about to change
        await self._wait_reported()
        lap = _lap(tm, "last_report", lap)
        self.last_roster = set(out.members)

        def apply() -> str:  # a merge round's state first (`p2ptrain.run.merge`), then the step
            if out.merged is not None:
                self.local.load_state_at(out.merged[0])
            return self.local.outer_step(out.average())

        sha = await trio.to_thread.run_sync(apply)
        self.weight = out.weight
        _lap(tm, "outer_step", lap)
        self.committed += 1
        report = dict(step=self.local.step, loss=None if joining else round(loss, 5), params_sha256=sha,
                      bytes_sent=out.bytes_sent, bytes_recv=out.bytes_recv, seconds_inner=round(sec_inner, 3),
                      seconds_comm=round(trio.current_time() - t_comm, 3), members=out.members,
                      parents=list(out.parents if out.merged is not None else (base,)),
                      **({"payload_bytes": out.payload_bytes} if out.payload_bytes is not None else {}),
                      **self.pace.commit(self.committed, self.local.step, time.monotonic()))
        self._reported = trio.Event()
        if self._bg is not None and self.local.evaluates_committed:
            self._bg.start_soon(self._report, t, tm, report, self._reported)
        else:
            await self._report(t, tm, report, self._reported)
        return False

    def _first_wait(self, t: int, ahead: bool, retry: bool) -> tuple[float | None, float | None]:
        """How long the round's first roster confirmation waits for members, and its cut (once
        anyone confirmed, at most this much more). Elected ahead: the election's window (the
        members meet when their phases end). A retry (T5): members come back to a step nobody
        committed as far apart as one stayed in the failed round longer than another, within
        `early_ttl`; waiting the exchange timeout, the early one left just before the other
        came, and both skipped again. A first try: until the others closed (E14)."""
        cfg, ttl, ec = self.round.config, self.spec.timeouts.early_ttl, self.elect_cfg
        if retry or ahead:
            spread = (cfg.max_attempts - 1) * (cfg.exchange_timeout + cfg.abort_skew)
            return (min(ttl, max(ec.window, spread)) if retry else ec.window), None
        return election.confirm_wait(self.sightings.deadlines.get(t), wall_time(), ec.margin + ec.poll_max,
                                     cfg.exchange_timeout, ttl), cfg.exchange_timeout

    async def _report(self, t: int, tm: dict, report: dict, done: trio.Event) -> None:
        """Evaluate the committed params, publish the state record, report the step."""
        lap = trio.current_time()
        committed, nb = self.local.evaluates_committed, self.config.eval_batches
        val = await self._beside_phase(self.local.evaluate, nb, committed)
        lap = _lap(tm, "evaluate", lap)
        await self.publish_state(report["loss"], val, report["params_sha256"])
        _lap(tm, "publish_state", lap)
        self.events.emit("step_timing", step=t, seconds={k: round(v, 4) for k, v in tm.items()})
        self.events.emit("outer_step_committed", val_loss=round(val, 5), **report)
        done.set()

    async def _beside_phase(self, fn, *args):
        """Blocking work that runs beside the next inner phase (evaluation, the state record's
        snapshot and chunk hashes). Overlapped runs give it the phase's lower CPU priority: at
        normal priority this burst, which starts as a round commits, starved the hand-over
        from one phase to the next on a shared CPU (issue 17)."""
        if self.spec.train.overlap_scheme == "none":
            return await trio.to_thread.run_sync(fn, *args)
        from p2ptrain.train.phases import run_niced

        return await run_niced(self.config.phase_nice, fn, *args)

    async def _skip(self, t: int, reason: str, untrained: bool = False) -> bool:
        moved = self.local.step > t  # E16: we adopted a later state while step t's election waited
        if (nobody := untrained and not moved):  # E19: we joined, nobody trains t: we train it, at once
            self._untrained, reason = t, "nobody trains this step: we will"
        self.events.emit("outer_step_skipped", step=t, reason="behind the run: adopted a later state" if moved else reason)
        if not moved:
            await self._wait_reported()  # a catch-up replaces the state the last report reads
            if not nobody:  # (a `retry_wait` would wait for nobody)
                self._rejoined = t if await self.wait_for_retry(t) else None
        return True

    async def _drop_refused(self, group: list[str], retry: bool) -> list[str]:
        """`group` less the members whose dial is refused, probing every member on a retry and
        those refused before otherwise. A member that crashed in a failed try left ready
        records that outlive it (election.ready_ttl: 10 min by default; overlapped runs post
        the next step's ahead), and electing it again fails the same way until they expire.
        Only a refusal counts: a member behind a partition may commit this step with others."""
        suspects = (set(group) if retry else set(group) & self._refused) - {self.me}
        if len(group) < 2 or not suspects:
            return group
        gone = await self.round.svc.unreachable(suspects, refused_only=True)
        self._refused = (self._refused - suspects) | gone  # one that answers again is back
        return [p for p in group if p not in gone]

    def _learn(self, peer: str, addrs: list[str]) -> None:
        self.node.rpc.learn_addrs(peer_id_from_str(peer), addrs)

    def _progress(self, t: int):
        """Inner-step progress: a bar on a terminal, plain log lines otherwise."""
        return self.pace.bar(t, self.committed, self.local.step, self.events.json_mode, time.monotonic())

    async def publish_state(self, loss: float | None = None, val_loss: float | None = None,
                            params: str | None = None) -> None:
        """`params`: the committed params' hash when the caller has it (the outer step
        returns it: hashing them again was part of the burst at every commit)."""
        # Training blocks only for the snapshot; the disk write is the writer's (ckpt.checkpoint.AsyncWriter)
        t0 = time.perf_counter()
        data = await self._beside_phase(self.local.state_bytes)
        snapshot = time.perf_counter() - t0
        self.writer.submit(self.local.step, data)
        params = params or await trio.to_thread.run_sync(self.local.outer.params_sha256)
        addrs = self.node.rpc.local_addrs()
        # Served as verified chunks only (p2ptrain.ckpt.download); the chunking hashes the whole
        # state once, and that hash names it in the state record too.
        served = await self.ckpt_server.publish(self.dht, self.run_id, data, self.local.step, params,
                                                sorted(self.last_roster) if self.local.step else [], addrs,
                                                blocking=self._beside_phase)
        await elect.publish_state(self.dht, self.run_id, State(
            self.local.step, params, served.sha256, loss, val_loss, tuple(addrs), self.node.conn_counts()),
            self.elect_cfg.window)
        self.events.emit("checkpoint_snapshot", step=self.local.step, seconds=round(snapshot, 4), bytes=len(data))
