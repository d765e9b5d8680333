"""A peer's DiLoCo loop over the network: inner steps, election, verified reduction, outer step.

Per outer step t:
  1. H inner AdamW steps (worker thread), then the pseudo-gradient (outer - current params).
  2. A signed `ready` record for step t in the DHT; the group comes from `p2ptrain.run.election`
     over the records seen once the step's deadline (earliest ready + join window) passed.
  3. Attempts, each with a fresh roster: confirm the roster hash with every member; exchange
     signed contribution headers and verify them (`p2ptrain.run.contribution`); run the int8
     ring with every frame held to those headers. A member caught cheating is excluded,
     logged (`contribution_rejected`) and ignored for the rest of the run; a member that
     vanished drops out at the next roster confirmation. Nothing is applied until a round
     commits on every member.
  4. Nesterov outer step on the committed average, published as a `state` record (step,
     params hash, checkpoint hash) and served to newcomers; checkpoint written atomically.
A peer that misses a deadline skips the step and catches up from the members' state.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import trio

from p2ptrain.reduce import butterfly
from p2ptrain.ckpt import checkpoint
from p2ptrain.run import election
from p2ptrain.train import progress
from p2ptrain.run import reputation
from p2ptrain.reduce import ring
from p2ptrain.reduce import sparse
from p2ptrain.reduce.sparsecodec import SparseConfig
from p2ptrain.run import manifest as mf
from p2ptrain.reduce.service import AllReduceService, RoundFailed
from p2ptrain.clock import wall_time
from p2ptrain.net.connkinds import kind_counts, parse_counts
from p2ptrain.run.contribution import FrameChecker, Header, sign_header, verify_headers
from p2ptrain.ckpt.download import CheckpointServer, fetch_checkpoint
from p2ptrain.events import EventSink
from p2ptrain.ckpt.fetch import BlobServer, FetchError
from p2ptrain.identity import peer_id_from_str, peer_id_to_str
from p2ptrain.reduce.robust import RobustConfig

log = logging.getLogger("p2ptrain.train.trainer")
MAX_ATTEMPTS = 4
MAX_WAIT_FOR_TRAINERS = 600.0  # a joining peer waits this long for peers that train the step
KEEP_CHECKPOINTS = 3


def run_key(run_id: str, what: str) -> str:
    return f"/p2ptrain/{run_id}/{what}"


@dataclass
class TrainerConfig:
    max_outer_steps: int = 0
    """Leave cleanly after this many committed outer steps (0 = train until interrupted)."""
    threads: int = 1
    """torch threads for inner steps."""
    min_peers: int = 1
    """At the start of a run, wait until this many trainers are ready (so a run that many
    people start together does not begin as one peer alone)."""
    start_timeout: float = 300.0
    """Seconds to wait for min_peers before starting anyway."""
    adversary: str = ""
    """TEST ONLY: misbehave this way (see p2ptrain/bench/adversary.py)."""

    def __post_init__(self) -> None:
        if self.max_outer_steps < 0 or self.threads < 1 or self.min_peers < 1:
            raise ValueError("max_outer_steps must be >= 0, threads >= 1, min_peers >= 1")


@dataclass
class StepStats:
    bytes_sent: int = 0
    bytes_recv: int = 0
    members: list[str] = field(default_factory=list)
    payload_bytes: int | None = None
    """Sparse runs: one contribution's compressed payload (computed), next to the counted bytes."""


class Trainer:
    def __init__(self, node, svc: AllReduceService, blobs: BlobServer, manifest: dict, run_id: str,
                 local, events: EventSink, workdir: Path, config: TrainerConfig) -> None:
        self.node = node
        self.dht = node.dht
        self.svc = svc
        self.manifest = manifest
        self.run_id = run_id
        self.local = local
        self.events = events
        self.workdir = Path(workdir)
        self.config = config
        self.me = node.identity.peer_id_str
        tm = manifest["timeouts"]
        self.window = float(tm["join_window"])
        self.exchange_timeout = float(tm["exchange"])
        self.group_size = int(manifest["train"]["group_size"])
        self.mode = manifest["train"]["allreduce"]
        # robust runs: butterfly + CenteredClip instead of the ring's mean (p2ptrain/reduce/butterfly.py)
        self.robust = RobustConfig() if mf.aggregation(manifest) == "robust" else None
        # sparse runs (issue 18): compressed all-gather instead of the ring; per-peer error feedback
        self.sparse = (sparse.SparseReducer(SparseConfig.from_train(manifest["train"]), local.n_params)
                       if self.mode == "sparse" else None)
        self.flagged: dict[str, int] = {}  # peers the robust rule flagged -> step (our report)
        self.ignored: set[str] = set()
        self.history: dict[str, set[tuple[str, ...]]] = {}
        self.committed = 0
        self.last_roster: set[str] = set()
        self._prev_header: bytes | None = None
        from p2ptrain.bench import adversary

        self.adversary = adversary.make(config.adversary)
        self.ckpt_server = CheckpointServer(blobs, blobs.config.chunk_kib << 10)
        self.writer = checkpoint.AsyncWriter(
            self.workdir / "checkpoints" / run_id[:16], KEEP_CHECKPOINTS,
            on_written=lambda step, sec, path: events.emit("checkpoint_written", step=step, seconds=round(sec, 4)),
            pause_at=checkpoint.pause_from_env(os.environ.get("P2PTRAIN_TEST_CKPT_PAUSE")))
        self.writer.on_pause = lambda step: events.emit("checkpoint_write_paused", step=step)

    # -- service ---------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await self.publish_state()
        self.events.emit("run_joined", run=self.run_id, step=self.local.step, params=self.local.n_params)
        task_status.started()
        if self.local.step == 0 and self.config.min_peers > 1:
            await self.wait_for_peers()
        joining = await self.sync_with_run()
        while not self.config.max_outer_steps or self.committed < self.config.max_outer_steps:
            joining = await self.outer_step(joining)

    async def wait_for_peers(self) -> None:
        with trio.move_on_after(self.config.start_timeout):
            while True:
                best = await latest_state(self.dht, self.run_id)
                if best is not None and best[0] == 0 and len(best[2]) >= self.config.min_peers:
                    return
                if best is not None and best[0] > 0:
                    return  # the run already started without us
                await trio.sleep(0.2)
        log.warning("starting with fewer than %d peers after %.0fs", self.config.min_peers,
                    self.config.start_timeout)

    async def sync_with_run(self) -> bool:
        """Adopt the run's newest state if it is ahead of ours. Returns True when others are
        already training the current step: we then join it at once with a zero
        pseudo-gradient instead of making everyone wait for our inner steps."""
        best = await latest_state(self.dht, self.run_id)
        if best is None:
            return False
        if best[0] > self.local.step:
            await self.catch_up(best[0])
        others = [p for p in best[2] if p != self.node.identity.peer_id]
        return best[0] == self.local.step and bool(others) and self.local.step > 0

    async def outer_step(self, joining: bool) -> bool:
        """One outer step; returns whether the next one starts as a zero-contribution join."""
        t = self.local.step
        self.events.emit("outer_step_started", step=t, joining=joining)
        if joining:
            loss, tokens, sec_inner = float("nan"), 0, 0.0
            delta = np.zeros(self.local.outer.numel, np.float32)
        else:
            loss, tokens, sec_inner = await trio.to_thread.run_sync(self.local.inner, self._progress(t))
            delta = await trio.to_thread.run_sync(self.local.pseudo_gradient)
        t_comm = trio.current_time()
        ready_at = wall_time()
        await self.dht.store(run_key(self.run_id, f"ready/{t}"),
                             msgpack.packb({"ready_at": ready_at, "addrs": self.node.rpc.local_addrs(),
                                            "joining": joining}),
                             ttl=max(60.0, 20 * self.window))
        group = await self.elect(t)
        if not group:
            self.events.emit("outer_step_skipped", step=t, reason="not ready by the deadline")
            await self.catch_up(t + 1)
            return True
        self.events.emit("group_formed", step=t, members=group)
        avg, stats = await self.reduce(t, delta, group, tokens, joining)
        if avg is None:
            self.events.emit("outer_step_skipped", step=t, reason="no round committed")
            await self.catch_up(t + 1)
            return True
        self.last_roster = set(stats.members)
        sha = await trio.to_thread.run_sync(self.local.outer_step, avg)
        val = await trio.to_thread.run_sync(self.local.evaluate)
        self.committed += 1
        seconds_comm = trio.current_time() - t_comm
        await self.publish_state(None if joining else loss, val)
        self.events.emit("outer_step_committed", step=self.local.step,
                         loss=None if joining else round(loss, 5), val_loss=round(val, 5),
                         params_sha256=sha, bytes_sent=stats.bytes_sent, bytes_recv=stats.bytes_recv,
                         seconds_inner=round(sec_inner, 3), seconds_comm=round(seconds_comm, 3), members=stats.members,
                         **({"payload_bytes": stats.payload_bytes} if stats.payload_bytes is not None else {}))
        return False

    def _progress(self, t: int):
        """Inner-step progress: a bar on a terminal, plain log lines otherwise."""
        return progress.make(f"outer step {t}", self.events.json_mode, "inner steps")

    # -- election --------------------------------------------------------------------
    async def read_ready(self, t: int) -> list[election.Ready]:
        out = []
        for rec in (await self.dht.get(run_key(self.run_id, f"ready/{t}"))).values():
            try:
                v = msgpack.unpackb(rec.value, raw=False, max_array_len=16, max_str_len=512)
                r = election.Ready(peer_id_to_str(rec.subkey), float(v["ready_at"]), tuple(v["addrs"][:16]),
                                   bool(v.get("joining", False)))
            except Exception:
                continue
            if math.isfinite(r.ready_at):
                out.append(r)
        return out

    async def elect(self, t: int) -> list[str]:
        """Wait for the step's deadline, or less: the step closes early once every peer whose
        state says it is training step t has posted its ready record (a dead peer therefore
        costs one full window, once)."""
        margin = 0.5  # records stored just before the deadline need a moment to replicate
        give_up = trio.current_time() + MAX_WAIT_FOR_TRAINERS
        if self.robust is not None:
            await self.apply_reputation(t)
        while True:
            recs = [r for r in await self.read_ready(t) if r.peer not in self.ignored]
            d = election.deadline(recs, self.window)
            if d is not None and wall_time() >= d + margin:
                break
            if d is not None:
                # Last step's roster is at step t too even if its state record is not out yet.
                expected = (await peers_at_step(self.dht, self.run_id, t) | self.last_roster) - self.ignored
                if expected and expected <= {r.peer for r in recs}:
                    break
            if d is None and trio.current_time() > give_up:
                return []  # only newcomers showed up: nobody trained this step
            await trio.sleep(0.2 if d is None else max(0.02, min(0.2, d + margin - wall_time())))
        cands = election.candidates(recs, self.window, self.ignored)
        for r in cands:
            self.node.rpc.learn_addrs(peer_id_from_str(r.peer), list(r.addrs))
        return election.my_group(self.run_id, t, [r.peer for r in cands], self.group_size, self.me)

    # -- reduction -------------------------------------------------------------------
    def reject(self, t: int, peer: str, reason: str) -> None:
        if peer == self.me or peer in self.ignored:
            return
        self.ignored.add(peer)
        log.warning("contribution rejected: step=%d peer=%s reason=%s", t, peer, reason)
        self.events.emit("contribution_rejected", step=t, remote=peer, reason=reason)

    async def reduce(self, t: int, delta: np.ndarray, group: list[str], tokens: int, joining: bool = False):
        roster = list(group)
        stats = StepStats()
        # The layout must be the one the service's data plane uses (frame sizes included).
        cfg = ring.RingConfig(self.svc.config.mode, sub_chunk_bytes=self.svc.config.sub_chunk_bytes)
        if self.sparse is not None:
            await trio.to_thread.run_sync(self.sparse.prepare, delta)
        base = await trio.to_thread.run_sync(self.local.outer.params_sha256)  # pre-step params
        unconfirmed = False
        for attempt in range(MAX_ATTEMPTS):
            roster = [p for p in roster if p not in self.ignored]
            stats.members = roster
            if roster == [self.me]:
                # Alone. A newcomer that missed its group's round must not commit alone: its
                # zero step would move its params (momentum) away from the group's. Nor may a
                # member whose group did not confirm it (it saw another group, or another
                # base): the others may be committing this step without it, and its own step
                # would fork it from them for good (its base hash would never match again).
                # Both skip the step and catch up to what the group commits.
                return (None, stats) if joining or unconfirmed else (delta.copy(), stats)
            rid = f"{t}/{attempt}"
            rh = election.roster_hash(self.run_id, t, attempt, roster)
            # Members also confirm they start from the same params: a peer that forked (or
            # caught up to another fork's state) is left out rather than averaged with.
            # The frame size too: members must cut the tensor the same way, and one that
            # does not (another version) is left out instead of failing every round.
            mine = f"{rh}/{base}/{cfg.sub_chunk_bytes}".encode()
            got = await self.svc.exchange(self.run_id, rid + "/roster", roster, mine, self.exchange_timeout)
            agreeing = [p for p in roster if got.get(p) == mine]
            if agreeing != roster:
                unconfirmed = True
                log.info("step %d attempt %d: roster not confirmed by %s", t, attempt,
                         sorted(set(roster) - set(agreeing)))
                roster = agreeing
                continue
            if self.sparse is not None:  # issue 18: the whole attempt is the sparse collective's
                res = await self._sparse_attempt(t, attempt, rh, roster, stats)
                if res is None:
                    continue
                return res, stats
            rank, world = roster.index(self.me), len(roster)
            send = self.adversary.corrupt(delta)
            if self.robust is None:
                own = ring.own_payloads(send, rank, world, cfg)
                digests = tuple(hashlib.sha256(p).hexdigest() for p in own)
            else:  # a copy of every chunk, each signed: every owner checks what it receives
                own = butterfly.own_payloads(send, world, cfg)
                digests = butterfly.chunk_digests(own)
            lay = ring.layout(delta.size, world, cfg)
            norms = tuple(float(np.linalg.norm(delta[subs[0][0]:subs[-1][1]])) for subs in lay)
            header = Header(self.run_id, t, attempt, rh, self.me, norms, digests,
                            float(np.linalg.norm(delta)), self.local.H, tokens)
            signed = self.adversary.header(header, self.node.identity, sign_header)
            raw = await self.svc.exchange(self.run_id, rid + "/hdr", roster, signed, self.exchange_timeout)
            # Robust runs bound every member's influence whatever its norm: no norm filter.
            ok, bad = verify_headers(raw, self.run_id, t, attempt, rh, roster, self.history,
                                     norm_factor=10.0 if self.robust is None else math.inf)
            if bad:
                for peer, reason in bad.items():
                    self.reject(t, peer, reason)
                roster = [p for p in roster if p not in bad]
                continue
            checker = (FrameChecker(roster, ok, rank, [len(s) for s in lay]) if self.robust is None
                       else butterfly.Checker(roster, ok, [len(s) for s in lay]))
            try:
                res = await self.svc.allreduce(send, self.run_id, rid, roster, own=own, check=checker.check,
                                               robust=self.robust)
            except RoundFailed as exc:
                log.info("step %d attempt %d failed: %s", t, attempt, exc)
                for peer, reason in exc.blamed.items():
                    self.reject(t, peer, reason)
                continue
            stats.bytes_sent += res.sent_bytes
            # What the ring schedule delivered to us (the ring counts only what it sends).
            stats.bytes_recv += sum(ring.wire_bytes(lay[c][j][1] - lay[c][j][0], cfg)
                                    for _, c, j in ring.schedule(rank, world, lay)[1])
            for peer, h in ok.items():
                self.history.setdefault(peer, set()).add(h.own_digests)
            if res.scores is not None:
                await self.note_outliers(t, roster, ok, res.scores)
            return res.result, stats
        return None, stats

    async def _sparse_attempt(self, t: int, attempt: int, rh: str, roster: list[str], stats: StepStats):
        """One attempt of a sparse run (p2ptrain/reduce/sparse.py): the mean, or None to retry."""
        try:
            res = await self.sparse.attempt(self.svc, self.node.identity, self.run_id, t, attempt, rh, roster,
                                            self.exchange_timeout, robust=self.robust is not None)
        except RoundFailed as exc:
            log.info("step %d attempt %d failed: %s", t, attempt, exc)
            for peer, reason in exc.blamed.items():
                self.reject(t, peer, reason)
            return None
        for peer, reason in res.excluded.items():
            self.reject(t, peer, reason)
        stats.bytes_sent += res.bytes_sent
        stats.bytes_recv += res.bytes_recv
        stats.members = res.members
        stats.payload_bytes = res.payload_bytes
        self.sparse.commit()
        return res.result

    async def note_outliers(self, t: int, roster: list[str], headers: dict, scores: list) -> None:
        """Members the robust rule threw away far more than the others, by the committed scores
        (the same on every member): ignored from now on and reported in our DHT record."""
        out = [p for p in reputation.outliers(roster, headers, scores) if p != self.me]
        for peer in out:
            self.reject(t, peer, "robust-outlier")
            self.flagged[peer] = t
        if out:
            acked = await reputation.publish(self.dht, self.run_id, self.flagged)
            self.events.emit("reputation_published", step=t, flagged=sorted(self.flagged), replicas=acked)

    async def apply_reputation(self, t: int) -> None:
        """Leave out of our groups the peers that enough others reported (p2ptrain/run/reputation.py)."""
        for peer, reporters in reputation.excluded(await reputation.read(self.dht, self.run_id)).items():
            if peer != self.me and peer not in self.ignored:
                self.ignored.add(peer)
                self.events.emit("peer_excluded", step=t, remote=peer, reason="reputation", reporters=reporters)

    # -- state -----------------------------------------------------------------------
    async def publish_state(self, loss: float | None = None, val_loss: float | None = None) -> None:
        # Training blocks only for the in-memory snapshot; the disk write runs in the
        # writer's thread (p2ptrain.ckpt.checkpoint.AsyncWriter).
        t0 = time.perf_counter()
        data = await trio.to_thread.run_sync(self.local.state_bytes)
        snapshot = time.perf_counter() - t0
        self.writer.submit(self.local.step, data)
        params = self.local.outer.params_sha256()
        # Served as verified chunks only (p2ptrain.ckpt.download); the chunking hashes the whole
        # state once, and that hash names it in the state record too.
        served = await self.ckpt_server.publish(self.dht, self.run_id, data, self.local.step, params,
                                                sorted(self.last_roster) if self.local.step else [],
                                                self.node.rpc.local_addrs())
        value = msgpack.packb({"step": self.local.step, "params": params,
                               "ckpt": served.sha256, "addrs": self.node.rpc.local_addrs(),
                               "loss": _finite_or_none(loss), "val_loss": _finite_or_none(val_loss),
                               "conns": kind_counts(self.node.host)})
        await self.dht.store(run_key(self.run_id, "state"), value, ttl=600)
        self.events.emit("checkpoint_snapshot", step=self.local.step, seconds=round(snapshot, 4), bytes=len(data))

    async def catch_up(self, at_least: int, timeout: float = 120.0) -> None:
        """Adopt the newest state a quorum of its group attests, once it reaches `at_least`
        (chunks from every provider at once: p2ptrain.ckpt.download)."""
        with trio.move_on_after(timeout):
            while True:
                try:
                    got = await fetch_checkpoint(self.node, self.run_id, self.manifest, self.events,
                                                 at_least, self.local.step)
                except FetchError as exc:
                    log.warning("catch-up fetch failed: %s", exc)
                    got = None
                if got is not None:
                    step, data = got
                    if data is None:
                        return
                    await trio.to_thread.run_sync(self.local.load_state_at, data)
                    sha = await trio.to_thread.run_sync(self.local.outer.params_sha256)
                    self.events.emit("caught_up", step=self.local.step, params_sha256=sha)
                    return
                await trio.sleep(0.5)


def _finite_or_none(x: float | None) -> float | None:
    return round(float(x), 5) if x is not None and math.isfinite(x) else None


async def _state_records(dht, run_id: str) -> list[tuple[bytes, dict]]:
    """Every peer's published state record, decoded once: (peer id bytes, fields).

    Providers' addresses go to the address book, so their checkpoints can be fetched."""
    out = []
    for sub, rec in (await dht.get(run_key(run_id, "state"))).items():
        try:
            v = msgpack.unpackb(rec.value, raw=False, max_array_len=16, max_str_len=512)
            addrs = [a for a in v.get("addrs", [])[:16] if isinstance(a, str)]
            out.append((sub, {"step": int(v["step"]), "params": str(v["params"])[:64], "ckpt": str(v["ckpt"]),
                              "loss": v.get("loss"), "val_loss": v.get("val_loss"), "addrs": addrs,
                              "conns": parse_counts(v.get("conns"))}))
        except Exception:
            continue
        dht.transport.learn_addrs(sub, addrs)
    return out


async def run_states(dht, run_id: str) -> dict[str, dict]:
    """peer id -> its published state (step, params hash, checkpoint hash, losses, addrs)."""
    return {peer_id_to_str(sub): v for sub, v in await _state_records(dht, run_id)}


async def peers_at_step(dht, run_id: str, step: int) -> set[str]:
    """Peers whose published state is at outer step `step` (they are training it now)."""
    return {peer_id_to_str(sub) for sub, v in await _state_records(dht, run_id) if v["step"] == step}


async def latest_state(dht, run_id: str) -> tuple[int, str, list[bytes]] | None:
    """(step, checkpoint hash, providers) of the newest state published by the most peers."""
    votes: dict[tuple[int, str], list[bytes]] = {}
    for sub, v in await _state_records(dht, run_id):
        votes.setdefault((v["step"], v["ckpt"]), []).append(sub)
    if not votes:
        return None
    (step, digest), providers = max(votes.items(), key=lambda kv: (kv[0][0], len(kv[1])))
    return step, digest, providers
