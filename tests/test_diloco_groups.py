"""Merge rounds (docs/PROTOCOL.md, rule M1) in `bench diloco --groups-of`'s simulation: its
merge is the product's (`p2ptrain.run.merge`), checked against a float64 reference and
`OuterOptimizer.step`, and one group of N is `bench diloco`'s synchronous DiLoCo bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2ptrain.bench.diloco_groups import OuterState, merge_round
from p2ptrain.train.outer import OuterConfig, OuterOptimizer, flatten

LR, MU = 0.7, 0.9


def _state(seed: int, weight: int, n: int = 257) -> OuterState:
    g = torch.Generator().manual_seed(seed)
    return OuterState(torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1, weight)


def _grad(seed: int = 99, n: int = 257) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.01


def test_one_base_is_the_plain_outer_step_bit_for_bit():
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    opt = OuterOptimizer(model, OuterConfig(LR, MU, True))
    s = OuterState(opt.outer.clone(), opt.momentum.clone(), 3)
    for t in range(3):  # several steps, so the momentum is non-zero from the second one on
        g = _grad(t, opt.numel)
        s = merge_round([s, s, s], g, trained=3, lr=LR, mu=MU)
        opt.step(g)
        assert torch.equal(s.params, opt.outer) and torch.equal(s.momentum, opt.momentum)
        assert torch.equal(flatten(model.parameters()), s.params)
    assert s.weight == 3


def test_each_members_base_counts_its_weight_and_every_member_gets_the_same_bytes():
    a, b = _state(1, 2), _state(2, 2)
    g = _grad()
    # a held by three members, b by one, equal weights: 3/4 and 1/4 (each member's state once,
    # as gossip averaging does: the mean over peers is kept)
    out = merge_round([a, b, a, a], g, trained=4, lr=LR, mu=MU, group_size=4)
    x = 0.75 * a.params.double() + 0.25 * b.params.double()
    m = 0.75 * a.momentum.double() + 0.25 * b.momentum.double()
    m2 = MU * m + g.double()
    x2 = x - LR * (MU * m2 + g.double())
    np.testing.assert_allclose(out.params.numpy(), x2.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(out.momentum.numpy(), m2.numpy(), rtol=0, atol=1e-5)
    assert out.weight == 4
    again = merge_round([b, a, a, a], g, trained=4, lr=LR, mu=MU, group_size=4)
    assert torch.equal(again.params, out.params) and torch.equal(again.momentum, out.momentum)


def test_a_genesis_base_is_adopted_over_and_all_zero_weights_average_equally():
    a, b = _state(1, 0), _state(2, 0)
    out = merge_round([a, b], torch.zeros(257), trained=0, lr=LR, mu=0.0)
    np.testing.assert_allclose(out.params.numpy(), ((a.params.double() + b.params.double()) / 2).numpy(),
                               rtol=0, atol=1e-6)
    c = _state(3, 2)
    out = merge_round([a, c], torch.zeros(257), trained=0, lr=LR, mu=0.0)
    assert torch.equal(out.params, c.params)
    with pytest.raises(ValueError, match="inf or NaN"):
        merge_round([a], torch.full((257,), float("nan")), 1, LR, MU)


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
