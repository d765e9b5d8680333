"""The I/O of the record-level adversaries (`PeerPlan.attack`), and what the world measures of
them. Their rules are `p2ptrain.sim.attacks`; the round-level ones (selective, withhold,
inflate, trickle) live in the simulated service's policy (`sim.net.Policy`).

  grind  Sybils post their ready record for step t only if the subset chosen for t does
         (`attacks.grind`): the largest subset of them that puts the victim (the world's
         first honest peer) in a group with Sybils only. They learn who trains t as the
         election does, from the state records (`run.states.peers_at_step`) and the ready
         records out, waiting up to 0.4 join windows for every such peer to post (a late
         record still makes the deadline: the window is for that), and share one choice per
         step (they collude off the network).
         Otherwise they are honest peers: the victim's group commits, with Sybils only.
  flood  Each Sybil stores, from as many fresh identities as one sender may store for
         (`dht` budget: 16 with its own), a ready record as big as the key's class allows
         (20 KiB) and one over it (refused everywhere), under ready/<t..t+3> before honest
         peers publish there; with `Scenario.flood_senders`, as many extra client connections (no replica,
         an identity each) each store a small record too. A reader that is no replica (a
         client node, `probe`) reads the current step's key every 2 s: every honest ready
         record some honest replica holds that it did not get is counted as hidden.
"""

from __future__ import annotations

import random

import trio

from p2ptrain import clock
from p2ptrain.dht.node import DHTNode
from p2ptrain.dht.record import make_record
from p2ptrain.identity import Identity, peer_id_to_str
from p2ptrain.records import keys
from p2ptrain.sim import attacks

FAKES = 15
"""Fresh identities a flooding Sybil stores for: its sender budget is 16 writers, itself included."""
BIG = 20 * 1024 - 700
"""Value bytes of a record just within a ready record's class cap (20 KiB with key and signature)."""


class Arms:
    """A world's record-level adversaries: started per incarnation (`arm`), measured at the end."""

    def __init__(self, world) -> None:
        self.w = world
        sc = world.sc
        self.senders = sc.flood_senders
        self.grinders = [world.names[i] for i, p in enumerate(sc.peers) if p.attack == "grind"]
        self.flooders = [i for i, p in enumerate(sc.peers) if p.attack == "flood"]
        honest = [n for n, p in zip(world.names, sc.peers) if p.honest]
        self.victim = honest[0] if honest else None
        self.choice: dict[int, tuple[str, ...] | trio.Event] = {}
        self.chance: dict[int, bool] = {}  # step -> would the victim be isolated had every Sybil posted
        self.dhts: dict[str, DHTNode] = {}
        self.out: dict[str, int] = {}

    def arm(self, i: int, dht: DHTNode, nursery: trio.Nursery, local) -> None:
        name = self.w.names[i]
        self.dhts[name] = dht
        attack = self.w.sc.peers[i].attack
        if attack == "grind" and self.victim is not None:
            self._gate(name, dht)
        elif attack == "flood":
            rng = random.Random(self.w.seed * 104729 + i)
            fakes = [Identity.from_seed(rng.randbytes(32)) for _ in range(FAKES)]
            nursery.start_soon(self._flood, dht, local, fakes, rng)

    def start(self, nursery: trio.Nursery) -> None:
        if self.flooders:
            nursery.start_soon(self._probe)

    # -- grind -------------------------------------------------------------------------------
    def _gate(self, me: str, dht: DHTNode) -> None:
        real = dht.store
        prefix = keys.ready(self.w.run_id, 0)[:-1]

        async def store(key: str, value: bytes, ttl: float) -> int:
            if key.startswith(prefix) and key[len(prefix):].isdigit():
                if me not in await self._chosen(dht, int(key[len(prefix):])):
                    return 1  # sits this step out (and says it stored: nobody can tell)
            return await real(key, value, ttl)

        dht.store = store

    async def _chosen(self, dht: DHTNode, t: int) -> tuple[str, ...]:
        got = self.choice.get(t)
        if isinstance(got, trio.Event):
            await got.wait()
            return self.choice[t]
        if got is not None:
            return got
        self.choice[t] = done = trio.Event()
        try:
            self.choice[t] = await self._search(dht, t)
        finally:
            if isinstance(self.choice[t], trio.Event):  # our search was cancelled: post as anyone would
                self.choice[t] = tuple(sorted(self.grinders))
            done.set()
        return self.choice[t]

    async def _search(self, dht: DHTNode, t: int) -> tuple[str, ...]:
        from p2ptrain.run import states

        sybils = set(self.grinders)
        # Wait (a fraction of the join window: our records still make the deadline) until
        # every peer whose state says it trains t has posted, so the deal we search is the one
        # the election will see.
        until = trio.current_time() + 0.4 * self.w.sc.join_window
        while True:
            expected = await states.peers_at_step(dht, self.w.run_id, t) - sybils
            posted = {peer_id_to_str(s) for s in await dht.get(keys.ready(self.w.run_id, t))} - sybils
            if (expected and expected <= posted) or trio.current_time() >= until:
                break
            await trio.sleep(1.0)
        honest = posted | expected | {self.victim}
        G = self.w.sc.group_size
        self.chance[t] = attacks.isolated(self.w.run_id, t, sorted(honest | sybils), honest, self.victim, G)
        return attacks.grind(self.w.run_id, t, honest, self.grinders, self.victim, G)

    # -- flood -------------------------------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        self.out[what] = self.out.get(what, 0) + n

    async def _store(self, dht: DHTNode, rec) -> None:
        try:
            acked = await dht.store_record(rec)
        except Exception:  # our own node refuses it before sending (oversize): counted
            acked = 0
        self._count("flood_stored" if acked else "flood_refused")

    async def _flood(self, dht: DHTNode, local, fakes: list[Identity], rng: random.Random) -> None:
        run_id = self.w.run_id
        extra = []
        for _ in range(self.senders):  # client connections of their own: no replica, one identity each
            ident = Identity.from_seed(rng.randbytes(32))
            extra.append(self.w.dhtnet.node(ident, server=False))
        async with trio.open_nursery() as nursery:
            for node in extra:
                nursery.start_soon(node.bootstrap, [(self.w.boot.peer_id, [])])
        done: set[int] = set()
        while True:
            t = local.step
            for s in range(t, t + 4):
                if s in done:
                    continue
                done.add(s)
                key, exp = keys.ready(run_id, s), clock.wall_time() + 600.0
                body = s.to_bytes(8, "big")
                for ident in fakes:
                    await self._store(dht, make_record(ident, key, body + b"\xee" * BIG, exp))
                    try:
                        rec = make_record(ident, key, body + b"\xee" * (60 * 1024 - 8), exp)
                    except Exception:
                        self._count("flood_refused")
                        continue
                    await self._store(dht, rec)
                async with trio.open_nursery() as nursery:
                    for node in extra:
                        nursery.start_soon(self._store, node, make_record(node.identity, key, body, exp))
            await trio.sleep(5.0)

    async def _probe(self) -> None:
        """A reader that is no replica: how many honest ready records it misses."""
        w = self.w
        ident = Identity.from_seed(random.Random(w.seed * 7919 - 2).randbytes(32))
        probe = w.dhtnet.node(ident, server=False)
        await probe.bootstrap([(w.boot.peer_id, [])])
        honest = w.monitor.world.honest
        while True:
            await trio.sleep(2.0)
            live = [p for p in honest if p in w.monitor.latest and w._alive(p)]
            if not live:
                continue
            t = max(w.monitor.latest[p] for p in live)
            key = keys.ready(w.run_id, t)
            now = clock.wall_time()
            held = {peer_id_to_str(r.subkey) for n, d in self.dhts.items() if n in honest and w._alive(n)
                    for r in d.store_.get(key, now)} & honest
            if not held:
                continue
            seen = {peer_id_to_str(s) for s in await probe.get(key)}
            self._count("flood_reads")
            self._count("flood_honest_records", len(held))
            self._count("flood_hidden", len(held - seen))
            self._count("flood_reads_missing_one", bool(held - seen))

    # -- figures -----------------------------------------------------------------------------
    def figures(self) -> dict:
        out = dict(self.out)
        if self.grinders and self.victim is not None:
            honest = self.w.monitor.world.honest
            elected, alone = attacks.isolation(self.w.monitor.groups, self.victim, honest)
            out.update(grind_victim_elected=elected, grind_victim_isolated=alone,
                       grind_isolated_fraction=round(alone / elected, 4) if elected else None,
                       grind_isolated_by_chance=round(sum(self.chance.values()) / len(self.chance), 4)
                       if self.chance else None)
            # the rule's own exposure, every peer posting as told: 100 steps of this run's deal
            can, chance = attacks.grind_power(self.w.run_id, len(honest), len(self.grinders), self.w.sc.group_size,
                                              range(100 if len(self.grinders) <= 8 else 20))
            out.update(grind_rule_isolable=round(can, 4), grind_rule_by_chance=round(chance, 4))
        hub = self.w.hub
        slowed = getattr(hub, "trickled", None)
        if slowed:
            ok = [s for s, failed in slowed if not failed]
            out.update(trickle_rounds=len(slowed), trickle_rounds_failed=len(slowed) - len(ok),
                       trickle_seconds_added_mean=round(sum(ok) / len(ok), 3) if ok else None)
        return out
