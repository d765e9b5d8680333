"""A simulated world: N real peers in one process, on trio's autojump clock, from one seed.

Each peer is built by the composition root (`p2ptrain.peer.run_peer`) exactly as `p2ptrain join`
builds one, with the simulator's I/O passed in: a real `DHTNode` on `SimDHTNetwork`, `SimHost`
streams for blobs (the real `BlobServer` and chunk download), `SimReduceService` for rounds,
`VectorModel` for training, and an in-memory "disk" for checkpoints that survives the peer's
restarts. Election, roster, contribution headers and their checks, commit-or-abort
bookkeeping, catch-up, state and provider choice, the ledger and the DHT are the product's.

Determinism: trio's scheduler is seeded, every blocking call (`trio.to_thread.run_sync`) runs
inline in the trio thread (charged the simulated seconds the model says it takes), the wall
clock is pinned to a fixed epoch, and every random draw comes from the seed. Replaying a seed
under the same PYTHONHASHSEED (`bench sim` pins it) gives the same trace, event for event.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio.testing

from p2ptrain import clock, entropy, peer
from p2ptrain.dht.node import DHTNode
from p2ptrain.identity import Identity
from p2ptrain.run import manifest as mf
from p2ptrain.run.spec import USER, DataSpec, GenesisSpec, ModelSpec, RunSpec, TimeoutsSpec, TrainSpec
from p2ptrain.sim import model as vmodel
from p2ptrain.sim import sybil
from p2ptrain.sim.host import SimHost
from p2ptrain.sim.invariants import Monitor, WorldView
from p2ptrain.sim.net import LinkConfig, Policy, SimDHTNetwork, SimNet
from p2ptrain.sim.runtime import SimEvents, SimNode, SimWriter, deterministic_deadlines, inline_to_thread
from p2ptrain.sim.service import Hub, SimReduceService
from p2ptrain.train.trainer import TrainerConfig

log = logging.getLogger("p2ptrain.sim")
EPOCH = 1_700_000_000.0


@dataclass(frozen=True)
class PeerPlan:
    join_at: float = 0.0
    initiator: bool = False
    """Holds the genesis state (the peer that ran `init`); others fetch the state from peers."""
    slow: float = 1.0
    """Inner steps take this many times the run's step time."""
    skew: float = 0.0
    """Seconds this peer's clock is off."""
    min_peers: int = 1
    outages: tuple[tuple[float, float], ...] = ()
    """(down at, up again at) simulated seconds: a crash (or Ctrl-C) and a restart with the
    same workdir; up at inf: gone for good."""
    hot: tuple[int, float] = (-1, 1.0)
    """(phase, factor): this peer's pseudo-gradient of its phase-th phase (0: its first) is
    `factor` times what it trained, an honest norm another member's bound may refuse (a fresh
    optimizer's first phase, a shard with outsized gradients)."""
    honest: bool = True
    answers: tuple[int, ...] | None = None
    """An adversary that talks only to these peers (indices): selective answering."""
    attack: str = ""
    """An adversary's other scripted behaviour: "withhold" (joins rounds, sends no data or
    vote), "inflate" (names every other adversary in its roster views), "expiry" (re-stores
    its ready record every 5 s with an 8 s expiry and a ready time 10 minutes early),
    "trickle" (sends its frames as slowly as the per-frame rules allow), "grind" (posts its
    ready record only in the steps where that isolates the first honest peer), "flood"
    (stores big records from fresh identities under the next ready keys): `sim.sybil`."""


@dataclass(frozen=True)
class Partition:
    start: float
    end: float
    sides: tuple[tuple[int, ...], ...]
    one_way: bool = False


@dataclass(frozen=True)
class Scenario:
    name: str
    peers: tuple[PeerPlan, ...]
    group_size: int = 4
    inner_steps: int = 20
    step_seconds: float = 0.5
    join_window: float = 30.0
    exchange: float = 5.0
    duration: float = 600.0
    links: LinkConfig = LinkConfig()
    partitions: tuple[Partition, ...] = ()
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    eval_batches: int = 8
    flood_senders: int = 0
    """Extra client connections each "flood" adversary stores from (`sim.sybil`)."""

    @property
    def dim(self) -> int:
        return max(1024, 256 * self.group_size)  # every ring chunk non-empty (4 KiB frames)

    @property
    def faults_end(self) -> float:
        ends = [p.end for p in self.partitions]
        ends += [up for pl in self.peers for _, up in pl.outages if math.isfinite(up)]
        ends += [down for pl in self.peers for down, up in pl.outages if not math.isfinite(up)]
        ends += [pl.join_at for pl in self.peers if pl.join_at > 0]
        return max(ends, default=0.0)

    @property
    def has_faults(self) -> bool:
        """Network faults: partitions, crashes, slow peers, skew, late joiners, loss. Adversaries
        are not faults: honest peers must stay live beside them (liveness is checked)."""
        return bool(self.partitions or any(p.outages or p.slow != 1.0 or p.skew for p in self.peers)
                    or any(p.join_at > 0 for p in self.peers) or self.links.loss > 0)


@dataclass
class Report:
    scenario: str
    seed: int
    peers: int
    violations: list
    counts: dict[str, int]
    commit_fraction: float
    steps_to_converge: int | None
    """Outer steps after the last fault until every live honest peer held one state (None: never)."""
    events: int
    sim_seconds: float
    wall_seconds: float
    final_steps: dict[str, int] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)
    attack_figures: dict = field(default_factory=dict)
    """What the scripted adversaries achieved (`sim.sybil.Arms.figures`)."""
    settled: bool = True
    """K steps' worth of time passed after the last fault (convergence was checked)."""
    after_faults: tuple[int, int] | None = None
    """(committed, started) honest steps started once the live honest peers held one state
    again after the last fault, in a world with faults but no adversaries or slow peers
    (those never end; the +-2 s clock skew is kept): liveness with no fault active, which
    the monitor judges only in fault-free worlds; None otherwise."""
    honest_verdicts: dict = field(default_factory=dict)  # honest peers' against honest ones: Monitor.verdicts

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["violations"] = [dataclasses.asdict(v) for v in self.violations]
        d.pop("trace")
        return d


class World:
    def __init__(self, scenario: Scenario, seed: int, trace: bool = False) -> None:
        self.sc, self.seed, self.tracing = scenario, seed, trace
        self.net = SimNet(seed, scenario.links)
        self.dhtnet = SimDHTNetwork(self.net)
        self.hosts: dict[bytes, SimHost] = {}
        self.disk: dict[bytes, bytes] = {}
        self.ids = [Identity.from_seed(random.Random(seed * 7919 + i).randbytes(32)) for i in range(len(scenario.peers))]
        self.names = [i.peer_id_str for i in self.ids]
        self.index = {n: i for i, n in enumerate(self.names)}
        pool = tuple(self.names[i] for i, p in enumerate(scenario.peers) if not p.honest)
        for i, plan in enumerate(scenario.peers):
            if plan.answers is not None or plan.attack in ("withhold", "inflate", "trickle"):
                self.net.policy[self.ids[i].peer_id] = Policy(
                    None if plan.answers is None else {self.ids[j].peer_id for j in plan.answers},
                    withhold=plan.attack == "withhold", inflate=pool if plan.attack == "inflate" else (),
                    trickle=plan.attack == "trickle")
        self.boot = Identity.from_seed(random.Random(seed * 7919 - 1).randbytes(32))
        for pol in self.net.policy.values():
            if pol.answers is not None:
                pol.answers.add(self.boot.peer_id)  # everyone reaches the entry point (it is not the target)
        genesis = vmodel.genesis(scenario.dim, seed)
        self.genesis = genesis
        self.spec = RunSpec(
            name=f"sim-{scenario.name}", created=0, model=ModelSpec({"source": USER, "n_params": scenario.dim}),
            data=DataSpec(USER, ""),
            train=TrainSpec(inner_steps=scenario.inner_steps, group_size=scenario.group_size,
                            outer_lr=scenario.outer_lr, outer_momentum=scenario.outer_momentum, allreduce="fp32",
                            aggregation="mean"),
            timeouts=TimeoutsSpec(join_window=scenario.join_window, exchange=scenario.exchange),
            genesis=GenesisSpec(__import__("hashlib").sha256(genesis).hexdigest(), len(genesis)))
        self.run_id = mf.run_id(self.spec.to_dict())
        self.hub = Hub(self.net, on_round=self._on_round)
        honest = {n for n, p in zip(self.names, scenario.peers) if p.honest}
        self.monitor = Monitor(WorldView(honest, self._alive, self._reachable), group_size=scenario.group_size)
        self.events = 0
        self.models: dict[int, vmodel.VectorModel] = {}
        self.trace: list[str] = []
        self.converged_at: int | None = None
        self._converged_time: float | None = None
        self._steps_at_faults_end: int | None = None
        self.arms = sybil.Arms(self)

    # -- the world view the invariants read ------------------------------------------------
    def _alive(self, name: str) -> bool:
        return self.net.alive(self.ids[self.index[name]].peer_id)

    def _reachable(self, a: str, b: str) -> bool:
        x, y = self.ids[self.index[a]].peer_id, self.ids[self.index[b]].peer_id
        return self.net.reachable(x, y) and self.net.reachable(y, x)

    def on_event(self, peer_name: str, event: str, fields: dict) -> None:
        now = trio.current_time()
        self.events += 1
        if self.tracing:
            # these events time real CPU work (perf_counter): not part of a replay
            wall = {"seconds"} if event in ("checkpoint_snapshot", "checkpoint_fetched") else set()
            short = {k: (v[:12] if isinstance(v, str) and len(v) > 16 else
                         [m[-6:] for m in v] if k == "members" else v) for k, v in fields.items() if k not in wall}
            self.trace.append(f"{now:10.3f} p{self.index[peer_name]:<3} {event} {short}")
        before = len(self.monitor.violations)
        self.monitor.on_event(now, peer_name, event, fields)
        if self.tracing:
            for v in self.monitor.violations[before:]:
                self.trace.append(f"{now:10.3f} VIOLATION {v.invariant}: {v.detail}")
        if event in ("outer_step_committed", "caught_up") and now >= self.sc.faults_end:
            self._check_converged()

    def _check_converged(self) -> None:
        m = self.monitor
        live = self._live()
        top = max((m.latest[p] for p in live), default=0)
        if self._steps_at_faults_end is None:
            self._steps_at_faults_end = top
        if self.converged_at is None and len(live) >= 2 and m.converged(live):
            self.converged_at, self._converged_time = top, trio.current_time()

    def _live(self) -> list[str]:
        """The live honest peers that joined and hold a state."""
        m = self.monitor
        return [p for p in m.joined if p in m.world.honest and self._alive(p) and p in m.latest]

    def _on_round(self, run, rid, members, vecs, committed) -> None:
        self.monitor.on_round(trio.current_time(), members, vecs, committed)

    # -- peers -----------------------------------------------------------------------------
    async def main(self) -> None:
        clock.pin_epoch(EPOCH)
        async with trio.open_nursery() as nursery:
            self.boot_dht = self.dhtnet.node(self.boot)
            await nursery.start(self.boot_dht.run)
            for i in range(len(self.sc.peers)):
                nursery.start_soon(self._life, i)
            for p in self.sc.partitions:
                nursery.start_soon(self._partition, p)
            self.arms.start(nursery)
            await trio.sleep(self.sc.duration)
            nursery.cancel_scope.cancel()
        sc = self.sc
        horizon = sc.inner_steps * sc.step_seconds * max(p.slow for p in sc.peers) + sc.join_window + 6 * sc.exchange
        # Convergence is promised K steps after the faults end: judged once the run advanced K
        # steps since, or had time for K of its slowest steps (a run that stalls is judged too)
        m, K = self.monitor, self.monitor.converge_within
        live = self._live()
        advanced = max((m.latest[p] for p in live), default=0) - (self._steps_at_faults_end or 0)
        step = sc.inner_steps * sc.step_seconds * max(p.slow for p in sc.peers) + sc.join_window + sc.exchange
        settled = (self._steps_at_faults_end is not None and advanced >= K) or \
            trio.current_time() >= sc.faults_end + K * step
        # forks committed before the faults ended are judged by how soon they healed (K steps)
        healed = self.converged_at if sc.has_faults and self.converged_at is not None else 0
        late = self.converged_at - (self._steps_at_faults_end or 0) if healed else 0
        self.monitor.finish(trio.current_time(), sc.has_faults, horizon, settled, healed, late)

    async def _partition(self, p: Partition) -> None:
        await trio.sleep_until(p.start)
        self.net.partition([{self.ids[i].peer_id for i in side} for side in p.sides], p.one_way)
        await trio.sleep_until(p.end)
        self.net.heal()

    async def _life(self, i: int) -> None:
        plan = self.sc.peers[i]
        pid = self.ids[i].peer_id
        await trio.sleep_until(plan.join_at)
        windows = [*plan.outages, (math.inf, math.inf)]
        for down, up in windows:
            with trio.move_on_at(down):
                try:
                    await self._incarnation(i)
                except Exception as exc:  # a peer that fails to start (no state yet, ...) stays down
                    self.on_event(self.names[i], "peer_failed", {"reason": f"{type(exc).__name__}: {exc}"[:200]})
                    await trio.sleep_until(down)
            if not math.isfinite(down):
                return
            self.net.down.add(pid)
            host = self.hosts.get(pid)
            if host is not None:
                host.crash()
            self.hub.forget(self.names[i])
            self.on_event(self.names[i], "peer_down", {})
            if not math.isfinite(up):
                return
            await trio.sleep_until(up)
            self.net.down.discard(pid)

    async def _incarnation(self, i: int) -> None:
        plan, ident = self.sc.peers[i], self.ids[i]
        with clock.skewed(plan.skew):
            async with trio.open_nursery() as nursery:
                dht = self.dhtnet.node(ident)
                await nursery.start(dht.run)
                await dht.bootstrap([(self.boot.peer_id, [])])
                node = SimNode(ident, dht, SimHost(self.net, self.hosts, ident.peer_id, nursery), self.net)
                events = SimEvents(self, self.names[i])
                state = self.disk.get(ident.peer_id)
                if state is None:
                    if plan.initiator:
                        state = self.genesis
                    else:
                        from p2ptrain.run.runner import fetch_state

                        state = await fetch_state(node, self.run_id, self.spec, events)
                sc = self.sc
                local = vmodel.VectorModel(state, dim=sc.dim, H=sc.inner_steps, seed=self.seed, peer=i,
                                           target_seed=self.seed, outer_lr=sc.outer_lr,
                                           outer_momentum=sc.outer_momentum, step_seconds=sc.step_seconds,
                                           slow=plan.slow, hot=plan.hot)
                parts = peer.Parts(service=functools.partial(self._service, self.names[i]),
                                   writer=lambda workdir, run_id, ev, key=ident.peer_id: SimWriter(self.disk, key),
                                   state_scorer=vmodel.StateScorer)
                self.models[i] = local
                if plan.attack == "expiry":
                    nursery.start_soon(self._early_ready, dht, local)
                self.arms.arm(i, dht, nursery, local)
                cfg = TrainerConfig(min_peers=plan.min_peers, eval_batches=sc.eval_batches)
                await peer.run_peer(node, self.spec, self.run_id, local, events, cfg, workdir=Path("."), parts=parts)
                nursery.cancel_scope.cancel()

    async def _early_ready(self, dht: DHTNode, local) -> None:
        """The writer-chosen-expiry attack (issue 31, item 5): a ready record for the step it
        is at, claiming to be 10 minutes early, re-stored every 5 s with an 8 s expiry."""
        from p2ptrain.records import codecs, keys

        while True:
            await dht.store(keys.ready(self.run_id, local.step),
                            codecs.encode_ready(clock.wall_time() - 600.0, dht.transport.local_addrs(), False), ttl=8.0)
            await trio.sleep(5.0)

    def _service(self, name: str, host, identity, config, listen_ip: str = "") -> SimReduceService:
        return SimReduceService(self.hub, name, dataclasses.replace(config, sub_chunk_bytes=4096))

    def report(self, wall: float) -> Report:
        m = self.monitor
        steps = None
        if self.converged_at is not None and self._steps_at_faults_end is not None:
            steps = max(0, self.converged_at - self._steps_at_faults_end)
        return Report(self.sc.name, self.seed, len(self.sc.peers), list(m.violations), m.counts(),
                      round(m.commit_fraction(), 4), steps, self.events, self.sc.duration, round(wall, 3),
                      {f"p{self.index[p]}": s for p, s in sorted(m.latest.items(), key=lambda kv: self.index[kv[0]])},
                      self.trace, self.arms.figures(), not getattr(m, "unsettled", False), self._after_faults(),
                      m.verdicts(lambda p: f"p{self.index[p]}"))

    def _after_faults(self) -> tuple[int, int] | None:
        m, since = self.monitor, self._converged_time
        if since is None and self._steps_at_faults_end is None:
            # nothing committed or caught up after the faults ended: the states at the end are
            # those at the faults' end (a run that stalled then: simulator seed 90178)
            live = self._live()
            since = self.sc.faults_end if len(live) >= 2 and m.converged(live) else None
        if not self.sc.has_faults or since is None or not all(p.honest and p.slow == 1 for p in self.sc.peers):
            return None
        started = m.started(since, last=True)  # a step retried after that counts: it is still owed
        return sum(k in m.committed for k in started), len(started)


def run(scenario: Scenario, seed: int, trace: bool = False) -> Report:
    """Run `scenario` from `seed` to its end; the invariants' verdict and, with `trace`, every event."""
    return simulate(World(scenario, seed, trace))


def simulate(world: World) -> Report:
    """Run a world built by the caller (tests read its peers' models afterwards)."""
    seed = world.seed
    random.seed(seed)
    # the scheduler's tie-breaking, so a seed replays exactly: runnable tasks in spawn order,
    # then shuffled from the seed (what pytest-trio does under Hypothesis)
    det = trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING
    trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING = True
    trio._core._run._r.seed(seed)
    real = trio.to_thread.run_sync
    trio.to_thread.run_sync = inline_to_thread
    real_source, entropy.source = entropy.source, random.Random(seed ^ 0xE7)
    real_add = deterministic_deadlines()
    quiet = logging.getLogger("p2ptrain")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    t0 = time.perf_counter()
    try:
        trio.run(world.main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        trio.to_thread.run_sync = real
        entropy.source = real_source
        trio._core._run.Deadlines.add = real_add
        trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING = det
        quiet.setLevel(level)
    return world.report(time.perf_counter() - t0)
