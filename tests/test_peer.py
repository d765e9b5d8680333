"""The composition root (p2ptrain.peer): every kind of peer gets its parts from one place.

Before it, the library built its own all-reduce service from the run's `allreduce` and had no
compressor defaults: `DiLoCo(allreduce="sparse")` failed (spec validation, then "mode must be
'int8' or 'fp32'" at start), while `p2ptrain init --allreduce sparse` + `join` worked."""

from __future__ import annotations

import pytest
import torch

from p2ptrain import peer
from p2ptrain.api import library_spec
from p2ptrain.reduce.service import AllReduceService
from p2ptrain.run.spec import SPARSE_DEFAULTS
from p2ptrain.train.outer import OuterConfig, OuterOptimizer


def spec_for(allreduce: str):
    torch.manual_seed(0)
    outer = OuterOptimizer(torch.nn.Linear(8, 4), OuterConfig())
    return library_spec(outer, run="lib", inner_steps=5, group_size=2, outer_lr=0.7, outer_momentum=0.9,
                        allreduce=allreduce, aggregation="mean", join_window=5.0)


@pytest.mark.parametrize("allreduce, ring", [("int8", "int8"), ("fp32", "fp32"), ("sparse", "int8")])
def test_a_library_run_gets_the_service_a_cli_run_gets(allreduce, ring):
    spec = spec_for(allreduce)
    cfg = peer.service_config(spec)
    assert cfg.mode == ring  # sparse rounds use the service for exchanges only
    assert cfg.commit_timeout == 2 * spec.timeouts.exchange and cfg.early_ttl == spec.timeouts.early_ttl
    if allreduce == "sparse":
        sc = spec.train.sparse_config()  # the compressor the sparse collective is built from
        assert (sc.topk_fraction, sc.bits, sc.chunk, sc.ef_decay) == tuple(SPARSE_DEFAULTS.values())


def test_run_peer_refuses_a_model_side_that_lacks_the_interface():
    class Half:
        H = 5
        n_params = 3

    from p2ptrain.train import modelside

    with pytest.raises(TypeError, match="lacks"):
        modelside.check(Half())


def test_the_default_parts_are_the_products():
    parts = peer.Parts()
    assert parts.service is AllReduceService and parts.writer is peer.make_writer and parts.local is None


def test_a_phase_left_under_rule_e17_stops_at_its_next_inner_step_and_leaves_the_committed_state(tmp_path):
    """Rule E17 on the real model side: the progress callback's `PhaseLeft` ends the phase
    after the inner step it follows (the trainer's watcher sets it); the committed state is
    untouched, and reloading it (`Lineage.watched_phase` when no head could be adopted)
    discards the phase's partial work."""
    from p2ptrain.cli.main import main
    from p2ptrain.run import manifest as mf
    from p2ptrain.run.spec import RunSpec
    from p2ptrain.train.local import LocalModel, load_run_data
    from p2ptrain.train.modelside import PhaseLeft

    assert main(["init", "--out", str(tmp_path / "run"), "--key", str(tmp_path / "k"), "--inner-steps", "6"]) == 0
    spec = RunSpec.from_dict(mf.read(tmp_path / "run" / "run.toml")[0])
    local = LocalModel(spec, load_run_data(spec), b"peer-1", (tmp_path / "run" / "genesis.p2ck").read_bytes())
    committed, steps = local.outer.params_sha256(), []

    def progress(i: int, n: int) -> None:
        steps.append(i)
        if i == 2:
            raise PhaseLeft

    with pytest.raises(PhaseLeft):
        local.inner(progress)
    assert steps == [1, 2] and local.pseudo_gradient().any()
    assert local.outer.params_sha256() == committed
    local.load_state_at(local.state_bytes())
    assert not local.pseudo_gradient().any() and local.outer.params_sha256() == committed and local.step == 0
