"""DiLoCo outer step: definition, equivalence with torch SGD, bit-exact determinism."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from p2ptrain.train.model import ModelConfig, build_model
from p2ptrain.train.outer import (OuterConfig, OuterOptimizer, flatten, lr_lambda, make_inner_optimizer,
                            unflatten_into)

MICRO = ModelConfig(d_model=32, n_layers=2, n_heads=2, ffn_hidden=96, max_seq_len=32)


def _perturb(model, seed, scale=1e-2):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def test_flatten_roundtrip():
    model = build_model(MICRO, 0)
    params = list(model.parameters())
    flat = flatten(params)
    assert flat.dtype == torch.float32 and flat.numel() == sum(p.numel() for p in params)
    assert torch.equal(flat, torch.nn.utils.parameters_to_vector(params))
    unflatten_into(flat * 2, params)
    assert torch.equal(flatten(params), flat * 2)
    with pytest.raises(ValueError):
        unflatten_into(flat[:-1], params)


def test_pseudo_gradient_is_outer_minus_local():
    model = build_model(MICRO, 0)
    outer = OuterOptimizer(model)
    start = flatten(model.parameters())
    assert torch.count_nonzero(outer.pseudo_gradient()) == 0
    _perturb(model, 1)
    delta = outer.pseudo_gradient()
    assert torch.equal(delta, start - flatten(model.parameters()))
    # a failed round keeps the local progress: the next pseudo-gradient covers both rounds
    outer.skip()
    _perturb(model, 2)
    assert torch.equal(outer.pseudo_gradient(), start - flatten(model.parameters()))
    assert outer.skipped == 1 and outer.steps == 0


def _numpy_reference(p0, grads, lr, m):
    """The update rule with every operation separately rounded in float32."""
    f = np.float32
    p, buf = p0.copy(), np.zeros_like(p0)
    for g in grads:
        buf = buf * f(m) + g
        d = g + buf * f(m)
        p = p - d * f(lr)
    return p


def test_outer_step_matches_torch_sgd_nesterov():
    model = build_model(MICRO, 0)
    outer = OuterOptimizer(model, OuterConfig(lr=0.7, momentum=0.9, nesterov=True))
    p0 = outer.outer.clone()
    ref = p0.clone().requires_grad_(True)
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    gen = torch.Generator().manual_seed(3)
    grads = []
    for _ in range(4):
        g = torch.randn(outer.numel, generator=gen) * 1e-2
        grads.append(g.numpy().copy())
        outer.step(g)
        ref.grad = g.clone()
        sgd.step()
        # torch's SGD uses fused multiply-adds: equal up to rounding in the last bit
        assert torch.allclose(outer.outer, ref.detach(), rtol=2e-7, atol=1e-7)
    # ...and bit-exact with the separately rounded formula (what makes peers portable)
    assert np.array_equal(outer.outer.numpy(), _numpy_reference(p0.numpy(), grads, 0.7, 0.9))
    # the model now holds the outer parameters
    assert torch.equal(flatten(model.parameters()), outer.outer)


def test_plain_momentum_and_averaging_configs():
    model = build_model(MICRO, 0)
    outer = OuterOptimizer(model, OuterConfig(lr=1.0, momentum=0.0, nesterov=False))
    start = outer.outer.clone()
    _perturb(model, 4)
    local = flatten(model.parameters())
    outer.step(outer.pseudo_gradient())  # lr 1, no momentum: adopt the (single) local model
    assert torch.allclose(outer.outer, local, atol=1e-7) and not torch.equal(outer.outer, start)
    plain = OuterOptimizer(build_model(MICRO, 0), OuterConfig(lr=1.0, momentum=0.0))  # nesterov is moot
    plain.step(torch.ones(plain.numel))
    assert torch.equal(plain.outer, start - 1)
    with pytest.raises(ValueError):
        OuterConfig(lr=-1)
    with pytest.raises(ValueError, match="inf or NaN"):
        outer.step(torch.full((outer.numel,), float("nan")))


def test_two_peers_stay_bit_identical():
    a_model, b_model = build_model(MICRO, 0), build_model(MICRO, 0)
    a, b = OuterOptimizer(a_model), OuterOptimizer(b_model)
    assert a.params_sha256() == b.params_sha256()
    for r in range(5):
        # each peer trains differently; both apply the same averaged pseudo-gradient
        _perturb(a_model, 10 + r)
        _perturb(b_model, 20 + r)
        avg = (a.pseudo_gradient() + b.pseudo_gradient()) / 2
        a.step(avg.clone())
        b.step(avg.clone())
        assert a.params_sha256() == b.params_sha256()
        assert torch.equal(flatten(a_model.parameters()), flatten(b_model.parameters()))
    assert a.steps == 5


def test_state_dict_roundtrip_is_bit_exact():
    model = build_model(MICRO, 0)
    outer = OuterOptimizer(model)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        outer.step(torch.randn(outer.numel, generator=gen) * 1e-2)
    state = copy.deepcopy(outer.state_dict())
    g = torch.randn(outer.numel, generator=gen) * 1e-2
    outer.step(g)
    expected = outer.params_sha256()

    fresh_model = build_model(MICRO, 99)  # a newcomer with other parameters
    fresh = OuterOptimizer(fresh_model)
    fresh.load_state_dict(state)
    assert fresh.steps == 3 and torch.equal(flatten(fresh_model.parameters()), state["outer"])
    fresh.step(g)
    assert fresh.params_sha256() == expected
    small = OuterOptimizer(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="another model"):
        small.load_state_dict(state)


def test_inner_optimizer_schedules():
    model = build_model(MICRO, 0)
    opt, sched = make_inner_optimizer(model, 1e-3, 0.1, warmup=10, total_steps=100)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(p.ndim < 2 for p in opt.param_groups[1]["params"])
    cos = lr_lambda(10, 100, "cosine", min_ratio=0.1)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(100) == pytest.approx(0.1) and cos(55) == pytest.approx(0.55)
    wsd = lr_lambda(10, 100, "wsd", min_ratio=0.0, decay_fraction=0.2)
    assert wsd(50) == 1.0 and wsd(82) == 1.0 and wsd(100) == 0.0 and 0 < wsd(91) < 1
    with pytest.raises(ValueError):
        lr_lambda(10, 100, "linear")
    for _ in range(5):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(6e-4)


def test_seek_schedule_matches_stepping_there_and_a_late_starter_gets_the_runs_lr():
    """A peer that adopts state t trains at the run's lr for t, not from its own warmup."""
    from p2ptrain.train.outer import make_inner_optimizer, seek_schedule

    model = torch.nn.Linear(4, 4)
    stepped = make_inner_optimizer(model, 1e-3, 0.1, 10, 200)
    for _ in range(137):
        stepped[0].step()
        stepped[1].step()
    late = make_inner_optimizer(model, 1e-3, 0.1, 10, 200)
    assert late[0].param_groups[0]["lr"] != stepped[0].param_groups[0]["lr"]
    seek_schedule(late[1], 137)
    assert [g["lr"] for g in late[0].param_groups] == [g["lr"] for g in stepped[0].param_groups]
    late[0].step()
    late[1].step()  # and it goes on from there like the other
    stepped[0].step()
    stepped[1].step()
    assert late[1].get_last_lr() == stepped[1].get_last_lr()
