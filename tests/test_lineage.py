"""The event arithmetic `bench scale` and tests/test_one_model.py judge runs by
(p2ptrain.bench.lineage), on hand-written event lines: a fork must read as a fork."""

from __future__ import annotations

from p2ptrain.bench import lineage
from p2ptrain.bench.scale import ScaleSettings, summarize


def started(peer, step, joining=False):
    return {"event": "outer_step_started", "peer": peer, "step": step, "joining": joining}


def committed(peer, step, h, val=3.0, members=("a", "b")):
    return {"event": "outer_step_committed", "peer": peer, "step": step, "params_sha256": h, "val_loss": val,
            "members": list(members)}


def joined(peer):
    return {"event": "run_joined", "peer": peer, "step": 0}


def test_one_lineage_needs_every_peer_on_one_hash_at_one_step():
    evs = [committed("a", 1, "x"), committed("b", 1, "y"), committed("a", 2, "z"),
           {"event": "caught_up", "peer": "b", "step": 2, "params_sha256": "z"}]
    st = lineage.states(evs)
    assert lineage.one_lineage_step(st, ["a", "b"], 1, 1) is None  # forked at 1
    assert lineage.one_lineage_step(st, ["a", "b"], 1, 3) == 2  # b adopted a's state at 2
    assert lineage.one_lineage_step(st, ["a", "b", "c"], 1, 3) is None  # c never reported
    assert lineage.lineages_at_newest_shared(evs) == (1, 2, 2)  # catch-ups are not commits


def test_commit_fraction_counts_retries_once_ignores_joining_and_the_cut_step():
    evs = [joined("a"), joined("b"), started("a", 0), started("a", 1), started("a", 1), started("a", 2),
           committed("a", 1, "x"), committed("a", 2, "y"), started("b", 0, joining=True), started("b", 1)]
    assert lineage.commit_fraction(evs) == {"a": (3, 2), "b": (1, 0)}
    assert lineage.commit_fraction(evs, cut={"a": 2, "b": 1}) == {"a": (2, 2), "b": (0, 0)}


def test_summary_goals_fail_on_a_lost_step_and_on_a_loss_spread():
    s = ScaleSettings(peers=2, group_size=2, steps=2)
    evs = [joined("a"), joined("b")]
    for p in "ab":
        evs += [started(p, 0), started(p, 1), committed(p, 1, "x"), committed(p, 2, "y", val=3.0)]
    out = summarize(evs, {}, s, 1.0)
    assert out["goals"] == {"commit_fraction_ge_0.9": True, "val_loss_spread_le_1pct": True}
    assert (out["lineages"], out["lineage_step"], out["val_loss_spread_pct"]) == (1, 2, 0.0)
    evs[-1] = committed("b", 2, "z", val=3.1)  # b forked at its last step, 3.3 % worse
    evs.append(started("b", 2))  # and lost a step
    out = summarize(evs, {}, s, 1.0)
    assert out["lineages"] == 2 and out["val_loss_spread_pct"] > 3
    assert out["commit_fraction_min"] == round(2 / 3, 4)
    assert out["goals"] == {"commit_fraction_ge_0.9": False, "val_loss_spread_le_1pct": False}
    # a peer that joined and never trained scores 0, not "no data"
    assert summarize(evs + [joined("c")], {}, ScaleSettings(peers=3, group_size=2, steps=2), 1.0)[
        "commit_fraction_min"] == 0.0
