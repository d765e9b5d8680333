"""Streaming outer steps (issue 17, `train.fragments`): the fragments of the parameter vector,
the outer step on one fragment, the manifest field, and the overlapped loop's start points
per fragment. The end-to-end run is tests/test_overlap_integration.py."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from p2ptrain.train import fragments
from p2ptrain.train import overlap_math as om
from p2ptrain.train.fragments import Fragments
from p2ptrain.train.outer import OuterConfig, OuterOptimizer
from p2ptrain.procs import run as run_cli


@pytest.mark.parametrize("n,P,block", [(12, 2, 4), (13, 2, 4), (13, 4, 4), (4096 * 7 + 5, 3, 4096), (10, 1, 4),
                                       (9, 3, 3), (8, 2, 4)])
def test_fragments_partition_the_vector_in_strided_blocks(n, P, block):
    idx = [fragments.index(n, P, f, block) for f in range(P)]
    assert np.array_equal(np.sort(np.concatenate(idx)), np.arange(n))
    assert [fragments.size(n, P, f, block) for f in range(P)] == [len(i) for i in idx]
    for f, i in enumerate(idx):
        assert ((i // block) % P == f).all()
    fr = Fragments(n, P, block)
    assert [fr.size(t) for t in range(P)] == [len(i) for i in idx] and fr.size(P) == len(idx[0])
    vec = np.arange(n, dtype=np.float32)
    assert np.array_equal(fr.part(vec, 1), vec if P == 1 else vec[idx[1 % P]])
    assert (fr.part(vec, 1) is vec) == (P == 1)


def test_fragments_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        Fragments(100, 2, block=4096)
    with pytest.raises(ValueError):
        fragments.index(100, 2, 2, 4)
    assert Fragments(100).at(7) is None and Fragments(100).size(3) == 100  # P = 1: the whole vector


def test_a_fragment_outer_step_is_the_full_steps_arithmetic_on_its_values_only():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)  # 28 values: 7 blocks of 4, fragment 1 of 3 holds blocks 1 and 4
    n = sum(p.numel() for p in model.parameters())
    fr = Fragments(n, 3, block=4)
    idx = torch.from_numpy(fragments.index(n, 3, 1, block=4).copy())
    other = torch.from_numpy(np.setdiff1d(np.arange(n), idx.numpy()))
    for momentum, nesterov in ((0.9, True), (0.8, False), (0.0, True)):
        full, part = (OuterOptimizer(model, OuterConfig(0.7, momentum, nesterov)) for _ in range(2))
        for _ in range(3):  # momentum carries across steps
            g = torch.randn(n)
            before_x, before_m = part.outer.clone(), part.momentum.clone()
            full.step(g, load_model=False)
            part.step(g[idx], load_model=False, frags=fr, t=4)  # step 4: fragment 1
            assert torch.equal(part.outer[idx], full.outer[idx]) and torch.equal(part.momentum[idx], full.momentum[idx])
            assert torch.equal(part.outer[other], before_x[other]) and torch.equal(part.momentum[other], before_m[other])
            full.outer[other], full.momentum[other] = before_x[other], before_m[other]  # stay in step
        with pytest.raises(ValueError, match="fragment"):
            part.step(torch.zeros(n), frags=fr, t=1)


@pytest.mark.parametrize("n,P,block", [(28, 3, 4), (30, 3, 4), (30, 4, 4), (16, 2, 4)])
def test_part_and_put_match_the_index_definition(n, P, block):
    """The strided views (`part`, `put`) against the plain definition (`index`), numpy and torch."""
    fr = Fragments(n, P, block)
    for t in range(P):
        idx = fragments.index(n, P, t, block)
        for vec in (np.arange(n, dtype=np.float32), torch.arange(n, dtype=torch.float32)):
            got = fr.part(vec, t)
            assert np.array_equal(np.asarray(got), np.asarray(vec)[idx]) and len(got) == fr.size(t)
            got[...] = -1  # a copy: the vector is untouched
            assert (np.asarray(vec) >= 0).all()
            fr.put(vec, t, -np.asarray(vec)[idx] if isinstance(vec, np.ndarray) else -vec[torch.from_numpy(idx.copy())])
            arr = np.asarray(vec)
            assert (arr[idx] <= 0).all() and (np.delete(arr, idx) >= 0).all()


def _train(**kw):
    from p2ptrain.run.spec import TrainSpec

    base = dict(inner_steps=6, group_size=4, outer_lr=0.7, outer_momentum=0.9, seed=0, inner_lr=1e-3, warmup=1,
                weight_decay=0.1, batch_size=2, seq_len=8, schedule="cosine", planned_outer_steps=3)
    return TrainSpec(**{**base, **kw})


def test_manifest_fragments_field_validated_and_in_the_run_id():
    from p2ptrain.run.manifest import run_id
    from p2ptrain.run.spec import SpecError

    eager = _train(overlap="eager")
    assert "fragments" not in eager.to_dict() and eager.n_fragments == 1  # older run ids unchanged
    st = replace(eager, fragments=3)
    assert st.to_dict()["fragments"] == 3 and st.n_fragments == 3
    assert run_id({"train": st.to_dict()}) != run_id({"train": eager.to_dict()})
    for bad, why in ((dict(fragments=2), "overlap"), (dict(overlap="eager", fragments=4), "multiple"),
                     (dict(overlap="eager", fragments=1), "fragments"), (dict(overlap="eager", fragments=2.0), "fragments"),
                     (dict(overlap="eager", fragments=2, allreduce="sparse", topk_fraction=0.03, bits=2, chunk=4096,
                           ef_decay=0.8), "fragments"),
                     (dict(overlap="eager", fragments=2, aggregation="robust"), "fragments")):
        with pytest.raises(SpecError, match=why):
            _train(**bad)


def test_init_streaming_defaults_and_a_model_too_small_for_its_fragments(tmp_path):
    import argparse

    from p2ptrain.cli import init

    p = argparse.ArgumentParser()
    init.add_parser(p.add_subparsers())
    tr = init.build_spec(p.parse_args(["init", "--out", "x", "--overlap", "eager", "--fragments", "2",
                                       "--inner-steps", "50"]), "0" * 64).train
    # streaming rounds land H / P late: DiLoCo's own outer step measured best (BENCHMARKS.md)
    assert (tr.fragments, tr.outer_lr, tr.outer_momentum, tr.max_inner_steps) == (2, 0.7, 0.9, 100)
    out = run_cli(["init", "--out", str(tmp_path / "run"), "--key",
                   str(tmp_path / "k"), "--overlap", "eager", "--inner-steps", "1024", "--fragments", "1024"],
                  timeout=300, cwd=tmp_path)
    assert out.returncode != 0 and "do not fit" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "run" / "run.toml").exists()


class _Local:
    def __init__(self, n: int, P: int) -> None:
        self.model = torch.nn.Module()
        self.model.w = torch.nn.Parameter(torch.zeros(n))
        self.outer = OuterOptimizer(self.model, OuterConfig(0.7, 0.9))
        self.frags = Fragments(n, P, block=4)


def _loop(local, scheme="eager"):
    from p2ptrain.train.overlap import OverlappedLoop

    tr = SimpleNamespace(local=local, spec=SimpleNamespace(train=SimpleNamespace(overlap_scheme=scheme)),
                         config=SimpleNamespace(phase_nice=0))
    return OverlappedLoop(tr)


@pytest.mark.parametrize("scheme", ["eager", "delayed"])
def test_hand_over_restarts_only_the_steps_fragment_and_lands_a_late_commit(scheme):
    """Phase `no` ended at `end`; round no-1 (the other fragment) committed after the phase's
    last step, so its state did not land in it. The next phase keeps every start point but
    fragment f(no)'s, which restarts (eager: the Nesterov step with our delta), and the
    late commit lands on its own fragment; the other values keep their progress exactly."""
    from p2ptrain.train.phases import Phase

    torch.manual_seed(1)
    n, P, no = 12, 2, 3
    local = _local = _Local(n, P)
    loop = _loop(local, scheme)
    x0 = torch.randn(n)
    local.outer.outer.copy_(x0)
    local.outer.momentum.copy_(torch.randn(n) * 0.1)
    f_now, f_prev = [torch.from_numpy(fragments.index(n, P, f, 4).copy()) for f in (no % P, (no - 1) % P)]
    phase = Phase(x0.clone(), awaits_round=True)
    end = x0 + torch.randn(n)  # the phase's progress
    committed = x0.clone()
    committed[f_prev] += 0.5  # round no-1 committed, posted after the phase's last step
    local.outer.outer.copy_(committed)
    nxt = loop._successor(phase, end, no)
    assert not nxt.exact and torch.equal(nxt.start[f_now], end[f_now]) and torch.equal(nxt.start[f_prev], x0[f_prev])
    delta = torch.from_numpy(loop._turn(phase, end, nxt, no))
    assert torch.equal(delta, x0 - end)  # the contribution: the phase's own progress (full length)
    params = [_local.model.w]
    with torch.no_grad():
        params[0].copy_(end + 0.25)  # nxt trained one step meanwhile
    nxt.land(params, 1)
    want_f = (om.phase_start("eager", committed[f_now], local.outer.momentum[f_now], end[f_now], delta[f_now], 0.7,
                             0.9) if scheme == "eager" else end[f_now])
    assert torch.equal(nxt.start[f_now], want_f) and torch.equal(nxt.start[f_prev], committed[f_prev])
    got = params[0].detach()
    assert torch.allclose(got[f_prev], end[f_prev] + 0.25 + 0.5)  # the late commit, progress kept
    assert torch.allclose(got[f_now], want_f + 0.25)


def test_whole_vector_hand_over_is_unchanged_by_the_fragment_machinery():
    """P = 1: the successor starts at `end` and may copy at step 0, as before streaming."""
    from p2ptrain.train.phases import Phase

    local = _Local(8, 1)
    loop = _loop(local)
    end = torch.randn(8)
    nxt = loop._successor(Phase(torch.zeros(8)), end, 5)
    assert nxt.exact and nxt.start is end
