"""The rules of three scripted adversaries and the figures they are judged by (pure logic:
no I/O, no trio). Their I/O -- which records they store, when -- is `p2ptrain.sim.sybil`.

  - trickle: a member of a round sends each of its data-plane frames as slowly as the real
    data plane lets it. The fate of one frame is decided by the real rules, with the real
    budget (`reduce.bulk.FrameBudget`): silence before a frame's first byte is the receiver's
    per-operation timeout (`frame_timeout`, blames nobody); from its first byte on the frame
    must be whole within its budget, or the receiver blames the sender (`bulk.FrameChannel._read`);
    and a member downstream, waiting for its predecessor to forward what the trickler sent,
    sees the whole delay as silence before its own next frame (its per-operation timeout).
  - grinding: Sybils choose per step which of them post their ready records, so that the
    election (`run.election.groups`, dealt from public hashes) puts a chosen honest peer in
    a group with Sybils only. Any reader can compute the deal for any candidate set, so the
    choice is a search over subsets of the Sybils.
  - flood: what one sender may store under a key (`dht`'s budgets) against what a reply
    carries (256 records, 256 KiB): counted by `p2ptrain.sim.sybil`, judged here.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from p2ptrain.reduce.bulk import HEADER, TAG, FrameBudget
from p2ptrain.run import election


# -- trickle -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Trickle:
    lead: float
    """Seconds of silence before each frame's first byte."""
    spread: float
    """Seconds from a frame's first byte to its last."""


def budget(config, frame_bytes: int) -> float:
    """The real budget of a begun frame (`reduce.sessions`: allowance + size at the minimum rate)."""
    return FrameBudget(config.frame_allowance, config.frame_min_rate_mbps * 1e6).seconds(frame_bytes)


def frames(config, nbytes: int, world: int) -> tuple[int, int]:
    """(frames per ring hop, bytes of the largest on the wire) for an `nbytes` fp32 vector:
    each hop moves one chunk (nbytes / world) in sub-chunk frames, each with its header and tag."""
    chunk = max(1, nbytes // max(1, world))
    per_hop = max(1, math.ceil(chunk / config.sub_chunk_bytes))
    return per_hop, HEADER.size + min(chunk, config.sub_chunk_bytes) + TAG


def slowest(config, frame_bytes: int, margin: float = 0.95) -> Trickle:
    """The slowest trickle the rules let through: each frame whole just within its budget,
    and silence plus trickle just within the per-operation timeout of the member downstream."""
    spread = min(margin * budget(config, frame_bytes), margin * config.frame_timeout)
    return Trickle(max(0.0, margin * config.frame_timeout - spread), spread)


def frame_fate(tr: Trickle, config, frame_bytes: int, world: int) -> tuple[str, float]:
    """What the real data plane does with one trickled frame, and when: ("late", s) whole
    s seconds after it was due; ("blamed", s) the receiver's budget ran out s seconds in and it
    blames the sender; ("timeout", s) a per-operation timeout fired, nobody blamed."""
    if tr.lead >= config.frame_timeout:
        return "timeout", config.frame_timeout
    b = budget(config, frame_bytes)
    if tr.spread > b:
        return "blamed", tr.lead + b
    if world > 2 and tr.lead + tr.spread >= config.frame_timeout:  # the forwarder's successor
        return "timeout", tr.lead + config.frame_timeout
    return "late", tr.lead + tr.spread


def trickled_round(trickles: dict[str, Trickle], config, nbytes: int, world: int
                   ) -> tuple[float, dict[str, str], bool]:
    """A ring round with these members trickling: (seconds added, or until it fails;
    {blamed member: reason}; failed). Every member sends one frame per sub-chunk at each
    of the 2(W-1) ring steps; a step ends when its slowest sender's frames are in."""
    if not trickles or world < 2:
        return 0.0, {}, False
    per_hop, frame_bytes = frames(config, nbytes, world)
    fates = {m: frame_fate(tr, config, frame_bytes, world) for m, tr in sorted(trickles.items())}
    bad = {m: f for m, f in fates.items() if f[0] != "late"}
    if bad:  # the first trickled frame ends the round
        at = min(s for _, s in bad.values())
        blamed = {m: f"slow frame: not whole within {budget(config, frame_bytes):.1f}s"
                  for m, (kind, _) in bad.items() if kind == "blamed"}
        return at, blamed, True
    return 2 * (world - 1) * per_hop * max(s for _, s in fates.values()), {}, False


# -- grinding ----------------------------------------------------------------------------
def isolated(run_id: str, step: int, candidates: list[str], honest: set[str], victim: str, group_size: int) -> bool:
    """Whether the election deals `victim` a group of 2 or more with no other honest peer."""
    g = election.my_group(run_id, step, candidates, group_size, victim)
    return len(g) > 1 and not (set(g) - {victim}) & honest


def grind(run_id: str, step: int, honest: set[str], sybils: list[str], victim: str, group_size: int,
          max_tries: int = 4096) -> tuple[str, ...]:
    """The Sybils that should post for `step`: the largest subset that isolates `victim` among
    the honest candidates `honest` (searched largest first, at most `max_tries` subsets), or
    all of them when none does (they post as anyone would)."""
    pool = sorted(sybils)
    tries = 0
    for r in range(len(pool), 0, -1):
        for sub in itertools.combinations(pool, r):
            if isolated(run_id, step, sorted(honest | set(sub)), honest, victim, group_size):
                return sub
            tries += 1
            if tries >= max_tries:
                return tuple(pool)
    return tuple(pool)


def isolation(groups: dict[tuple[str, int], tuple[str, ...]], victim: str, honest: set[str]) -> tuple[int, int]:
    """(steps the victim was elected into a group, steps that group held no other honest peer)."""
    mine = [set(m) for (p, _), m in groups.items() if p == victim]
    return len(mine), sum(len(g) > 1 and not (g - {victim}) & honest for g in mine)


def grind_power(run_id: str, honest: int, sybils: int, group_size: int, steps: range) -> tuple[float, float]:
    """Over `steps`, with every peer posting as told (no network, no protocol): (fraction of
    steps some subset of `sybils` Sybils isolates the first of `honest` honest peers, fraction
    it is isolated when every Sybil posts). The election rule's own exposure to grinding."""
    hs = {f"h{i}" for i in range(honest)}
    ss = [f"s{i}" for i in range(sybils)]
    victim = "h0"
    can = chance = 0
    for t in steps:
        sub = grind(run_id, t, hs, ss, victim, group_size)
        can += isolated(run_id, t, sorted(hs | set(sub)), hs, victim, group_size)
        chance += isolated(run_id, t, sorted(hs | set(ss)), hs, victim, group_size)
    n = max(1, len(steps))
    return can / n, chance / n
