"""Named scenarios (the bugs seen by users and CI, kept as regression tests) and the random
worlds `p2ptrain bench sim` sweeps. A scenario is data (`world.Scenario`); how to write one
is in docs/DESIGN.md, "Simulator"."""

from __future__ import annotations

import math
import random

from p2ptrain.sim.net import LinkConfig
from p2ptrain.sim.world import Partition, PeerPlan, Scenario


def lone_start() -> Scenario:
    """(a) One peer starts a run alone and trains; three join later by run id over a minute,
    without --min-peers (the README's flow). Seen: the first peer committed 116 steps alone
    while the joiners retried steps 0-1 every 120 s."""
    peers = (PeerPlan(initiator=True), PeerPlan(join_at=30.0), PeerPlan(join_at=50.0), PeerPlan(join_at=70.0))
    # short steps, as in the demo's run where it was seen (116 steps in 8 minutes)
    return Scenario("lone_start", peers, group_size=4, inner_steps=10, step_seconds=0.2, duration=480.0)


def six_in_threes() -> Scenario:
    """(b) 6 peers, group size 3, all starting together. Seen: two bases after step 1,
    same-base pairs at step 2, everyone skipping step 3."""
    return Scenario("six_in_threes", tuple(PeerPlan(initiator=True) for _ in range(6)), group_size=3,
                    duration=240.0)


def restart_pair() -> Scenario:
    """(c) Two peers with --min-peers 2; one is stopped (Ctrl-C) and started again with the
    same workdir. Seen: it resumed its own checkpoint and trained alone for good."""
    peers = (PeerPlan(initiator=True, min_peers=2), PeerPlan(initiator=True, min_peers=2, outages=((100.0, 130.0),)))
    return Scenario("restart_pair", peers, group_size=4, duration=600.0)


def lone_restart() -> Scenario:
    """A pair commits step 5; one is stopped right after and its partner leaves for good
    before it is started again. It restarts from a checkpoint its pair committed, alone."""
    peers = (PeerPlan(initiator=True, min_peers=2, outages=((59.5, 70.0),)),
             PeerPlan(initiator=True, min_peers=2, outages=((61.0, 1e9),)))
    return Scenario("lone_restart", peers, group_size=4, duration=300.0)


def selective_sybils() -> Scenario:
    """(d) Two Sybils in a group of 4 each talk to one honest member only (and refuse the
    other's dials). Seen: the group split into two committing pairs: a fork."""
    peers = (PeerPlan(initiator=True), PeerPlan(initiator=True),
             PeerPlan(initiator=True, honest=False, answers=(0, 3)),
             PeerPlan(initiator=True, honest=False, answers=(1, 2)))
    return Scenario("selective_sybils", peers, group_size=4, duration=300.0)


def sybils(attack: str, honest: int = 4, k: int = 2, group_size: int = 4, duration: float = 300.0) -> Scenario:
    """`k` adversaries running `attack` beside `honest` honest peers, all starting together."""
    peers = tuple(PeerPlan(initiator=True) for _ in range(honest)) + tuple(
        PeerPlan(initiator=True, honest=False, attack=attack) for _ in range(k))
    return Scenario(f"sybils-{attack}-{k}", peers, group_size=group_size, duration=duration)


def selective_six() -> Scenario:
    """The red team's `selective` (p2ptrain bench redteam): 4 honest peers and 2 Sybils in one
    group of 6, each Sybil talking to one honest member (and the other Sybil) only. Seen: the
    members that saw a Sybil named it in their rosters, the others skipped at once (G1: a view
    naming a member we lack will not run ours), and each step took several retries."""
    peers = tuple(PeerPlan(initiator=True) for _ in range(4)) + (
        PeerPlan(initiator=True, honest=False, answers=(0, 5)), PeerPlan(initiator=True, honest=False, answers=(1, 4)))
    return Scenario("selective_six", peers, group_size=8, duration=300.0)


def hot_pair() -> Scenario:
    """Two honest peers; one's first pseudo-gradient is 6x the other's, over the 3x bound a
    member without standing holds it to (C1a). Seen (the lone-run test before W1's last-roster
    clause): every retry of the step repeated the refused delta, and the pair never committed
    again."""
    return Scenario("hot_pair", (PeerPlan(initiator=True), PeerPlan(initiator=True, hot=(0, 6.0))),
                    group_size=4, duration=300.0)


def churn(seed: int, peers: int, period: float, down: float = 5.0, duration: float = 400.0,
          tail: float = 100.0) -> Scenario:
    """Churn with period `period`: every `period` seconds one peer (round robin, in an order
    drawn from `seed`) is killed and restarted `down` seconds later with its workdir, as
    `p2ptrain bench churn` does to real processes; the last kill leaves `tail` seconds for
    the run to settle. `period` inf: the same world without churn (its step time is t_step
    in the bound 1 - t_step/T). Links as the random worlds', no other fault."""
    rng = random.Random(seed)
    order = list(range(peers))
    rng.shuffle(order)
    kills: dict[int, list[tuple[float, float]]] = {i: [] for i in range(peers)}
    at, k = rng.uniform(20.0, 20.0 + min(period, 60.0)), 0
    while math.isfinite(period) and at + down <= duration - tail:
        kills[order[k % peers]].append((at, at + down))
        at, k = at + period, k + 1
    plans = tuple(PeerPlan(initiator=True, outages=tuple(kills[i])) for i in range(peers))
    name = f"churn-{peers}-T{period:g}" if period != float("inf") else f"churn-{peers}-calm"
    return Scenario(name, plans, group_size=4, duration=duration, links=LinkConfig(median_rtt=0.1, max_latency=0.15))


NAMED = {"lone_start": lone_start, "six_in_threes": six_in_threes, "restart_pair": restart_pair,
         "selective_sybils": selective_sybils, "selective_six": selective_six, "hot_pair": hot_pair,
         "withhold": lambda: sybils("withhold"), "inflate": lambda: sybils("inflate", honest=4, k=4, group_size=4),
         "expiry": lambda: sybils("expiry", honest=4, k=1),
         # one group of 5: every round has the trickler in it
         "trickle": lambda: sybils("trickle", honest=4, k=1, group_size=8),
         "grind": lambda: sybils("grind", honest=4, k=4, duration=150.0),
         # one group of 6: what breaks is the flood's doing, not issue 31's split groups
         "flood": lambda: sybils("flood", honest=4, k=2, group_size=8, duration=120.0),
         "flood_wide": lambda: flood_wide()}


def flood_wide(senders: int = 300) -> Scenario:
    """`flood` with each of the 2 Sybils also storing from `senders` client connections of
    their own (one identity each, small records: the reply's random tier)."""
    import dataclasses

    sc = sybils("flood", honest=4, k=2, group_size=8, duration=120.0)
    return dataclasses.replace(sc, name=f"sybils-flood-wide-{senders}", flood_senders=senders)


ATTACKS = ("selective", "withhold", "inflate", "expiry", "trickle", "grind", "flood")


def random_world(seed: int, peers: int, *, faults: bool = True, median_rtt: float = 0.1,
                 duration: float | None = None, sybils: int = 0) -> Scenario:
    """A world drawn from `seed`: links of 5-300 ms around `median_rtt`, and with `faults`
    10 % slow peers (2-5x), clock skew, late joiners, churn (crash and restart) and one
    30-120 s partition, all over by two thirds of the run."""
    rng = random.Random(seed)
    G = 4 if peers < 32 or rng.random() < 0.5 else 16
    duration = duration or (400.0 if peers <= 16 else 600.0)
    calm = duration * 2 / 3
    plans = []
    for i in range(peers):
        if not faults:
            plans.append(PeerPlan(initiator=True))
            continue
        slow = rng.uniform(2.0, 5.0) if rng.random() < 0.1 else 1.0
        join = 0.0 if i < max(2, peers // 2) or rng.random() < 0.5 else rng.uniform(0, calm / 2)
        outages = ()
        if rng.random() < 0.15:
            down = rng.uniform(join + 20, calm - 40)
            outages = ((down, down + rng.uniform(10, 40)),)
        plans.append(PeerPlan(initiator=join == 0.0, join_at=join, slow=slow, skew=rng.uniform(-2, 2),
                              outages=outages))
    if sybils:  # the last `sybils` identities are adversaries, each with one scripted attack
        honest = list(range(peers - sybils))
        for i in range(peers - sybils, peers):
            attack = rng.choice(ATTACKS)
            answers = tuple(sorted(rng.sample(honest, max(1, len(honest) // 2)))) if attack == "selective" else None
            plans[i] = PeerPlan(initiator=True, honest=False, attack="" if attack == "selective" else attack,
                                answers=answers)
    parts = ()
    if faults and peers >= 4:
        start = rng.uniform(30, calm - 120)
        ids = list(range(peers))
        rng.shuffle(ids)
        cut = rng.randint(1, peers - 1)
        parts = (Partition(start, start + rng.uniform(30, 120), (tuple(ids[:cut]), tuple(ids[cut:])),
                           one_way=rng.random() < 0.25),)
    links = LinkConfig(median_rtt=median_rtt, min_latency=0.005 if median_rtt <= 0.1 else 0.01,
                       max_latency=0.15 if median_rtt <= 0.1 else 0.3)
    name = f"random-{peers}{'' if faults else '-nofault'}{f'-sybils{sybils}' if sybils else ''}"
    return Scenario(name, tuple(plans), group_size=G, duration=duration, links=links, partitions=parts)


def without_adversaries(sc: Scenario) -> Scenario:
    """The same world with every adversary an honest peer (same identities, seeds, links):
    the baseline an attack's figures are compared with."""
    import dataclasses

    peers = tuple(p if p.honest else dataclasses.replace(p, honest=True, answers=None, attack="") for p in sc.peers)
    return dataclasses.replace(sc, peers=peers)  # same name: same run id, same deal


def describe(sc: Scenario) -> str:
    slow = sum(p.slow > 1 for p in sc.peers)
    churn = sum(bool(p.outages) for p in sc.peers)
    late = sum(p.join_at > 0 for p in sc.peers)
    bad = ", ".join(p.attack or "selective" for p in sc.peers if not p.honest)
    parts = ", ".join(f"partition {p.start:.0f}-{p.end:.0f}s{' one-way' if p.one_way else ''}" for p in sc.partitions)
    return (f"{sc.name}: {len(sc.peers)} peers, G={sc.group_size}, {slow} slow, {churn} restarting, {late} late, "
            f"{parts or 'no partition'}, {sc.duration:.0f}s" + (f", adversaries: {bad}" if bad else ""))
