"""Issue 15's trust holes, one test (or more) each: a single identity must not be able to
stall, fork or hijack a run. Pure-logic tests here; each failed on commit 5f080d3."""

from __future__ import annotations

import hashlib
import math
import types

import numpy as np
import pytest

from p2ptrain.run import election
from p2ptrain.run import influence as I

H = [hashlib.sha256(bytes([i])).hexdigest() for i in range(8)]


# -- hole 2: a ready record's claimed time must not move the deadline ----------------------
def _ready(peer: str, at: float, joining: bool = False) -> election.Ready:
    return election.Ready(peer, at, (), joining)


def test_one_liar_with_an_early_ready_at_does_not_empty_the_honest_groups():
    honest = [_ready(f"h{i}", 1000.0 + 0.3 * i) for i in range(4)]
    liar = _ready("liar", 1.0)  # "I was ready in 1970": on 5f080d3 the deadline became 6.0
    cands = {r.peer for r in election.candidates([*honest, liar], window=5.0)}
    assert {r.peer for r in honest} <= cands
    # and the groups every honest peer computes still hold every honest peer
    groups = election.groups("run", 3, sorted(cands), 4)
    assert sorted(p for g in groups for p in g if p.startswith("h")) == ["h0", "h1", "h2", "h3"]


def test_a_minority_of_liars_cannot_pull_the_deadline_below_the_earliest_honest_peer():
    for k in (1, 2, 3):
        honest = [_ready(f"h{i}", 1000.0 + i) for i in range(4)]
        liars = [_ready(f"s{j}", 1.0) for j in range(k)]
        assert election.deadline([*honest, *liars], 5.0) >= 1000.0 + 5.0
    # joiners never start the clock, whatever they claim
    assert election.deadline([_ready("j", 1.0, True), _ready("h", 50.0)], 5.0) == 55.0


def test_a_ready_record_is_timed_by_the_readers_first_sighting():
    """Rule D1: the record's time is when this reader first saw it; re-reading it later, or
    the writer re-storing it with another claim or expiry, moves nothing."""
    s = election.Sightings()
    assert s.observe(3, ["a"], 10.0) == {"a": 10.0}
    assert s.observe(3, ["a", "b"], 10.2) == {"a": 10.0, "b": 10.2}
    s.observe(9, [], 50.0)
    assert (3, "a") not in s.first  # old steps forgotten


def test_a_retry_is_a_new_election_timed_afresh():
    """Rule T6: a record first seen after step t's deadline is no candidate at t; when t is
    tried again (nobody committed it), the retry's election times every record anew, so a
    member that came back late (or whose record reached us late) is elected with the rest.
    Before, the first try's sightings stayed: the retry's deadline was the first try's, long
    past, and the late record was left out of every retry (16 real processes: four peers
    retried one step every 120 s until stopped)."""
    R = election.Ready
    s = election.Sightings()

    def elect(now: float, peers: list[str]) -> list[str]:
        seen = s.observe(5, peers, now)
        recs = [R(p, seen[p]) for p in peers]
        return sorted(r.peer for r in election.candidates(recs, window=5.0))

    assert elect(100.0, ["a", "b"]) == ["a", "b"]
    assert elect(130.0, ["a", "b", "late"]) == ["a", "b"]  # seen 25 s after the deadline (105)
    assert elect(300.0, ["a", "b", "late"]) == ["a", "b"]  # the same step read again: still out
    s.forget(5)  # the retry
    assert elect(300.0, ["a", "b", "late"]) == ["a", "b", "late"]
    s.observe(6, ["a"], 301.0)
    s.forget(5)
    assert (6, "a") in s.first  # only that step's sightings


# -- hole 3: planting a checkpoint on joiners ----------------------------------------------
def _prov(peer, step, manifest, members, sha=H[5]):
    from p2ptrain.ckpt import providers
    return providers.Provider(peer, step, manifest, sha, H[6], tuple(sorted(members)), ())


def test_a_self_attesting_group_of_one_ranks_below_any_group_that_attests():
    from p2ptrain.ckpt import providers
    g = ["a", "b", "c", "d"]
    honest = [_prov(p, 3, H[1], g) for p in g]
    planted = _prov("m", 50, H[2], ["m"], sha=H[3])
    c = providers.choose([*honest, planted], H[7], max_group=4)
    assert (c.step, c.manifest) == (3, H[1])
    # alone in the run (nobody else advertises), a group of one is still its own quorum
    assert providers.choose([planted], H[7]).step == 50


def test_attestation_outranks_step_and_member_lists_must_be_distinct():
    from p2ptrain.ckpt import providers
    g = ["a", "b", "c", "d"]
    honest = [_prov(p, 3, H[1], g) for p in g[:3]]
    sybils = [_prov(s, 10**6, H[2], ["s1", "s2"], sha=H[3]) for s in ("s1", "s2")]
    c = providers.choose([*honest, *sybils], H[7], max_group=4)
    assert (c.step, c.attesters) == (3, ("a", "b", "c"))
    padded = [_prov("m", 9, H[4], ["m", "m", "m", "n"], sha=H[3]), _prov("n", 9, H[4], ["m", "m", "m", "n"], sha=H[3])]
    assert providers.choose([*padded, _prov("z", 1, H[0], [])], H[7]) is None
    # a full group of 4 Sybils ties the honest group on count: peers this node verified win
    sy4 = [_prov(f"s{i}", 10**6, H[2], [f"s{j}" for j in range(4)], sha=H[3]) for i in range(4)]
    full = [_prov(p, 3, H[1], g) for p in g]
    assert providers.choose([*full, *sy4], H[7], max_group=4, trusted={"a", "b"}).step == 3
    # and a checkpoint that failed to load is never chosen again
    assert providers.choose(full, H[7], reject={H[5]}) is None


def test_checkpoint_meta_never_sets_the_outer_hyperparameters():
    import torch

    from p2ptrain.ckpt import checkpoint
    from p2ptrain.train import local
    from p2ptrain.train.outer import OuterConfig, OuterOptimizer

    outer = OuterOptimizer(torch.nn.Linear(4, 3), OuterConfig(0.7, 0.9))
    sd = outer.state_dict()
    arrays = {"outer": sd["outer"].numpy(), "momentum": sd["momentum"].numpy()}
    data = checkpoint.encode(arrays, {"outer_step": 5, "steps": 5, "skipped": 0,
                                      "config": {"lr": 1000.0, "momentum": 0.0, "nesterov": False}})
    state, step = local.decode_state(data)
    victim = OuterOptimizer(torch.nn.Linear(4, 3), OuterConfig(0.7, 0.9))
    victim.load_state_dict(state)
    assert (step, victim.steps) == (5, 5)
    assert (victim.cfg.lr, victim.cfg.momentum, victim.cfg.nesterov) == (0.7, 0.9, True)
    victim.load_state_dict({**state, "config": {"lr": 1000.0, "momentum": 0.0}})
    assert victim.cfg.lr == 0.7


# -- hole 4: arbitrarily large values ------------------------------------------------------
def _headers(norms: dict, chunk_norms: dict | None = None, trusts: dict | None = None, refs: dict | None = None):
    """Signed headers for members named by `norms` (in roster order); `trusts`: name -> the
    names it has standing with, `refs`: name -> its signed reference norm."""
    from p2ptrain.identity import Identity
    from p2ptrain.run import contribution as C

    ids = {name: Identity.generate() for name in norms}
    members = [ids[n].peer_id_str for n in norms]
    pos = {n: i for i, n in enumerate(norms)}
    raw = {}
    for name, norm in norms.items():
        cn = (chunk_norms or {}).get(name) or tuple([norm / math.sqrt(len(norms))] * len(norms))
        anchor = (tuple(sorted(pos[x] for x in (trusts or {}).get(name, ()))), (refs or {}).get(name, 0.0)) \
            if trusts or refs else ()
        h = C.Header("run", 4, 0, "r" * 64, ids[name].peer_id_str, tuple(cn), (H[len(raw)],), norm, 10, 100, *anchor)
        raw[ids[name].peer_id_str] = C.sign_header(h, ids[name])
    return raw, members, {n: ids[n].peer_id_str for n in norms}


def test_chunk_norms_must_add_up_to_the_signed_norm():
    from p2ptrain.run import contribution as C

    raw, members, ids = _headers({"a": 1.0, "b": 1.1, "c": 0.9, "m": 1.0},
                                 {"m": (1e30, 1e30, 1e30, 1e30)})  # norm 1, frames may carry 1e30
    ok, bad = I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})
    assert bad == {ids["m"]: "chunk-norms-inconsistent"} and len(ok) == 3


def test_a_group_of_two_bounds_the_norm_too():
    from p2ptrain.run import contribution as C

    raw, members, ids = _headers({"a": 1.0, "m": 1e6})
    ok, bad = I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})
    assert bad == {ids["m"]: "norm-over-anchor"} and list(ok) == [ids["a"]]
    # a joiner's zero norm bounds nobody; the reference it signs (its own past norms) does
    raw, members, ids = _headers({"j": 0.0, "m": 1e6})
    ok, bad = I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})
    assert not bad
    raw, members, ids = _headers({"j": 0.0, "m": 1e6}, refs={"j": 1.1})
    ok, bad = I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})
    assert bad == {ids["m"]: "norm-over-anchor"}
    # honest pairs within the factor pass: 3x without standing, 10x with it
    raw, members, ids = _headers({"a": 1.0, "b": 3.0})
    assert not I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})[1]
    raw, members, ids = _headers({"a": 1.0, "b": 8.0}, trusts={"a": {"b"}})
    assert not I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})[1]


def test_joiners_zeros_do_not_set_the_norm_bar():
    """The median is over the members that trained. Before, two joiners among four made it
    half the smaller trained norm (an honest 8x spread was an 'outlier'), and three among
    four made it 0: no bar at all, so a lone trainer's 1e6 passed."""
    from p2ptrain.run import contribution as C

    raw, members, ids = _headers({"j1": 0.0, "j2": 0.0, "a": 1.0, "b": 8.0}, trusts={"a": {"b"}})
    assert not I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})[1]  # 8 <= 10 x anchor(a)
    raw, members, ids = _headers({"j1": 0.0, "j2": 0.0, "j3": 0.0, "m": 1e6}, refs={"j1": 1.0, "j2": 1.2})
    ok, bad = I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})
    assert bad == {ids["m"]: "norm-over-anchor"} and len(ok) == 3
    raw, members, ids = _headers({"j1": 0.0, "a": 1.0, "b": 1.2, "c": 0.9, "m": 12.0},
                                 trusts={p: {"a", "b", "c", "m"} - {p} for p in "abc"})
    ok, bad = I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})
    assert bad == {ids["m"]: "norm-outlier"} and len(ok) == 4  # median of 1.0, 1.2, 0.9, 12: 1.1



# -- issue 32, item 1: an influence bound Sybils cannot move ---------------------------------
def _scaled(d: np.ndarray, ratio: float, ref: np.ndarray) -> np.ndarray:
    """`d`'s direction with `ratio` x the norm of `ref` (norms as the round signs them)."""
    scale = ratio * np.linalg.norm(ref.astype(np.float64)) / np.linalg.norm(d.astype(np.float64))
    return (d * scale).astype(np.float32)


def _norms(outcome, a: str, s: str) -> float | None:
    """The committed ratio of s's signed norm to a's, or None when s was not in the round."""
    h = outcome.headers
    return h[s].norm / h[a].norm if s in h and a in h else None


def test_an_honest_member_alone_with_sybils_rejects_their_norms():
    """On 43993a7 the Sybils set the 10x-median themselves: 1e6x passed."""
    from p2ptrain.run import contribution as C

    for k in (2, 4):
        sybils = [f"s{i}" for i in range(k)]
        raw, members, ids = _headers({"a": 1.0, **{s: 1e6 for s in sybils}})
        ok, bad = I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})
        assert list(ok) == [ids["a"]] and bad == {ids[s]: "norm-over-anchor" for s in sybils}


def test_an_honest_member_with_two_sybils_never_commits_their_contributions():
    from test_round_memory import Hub, deltas, member, run_rounds

    hub = Hub()
    rounds = [member(hub, i + 1)[0] for i in range(3)]
    ds = deltas(3)
    ds[1:] = [_scaled(d, 1e6, ds[0]) for d in ds[1:]]
    a = run_rounds(rounds, ds)[0]
    assert a.members == [rounds[0].me] and not a.headers  # the Sybils are out of every round it commits
    assert a.result is None or np.array_equal(a.result, ds[0])
    assert all(r.me not in rounds[0].ledger.standing.rounds for r in rounds[1:])


def test_a_pairs_allowed_norm_does_not_ratchet():
    """A pair: honest A (norm 1 each step) and a Sybil S that signs just under what A lets
    through. On 43993a7 S was held to 10x max(A's norm, median of its own accepted norms), so
    each accepted norm raised the next bound: 9.9, 98, 534, ... 9,606x over 8 steps. Now S is
    held to A's anchor this round: 3x on probation, 10x once it has standing with A."""
    from test_round_memory import Hub, deltas, member, run_rounds

    # 1. the old ratchet's schedule, played against the round: no committed ratio over 10
    hub = Hub()
    rounds = [member(hub, i + 1)[0] for i in range(2)]
    a, s = rounds[0].me, rounds[1].me
    past: list[float] = []
    for t in range(1, 9):
        ratio = 0.99 * 10 * max(1.0, float(np.median(past)) if past else 0.0)
        ds = deltas(t + 10)[:2]
        o = run_rounds(rounds, [ds[0], _scaled(ds[1], ratio, ds[0])], t=t)[0]
        got = _norms(o, a, s)
        assert got is None or got <= 10 * 1.001, (t, got)
        if got is not None:
            past.append(got)

    # 2. an attacker that probes A's exact rule every step and signs 0.99x the most it allows,
    #    earning standing as it goes: the allowed ratio never exceeds the documented 10x
    from p2ptrain.run import contribution as C
    from p2ptrain.identity import Identity

    hub = Hub()
    rounds = [member(hub, i + 11)[0] for i in range(2)]
    a, s = rounds[0].me, rounds[1].me
    sid = Identity.from_seed(bytes([12]) * 32)
    allowed = []
    for t in range(1, 9):
        roster = election.ring_order("ef" * 32, t, [a, s])
        rh = election.roster_hash("ef" * 32, t, 0, roster)
        mine = C.sign_header(rounds[0].header(t, 0, rh, roster, (0.6, 0.8), (H[0],), 4, 100), rounds[0].identity)

        def passes(x: float) -> bool:
            theirs = C.Header("ef" * 32, t, 0, rh, s, (x, 0.0), (H[t % 8],), x, 4, 100)
            raw = {a: mine, s: C.sign_header(theirs, sid)}
            return s not in rounds[0]._verify(raw, t, 0, rh, roster).bad

        lo, hi = 1.0, 1e7
        assert passes(lo) and not passes(hi)
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if passes(mid) else (lo, mid)
        allowed.append(lo)
        ds = deltas(t + 20)[:2]
        o = run_rounds(rounds, [ds[0], _scaled(ds[1], 0.99 * lo, ds[0])], t=t)[0]
        assert _norms(o, a, s) is not None, t  # within the bound it is a member like any other
    assert max(allowed) <= 10.0 + 1e-6 and allowed[0] <= 3.0 + 1e-6, allowed
    assert allowed[-1] > 9.9  # and standing earned the trusted 10x


def test_members_with_different_standing_reach_the_same_verdict():
    """A trusts S (2 committed steps with it), B does not. On 43993a7 each member applied
    its own trusted set: S's 5x passed A's rule and failed B's. Now each member's trust is
    signed in its header, every member applies every signed bound, and all three compute the
    same verdict from the same headers."""
    from test_round_memory import Hub, deltas, member, run_rounds
    from p2ptrain.run import contribution as C

    def group():
        hub = Hub()
        rounds = [member(hub, i + 1)[0] for i in range(3)]
        a, b, s = (r.me for r in rounds)
        for t in (1, 2):  # verified work, as `Ledger.remember` counts it
            rounds[0].ledger.standing.committed(t, [b, s])
            rounds[1].ledger.standing.committed(t, [a])
            rounds[2].ledger.standing.committed(t, [a, b])
        return rounds, a, b, s

    # through the round: A and B commit the same mean, without S, at the first step
    rounds, a, b, s = group()
    ds = deltas(3)
    ds[2] = _scaled(ds[2], 5.0, ds[0])
    outs = run_rounds(rounds, ds, t=3)
    assert sorted(outs[0].members) == sorted([a, b]) and outs[0].result is not None
    assert np.array_equal(outs[0].result, outs[1].result)
    assert np.allclose(outs[0].result, np.mean(ds[:2], axis=0), atol=1e-6)

    # the verdict itself: the same on every member
    rounds, a, b, s = group()
    roster = election.ring_order("ef" * 32, 3, [a, b, s])
    rh = election.roster_hash("ef" * 32, 3, 0, roster)
    norms = {a: 1.0, b: 1.2, s: 5.0}
    raw = {r.me: C.sign_header(r.header(3, 0, rh, roster, (norms[r.me], 0.0, 0.0), (H[i],), 4, 100), r.identity)
           for i, r in enumerate(rounds)}
    verdicts = [r._verify(raw, 3, 0, rh, roster) for r in rounds]
    assert all(v == verdicts[0] for v in verdicts)
    assert verdicts[0].bad == {s: "norm-over-anchor"} and verdicts[0].objections == {(b, s)}
    # whom each honest member leaves out: both leave S out (B convicts it, A cannot tell)
    assert I.leave_out(a, verdicts[0].objections) == (set(), {s})
    assert I.leave_out(b, verdicts[0].objections) == ({s}, set())


def test_whom_each_member_leaves_out_after_an_objection():
    """`leave_out` from the shared objections: honest a, b, c that do not object to each other
    leave out the same Sybil whether it signs a huge norm (they object to it) or a tiny anchor
    (it objects to all of them); the limit DESIGN states: a Sybil objecting to a only makes
    b, compatible with both, sit a out for the step (never a conviction)."""
    from p2ptrain.run import contribution as C

    huge = frozenset((h, "s") for h in "abc")
    tiny = frozenset(("s", h) for h in "abc")
    for me in "abc":
        assert I.leave_out(me, huge) == ({"s"}, set())
        assert I.leave_out(me, tiny) == (set(), {"s"})
    raw, members, ids = _headers({"a": 3.0, "b": 1.0, "s": 0.5})  # s's anchor bounds a (3 > 1.5), not b
    v = I.judge_headers(raw, "run", 4, 0, "r" * 64, members, {})
    assert v.objections == {(ids["s"], ids["a"])} and v.bad == {ids["a"]: "norm-over-anchor"}
    assert I.leave_out(ids["b"], v.objections) == (set(), {ids["a"]})
    assert I.leave_out(ids["a"], v.objections) == (set(), {ids["s"]})


# -- issue 32, item 6: reputation counts only reporters with standing -----------------------
def test_two_sybil_reports_do_not_exclude_honest_peers_and_reports_with_standing_still_work():
    """Over the in-memory DHT tier, through `Ledger.apply_reputation`. On 43993a7 any 2
    reporters excluded any peer for the rest of the run: 2 Sybils named every honest peer."""
    from conftest import trio_test
    from test_dht_memory import join_all, make_swarm
    from test_round_memory import Events

    from p2ptrain.records import RunRecords
    from p2ptrain.run import reputation
    from p2ptrain.run.ledger import Ledger

    @trio_test()
    async def scenario():
        _, nodes = make_swarm(9)
        await join_all(nodes)
        me, h1, h2, h3, h4, h5, s1, s2, x = (n.identity.peer_id_str for n in nodes)
        ledger = Ledger(me, Events())
        for t in (1, 2):  # verified work with the honest peers, none with the Sybils
            ledger.standing.committed(t, [h1, h2, h3, h4, h5])
        for sybil in nodes[6:8]:  # two Sybils name every honest peer (and the reader)
            assert await RunRecords(sybil, "run").publish_reputation({p: 3 for p in (me, h1, h2, h3, h4, h5)}) >= 1
        await ledger.apply_reputation(nodes[0], "run", 3)
        assert ledger.ignored == set()
        # two reporters with standing exclude a peer without standing (x) ...
        for honest in nodes[1:3]:
            assert await RunRecords(honest, "run").publish_reputation({x: 3, h3: 3}) >= 1
        await ledger.apply_reputation(nodes[0], "run", 3)
        # ... but not a peer with standing: that needs a majority of those with standing (3 of 4)
        assert ledger.ignored == {x}
        assert await RunRecords(nodes[4], "run").publish_reputation({h3: 3}) >= 1
        await ledger.apply_reputation(nodes[0], "run", 4)
        assert ledger.ignored == {x, h3}
        # an exclusion by reputation expires with its reports
        await ledger.apply_reputation(nodes[0], "run", 3 + reputation.HORIZON + 1)
        assert ledger.ignored == set()
        # and our own verdict on a peer never expires
        ledger.reject(3, s1, "bad-signature")
        await ledger.apply_reputation(nodes[0], "run", 100)
        assert ledger.ignored == {s1}

    scenario()


# -- hole 5: one record is not the run's state; issue 31: nor is a vote of records -------
def test_the_head_is_the_best_attested_trained_state_and_our_own_record_is_no_vote():
    """Rule H1 (docs/PROTOCOL.md). Before, the run's state was the one most state records
    named: three joiners' genesis records outvoted the one peer that had trained 116 steps,
    and a restarted peer's own old record outvoted the state its partner trained on."""
    from p2ptrain.ckpt import providers
    genesis = [_prov(p, 0, H[0], [], sha=H[7]) for p in ("j1", "j2", "j3")]
    lone = _prov("first", 116, H[1], ["first"])
    c = providers.choose([*genesis, lone], H[7], max_group=4)
    assert (c.step, c.attesters) == (116, ("first",))  # trained work outranks any genesis count
    # the restarted peer's own record (step 5, its old pair) is not read; its partner's is
    old = _prov("me", 5, H[2], ["me", "partner"])
    partner = _prov("partner", 20, H[3], ["partner"])
    assert providers.choose([old, partner], H[7], max_group=4, ignore={"me"}).step == 20
    assert providers.choose([old], H[7], max_group=4, ignore={"me"}) is None
    # a state two members attest outranks a lone one at any step (one identity's claim)
    pair = [_prov(p, 3, H[4], ["a", "b"]) for p in ("a", "b")]
    assert providers.choose([*pair, _prov("s", 10**6, H[5], ["s"])], H[7], max_group=4).step == 3


def test_a_restart_names_the_group_it_committed_its_state_with_again():
    """Rule J3: a restarted member's first provider record named no group (a new process
    knows no roster) and replaced its attesting one; once both members of a pair had
    restarted, nobody attested their state and `choose` found no head (simulator seed
    124021). It now names the group its earlier record named, for the same state only."""
    from p2ptrain.ckpt import providers
    ours = _prov("me", 6, H[1], ["me", "partner"])
    assert providers.own_roster([ours, _prov("partner", 6, H[1], ["me", "partner"])], "me", 6, H[6]) \
        == ("me", "partner")
    assert providers.own_roster([ours], "me", 7, H[6]) == ()  # another step
    assert providers.own_roster([ours], "me", 6, H[3]) == ()  # other params
    assert providers.own_roster([_prov("me", 6, H[1], ["other"])], "me", 6, H[6]) == ()  # not a member
    assert providers.own_roster([_prov("partner", 6, H[1], ["me", "partner"])], "me", 6, H[6]) == ()  # not ours
    wiped = [_prov("me", 6, H[1], []), _prov("partner", 6, H[1], [])]
    assert providers.choose(wiped, H[7], max_group=4) is None  # what a restart without J3 left
    reattested = [_prov("me", 6, H[1], ["me", "partner"]), _prov("partner", 6, H[1], [])]
    assert providers.choose(reattested, H[7], max_group=4).step == 6


@pytest.mark.integration
def test_catch_up_survives_a_checkpoint_that_hashes_right_but_does_not_load():
    """Real libp2p nodes on 127.0.0.1: two donors attest (step 3) bytes that hash right but
    hold a state of another model; two others attest a good step-2 state. On 5f080d3 the
    loader's CheckpointError escaped `catch_up` and ended the node; now the bad hash is
    rejected and the good state adopted."""
    import torch
    import trio

    from conftest import LOOPBACK
    from p2ptrain.ckpt import checkpoint
    from p2ptrain.ckpt.catchup import adopt
    from p2ptrain.ckpt.download import CheckpointServer
    from p2ptrain.ckpt.fetch import BlobServer
    from p2ptrain.events import EventSink
    from p2ptrain.identity import Identity
    from p2ptrain.net.node import Node, NodeConfig
    from p2ptrain.train import local
    from p2ptrain.train.outer import OuterOptimizer

    good_outer = OuterOptimizer(torch.nn.Linear(4, 3))
    good_outer.outer += 1.0
    good = local.encode_state(good_outer, 2)
    bad = checkpoint.encode({"outer": np.zeros(7, np.float32), "momentum": np.zeros(7, np.float32)},
                            {"outer_step": 3})
    victim = OuterOptimizer(torch.nn.Linear(4, 3))
    events = []

    class Sink(EventSink):
        def emit(self, kind, **kw):
            events.append(kind)

    def load(data: bytes) -> None:
        victim.load_state_dict(local.decode_state(data)[0])

    async def main():
        async with trio.open_nursery() as nursery:
            first = Identity.generate()
            entry = Node(first, NodeConfig(listen=[LOOPBACK]), Sink(first.peer_id_str, False))
            await nursery.start(entry.run)
            boot = f"{entry.rpc.local_addrs()[0]}/p2p/{first.peer_id_str}"
            donors = []
            for _ in range(4):
                ident = Identity.generate()
                node = Node(ident, NodeConfig(listen=[LOOPBACK], bootstrap=[boot]), EventSink(ident.peer_id_str, False))
                await nursery.start(node.run)
                donors.append(node)
            ids = [d.identity.peer_id_str for d in donors]
            for i, node in enumerate(donors):
                data, step, group = (bad, 3, ids[:2]) if i < 2 else (good, 2, ids[2:])
                await CheckpointServer(BlobServer(node.host), 4096).publish(
                    node.dht, "run", data, step, H[0], group, node.rpc.local_addrs())
            spec = types.SimpleNamespace(train=types.SimpleNamespace(group_size=4),
                                         genesis=types.SimpleNamespace(sha256=H[7], bytes=len(good)))
            rejected: set[str] = set()
            with trio.fail_after(60):
                got = await adopt(entry, "run", spec, Sink(first.peer_id_str, False), 1, 0, load,
                                  timeout=30, rejected=rejected)
            nursery.cancel_scope.cancel()
            return got, rejected

    got, rejected = trio.run(main)
    assert got == 2
    assert rejected == {hashlib.sha256(bad).hexdigest()}
    assert torch.equal(victim.outer, good_outer.outer)
    assert "checkpoint_rejected" in events


# -- hole 6: standing earned only by verified work -----------------------------------------
def test_standing_counts_contributed_committed_steps_once_each():
    from p2ptrain.run.standing import Standing, StandingConfig

    s = Standing("me", StandingConfig(rounds=2))
    s.committed(1, ["me", "a", "b"])
    s.committed(1, ["a"])  # a retry of the same step is not more work
    assert s.trusted() == frozenset()
    s.committed(2, ["me", "a"])
    assert s.trusted() == {"a"}
    s.forget("a")
    assert s.trusted() == frozenset()
    with pytest.raises(ValueError):
        StandingConfig(rounds=0)


def test_fresh_identities_are_held_to_the_trusted_members_norms():
    from p2ptrain.run import contribution as C

    # 4 honest (norm ~1) that trust each other and 4 Sybils each signing 8x that trust each
    # other: under the 10x-median rule alone all 8 would pass; on probation with every honest
    # member each Sybil may sign at most 3x that member's norm.
    honest, sybils = ["a", "b", "c", "d"], [f"s{i}" for i in range(4)]
    norms = {"a": 1.0, "b": 1.1, "c": 0.9, "d": 1.0, **{s: 8.0 for s in sybils}}
    trusts = {**{p: set(honest) - {p} for p in honest}, **{s: set(sybils) - {s} for s in sybils}}
    raw, members, ids = _headers(norms, trusts=trusts)
    ok, bad = I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})
    assert bad == {ids[s]: "norm-over-anchor" for s in sybils} and set(ok) == {ids[p] for p in honest}
    # an honest newcomer's ordinary norm passes probation
    raw, members, ids = _headers({"a": 1.0, "b": 1.1, "n": 1.6}, trusts={"a": {"b"}, "b": {"a"}})
    assert not I.verify_headers(raw, "run", 4, 0, "r" * 64, members, {})[1]


# -- the red-team bench's arithmetic ---------------------------------------------------------
def test_redteam_measures_forks_exclusions_and_progress():
    from p2ptrain.bench import redteam

    def ev(kind, peer, step, **kw):
        return {"event": kind, "peer": peer, "step": step, "t": float(step), **kw}
    honest = {"a", "b"}
    base = [ev("outer_step_started", p, s) for p in honest for s in range(2)] + \
        [ev("outer_step_committed", p, s + 1, params_sha256=f"h{s}", val_loss=3.0) for p in honest for s in range(2)]
    attacked = [ev("outer_step_started", p, s) for p in honest for s in range(4)] + \
        [ev("outer_step_committed", "a", s + 1, params_sha256=f"h{s}", val_loss=3.3) for s in range(2)] + \
        [ev("outer_step_committed", "b", 1, params_sha256="x", val_loss=3.3),
         ev("outer_step_committed", "b", 2, params_sha256="h1", val_loss=3.3),
         ev("contribution_rejected", "a", 1, remote="b"), ev("contribution_rejected", "a", 1, remote="evil")]
    rows = [redteam.measure("baseline", base, honest, 2, 1.0), redteam.measure("x", attacked, honest, 2, 1.0)]
    assert rows[1]["param_forks"] == 1 and rows[1]["wrongly_excluded"] == 1
    assert rows[1]["attackers_rejected"] == ["evil"[-8:]]
    s = redteam.summarize(rows)
    assert s["honest_progress_min_ratio"] == 1.0 and s["honest_param_forks"] == 1
    assert s["honest_wrongly_excluded"] == 1 and s["worst_val_loss_pct"] == 10.0
    assert rows[1]["val_curve"] == {1: 3.3, 2: 3.3} and rows[1]["val_curve_pct"] == 10.0  # every step, not the last


def test_an_early_peer_does_not_close_the_step_on_expected_peers_not_yet_ready():
    me, liar = _ready("h0", 1000.0), _ready("liar", 999.0)
    # alone with a liar, 3 peers of the last roster not posted yet: wait for them (bounded)
    assert election.deadline([me, liar], 3.0, missing=3, now=1001.0) == 1001.0 + 3.0
    assert election.deadline([me, liar], 3.0, missing=3, now=1100.0) == 999.0 + 6.0 + 3.0  # dead: capped
    assert election.deadline([me, liar], 3.0) == 1000.0 + 3.0
    # the candidates are those ready by the deadline the caller waited for
    late = _ready("h1", 1005.5)
    assert [r.peer for r in election.candidates([me, liar, late], 3.0, at=1008.0)] == ["h0", "liar", "h1"]


def test_zero_contributions_twice_are_not_a_replay_but_real_ones_are():
    from p2ptrain.run import contribution as C

    raw, members, ids = _headers({"a": 1.0, "b": 1.0, "j": 0.0})
    history = {ids["j"]: {(H[2],)}, ids["a"]: {(H[0],)}}  # both sent these digests before
    ok, bad = I.verify_headers(raw, "run", 4, 0, "r" * 64, members, history)
    assert bad == {ids["a"]: "replay"} and ids["j"] in ok
