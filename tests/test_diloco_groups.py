"""Merge rounds (docs/PROTOCOL.md Part 3, rule M1): the arithmetic of `p2ptrain.train.merge`
against a float64 reference and `OuterOptimizer.step`, and `bench diloco --groups-of`'s
simulation against `bench diloco`'s synchronous DiLoCo."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2ptrain.train.merge import OuterState, base_weights, distinct_bases, merge_round
from p2ptrain.train.outer import OuterConfig, OuterOptimizer, flatten

LR, MU = 0.7, 0.9


def _state(seed: int, work: float, n: int = 257) -> OuterState:
    g = torch.Generator().manual_seed(seed)
    return OuterState(torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1, work)


def _grad(seed: int = 99, n: int = 257) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.01


def test_one_base_is_the_plain_outer_step_bit_for_bit():
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    opt = OuterOptimizer(model, OuterConfig(LR, MU, True))
    s = OuterState(opt.outer.clone(), opt.momentum.clone(), 3.0)
    for t in range(3):  # several steps, so the momentum is non-zero from the second one on
        g = _grad(t, opt.numel)
        s = merge_round([s, s, s], g, trained=3, lr=LR, mu=MU)
        opt.step(g)
        assert torch.equal(s.params, opt.outer) and torch.equal(s.momentum, opt.momentum)
        assert torch.equal(flatten(model.parameters()), s.params)
    assert s.work == 3.0 + 3 * 3
    heavy = OuterOptimizer(model, OuterConfig(LR, MU, False))
    g = _grad(7, heavy.numel)
    h = merge_round([OuterState(heavy.outer.clone(), heavy.momentum.clone())], g, 1, LR, MU, nesterov=False)
    heavy.step(g)
    assert torch.equal(h.params, heavy.outer)


def test_distinct_bases_are_weighted_by_work_once_each():
    a, b = _state(1, 3.0), _state(2, 1.0)
    g = _grad()
    # a listed by three members, b by one: each base still gets its work's weight, not a per-member one
    out = merge_round([a, b, a, a], g, trained=4, lr=LR, mu=MU)
    x = 0.75 * a.params.double() + 0.25 * b.params.double()
    m = 0.75 * a.momentum.double() + 0.25 * b.momentum.double()
    m2 = MU * m + g.double()
    x2 = x - LR * (MU * m2 + g.double())
    np.testing.assert_allclose(out.params.numpy(), x2.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(out.momentum.numpy(), m2.numpy(), rtol=0, atol=1e-5)
    assert out.work == 3.0 + 4  # the max of the parents' work, never the sum
    # every member gets the same bytes, whatever order the members are listed in
    again = merge_round([b, a, a, a], g, trained=4, lr=LR, mu=MU)
    assert torch.equal(again.params, out.params) and torch.equal(again.momentum, out.momentum)
    assert len(distinct_bases([a, b, a, a])) == 2


def test_zero_work_weighs_bases_equally():
    assert base_weights([0.0, 0.0, 0.0]) == [1 / 3] * 3
    assert base_weights([2.0, 0.0, 6.0]) == [0.25, 0.0, 0.75]
    a, b = _state(1, 0.0), _state(2, 0.0)
    out = merge_round([a, b], torch.zeros(257), trained=0, lr=LR, mu=0.0)
    np.testing.assert_allclose(out.params.numpy(), ((a.params.double() + b.params.double()) / 2).numpy(),
                               rtol=0, atol=1e-6)
    assert out.work == 0.0  # joiners' zeros add no work
    # a zero-work base beside a worked one moves nothing: weight 0
    c = _state(3, 5.0)
    out = merge_round([a, c], torch.zeros(257), trained=0, lr=LR, mu=0.0)
    assert torch.equal(out.params, c.params)


def test_mismatched_duplicates_and_bad_gradients_are_refused():
    a = _state(1, 2.0)
    with pytest.raises(ValueError, match="differ"):
        merge_round([a, OuterState(a.params.clone(), a.momentum.clone(), 1.0)], _grad(), 2, LR, MU)
    with pytest.raises(ValueError, match="inf or NaN"):
        merge_round([a], torch.full((257,), float("nan")), 1, LR, MU)
    with pytest.raises(ValueError, match="values"):
        merge_round([a], torch.zeros(3), 1, LR, MU)


def test_groups_are_redrawn_and_one_group_is_bench_diloco_bit_for_bit():
    from p2ptrain.bench.diloco import Settings, _peer, run_config
    from p2ptrain.bench.diloco_groups import deal_groups, simulate

    ids = [_peer(w) for w in range(10)]
    g0, g1 = deal_groups(0, 0, ids, 4), deal_groups(0, 1, ids, 4)
    assert [len(g) for g in g0] == [4, 4, 2] and sorted(sum(g0, [])) == list(range(10)) and g0 != g1
    assert deal_groups(0, 0, ids, 4) == g0 != deal_groups(1, 0, ids, 4)
    torch.set_num_threads(1)
    st = Settings(steps=6, batch=2, seq_len=16, warmup=2, warm_start=0, eval_batches=1, eval_batch=4,
                  workers=4, model=dict(d_model=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=16))
    ref = run_config(st, "diloco", 2, "fp32", 0, None)
    one = simulate(st, 4, 2, 0, None)
    assert one["final_sha256"] == [ref["outer_sha256"]] and one["val_loss"] == ref["val_loss"]
    pairs = simulate(st, 2, 2, 0, None)
    assert [r["distinct"] for r in pairs["steps"]] == [2, 2, 2] and pairs["distinct_final"] == 2
    assert pairs["val_loss_min"] <= pairs["val_loss"] <= pairs["val_loss_max"]
