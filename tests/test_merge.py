"""Merge rounds (docs/PROTOCOL.md, rule M1): members that start from different states commit one
state for all of them, or nothing. The pure arithmetic (`p2ptrain.run.merge`) and the round
that runs it (`ContributionRound` with a `BaseSource`), over the in-memory service of
tests/test_round_memory.py."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from p2ptrain.ckpt import checkpoint
from p2ptrain.run import merge
from test_round_memory import N, Hub, deltas, member, run_rounds
from conftest import run_autojump_with_threads
from p2ptrain.reduce import ring
from p2ptrain.run import election, roster as rosters
from test_round_memory import RUN


def state(seed: int, step: int = 1, bad: bool = False) -> tuple[bytes, str]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(N).astype(np.float32)
    m = rng.standard_normal(N).astype(np.float32)
    h = merge.params_hash(x)
    if bad:
        x = x + np.float32(1)  # bytes that do not hash to what their holder confirms
    return checkpoint.encode({"outer": x, "momentum": m}, {"outer_step": step}), h


def test_the_merge_is_the_work_weighted_mean_of_the_bases_and_names_a_bad_one():
    (a, ha), (b, hb) = state(1), state(2)
    p = merge.plan({"p1": (ha, 2), "p2": (ha, 2), "p3": (hb, 9)}, group_size=4)
    assert p.needed and p.missing(ha) == [(hb, ("p3",))]
    assert {h: w for h, w, _ in p.bases} == {ha: 4.0, hb: 4.0}  # a claim is capped at the group size
    data, h = merge.average(p, {ha: a, hb: b}, 1)
    again, h2 = merge.average(p, {hb: b, ha: a}, 1)
    assert data == again and h == h2  # the same bytes whatever the order things arrived in
    xa, xb = (checkpoint.decode(d)[0]["outer"] for d in (a, b))
    got = checkpoint.decode(data)[0]["outer"]
    assert np.array_equal(got, (xa.astype(np.float64) * 0.5 + xb.astype(np.float64) * 0.5).astype(np.float32))
    assert merge.params_hash(got) == h and checkpoint.decode(data)[1]["outer_step"] == 1
    # the genesis (weight 0) is adopted over, not averaged in
    p0 = merge.plan({"new": (hb, 0), "old": (ha, 3)}, 4)
    assert np.array_equal(checkpoint.decode(merge.average(p0, {ha: a, hb: b}, 1)[0])[0]["outer"], xa)
    bad, hbad = state(3, bad=True)
    with pytest.raises(merge.MergeError) as err:
        merge.average(merge.plan({"x": (ha, 1), "y": (hbad, 1)}, 4), {ha: a, hbad: bad}, 1)
    assert err.value.base == hbad
    with pytest.raises(merge.MergeError):  # a state of another step
        merge.average(merge.plan({"x": (ha, 1), "y": (hb, 1)}, 4), {ha: a, hb: state(2, step=7)[0]}, 1)


class Bases:
    """A member's BaseSource: its own state, and the others' from a shared table (the
    checkpoint download, hash-checked by `merge.average`)."""

    def __init__(self, mine: bytes, table: dict[str, bytes]) -> None:
        self.mine, self.table, self.fetched = mine, table, []

    async def own(self) -> bytes:
        return self.mine

    async def fetch(self, t, base, holders, timeout):
        self.fetched.append(base)
        await trio.sleep(0.5)
        return self.table[base]


def _merge_round(states: list[tuple[bytes, str]], weights: list[int]):
    hub = Hub()
    rounds = [member(hub, i + 1)[0] for i in range(len(states))]
    table = {h: d for d, h in states}
    for r, (d, _) in zip(rounds, states):
        r.bases = Bases(d, table)
    ds = deltas(len(rounds))
    outs = run_rounds(rounds, ds, bases=[h for _, h in states], weights=weights)
    return rounds, outs, ds


def test_members_on_two_lineages_commit_one_merged_state_and_pay_only_for_what_differs():
    a, b = state(1), state(2)
    rounds, outs, ds = _merge_round([a, a, b], [2, 2, 1])
    assert all(o.result is not None and o.merged is not None for o in outs)
    assert len({o.merged[1] for o in outs}) == 1 and len({o.result.tobytes() for o in outs}) == 1
    assert outs[0].parents == tuple(sorted((a[1], b[1])))
    assert np.allclose(outs[0].result, np.mean(ds, axis=0), atol=1e-6)
    # only the member on the other lineage fetched, and it fetched one state each
    assert [r.bases.fetched for r in rounds] == [[b[1]], [b[1]], [a[1]]]
    want = merge.average(merge.plan({"x": (a[1], 4), "y": (b[1], 1)}, 4), {a[1]: a[0], b[1]: b[0]}, 1)
    assert outs[0].merged == want


def test_a_base_that_is_not_what_its_holder_confirmed_aborts_the_merge_for_everyone():
    a = state(1)
    bad = state(2, bad=True)
    rounds, outs, _ = _merge_round([a, a, a, bad], [1, 1, 1, 1])
    # commit or abort: the liar's state never reaches anyone; the honest three may commit
    # without it (leave-one-out) but never with a merge of its bytes
    for o in outs[:3]:
        assert o.merged is None
    committed = [o for o in outs[:3] if o.result is not None]
    assert len({o.result.tobytes() for o in committed}) <= 1
    assert all(rounds[3].me not in o.members for o in committed)


class Unserved(Bases):
    """As `Lineage.fetch` for a holder that left: no provider record ever names the state,
    so the fetch waits out its timeout."""

    async def fetch(self, t, base, holders, timeout):
        await trio.sleep(timeout)
        raise TimeoutError(f"no provider of {base[:12]}")


def test_a_base_whose_holder_crashed_after_confirming_is_dropped_at_once():
    """c confirms the roster with another base, then crashes: nobody can fetch its state.
    The members find its dial refused and go on without it at the next attempt (G2), in
    seconds. Before: each attempt waited out the merge timeout for a holder that had left
    (a data-less joiner's run stalled past 180 s in a full-suite run)."""
    a, b = state(1), state(2)
    hub = Hub()
    r1, r2, c = (member(hub, i + 1)[0] for i in range(3))
    group = election.ring_order(RUN, 1, [r1.me, r2.me, c.me])
    rh = election.roster_hash(RUN, 1, 0, group)
    for r in (r1, r2):
        hub.box[("1/0/roster", c.me, r.me)] = rosters.Confirm(rh, b[1], ring.frame_tag(r.ring_cfg), tuple(group)).encode()
        r.bases = Unserved(a[0], {})  # c's state is nowhere to fetch
    hub.refused.add(c.me)
    ds, outs, took = deltas(2), [None, None], [0.0, 0.0]

    async def main():
        async def one(i, r):
            t0 = trio.current_time()
            outs[i] = await r.run(1, ds[i], group, a[1], 100, 4)
            took[i] = trio.current_time() - t0

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for i, r in enumerate((r1, r2)):
                    nursery.start_soon(one, i, r)

    run_autojump_with_threads(main)
    for o in outs:
        assert o.result is not None and o.merged is None and c.me not in o.members, o
    assert np.array_equal(outs[0].result, outs[1].result)
    assert max(took) < 15.0, took  # not a merge timeout (60 s) per attempt


class SlowBases(Bases):
    """A fetch that takes what a ~5 MB state takes at the bulk floor rate (1 Mbit/s)."""

    async def fetch(self, t, base, holders, timeout):
        self.fetched.append(base)
        await trio.sleep(40.0)
        return self.table[base]


def test_a_merge_whose_fetch_takes_its_bytes_at_the_floor_rate_commits():
    """Rule M1's fetch budget (`roundparts.merge_budget`) grows with the state, as the data
    plane's does. The trainer gave every merge six exchange timeouts (30 s) whatever the
    model: a fetch that takes 40 s (5 MB at the 1 Mbit/s floor; 400 MB at 80 Mbit/s) failed
    the merge for every member, attempt after attempt, so at real model sizes lineages never
    merged. With the budget of a 5 MB state (48 s), it commits."""
    from p2ptrain.reduce.service_config import AllReduceConfig
    from p2ptrain.run.roundparts import merge_budget

    cfg = AllReduceConfig()
    assert merge_budget(cfg, 5.0, 4096) == 30.0  # small states (the simulator's): as before
    assert merge_budget(cfg, 5.0, 400 << 20) > 3300  # a 100M-parameter state at the floor
    a, b = state(1), state(2)
    for timeout, merges in ((merge_budget(cfg, 5.0, 5 << 20), True), (30.0, False)):
        hub = Hub()
        rounds = [member(hub, i)[0] for i in (1, 2, 3)]
        table = {a[1]: a[0], b[1]: b[0]}
        for r, (d, _) in zip(rounds, [a, a, b]):
            r.bases, r.merge_timeout = SlowBases(d, table), timeout
        outs = run_rounds(rounds, deltas(3), bases=[a[1], a[1], b[1]], weights=[1, 1, 1])
        merged = [o.merged is not None and o.result is not None for o in outs]
        assert merged == [merges] * 3, (timeout, merged)
