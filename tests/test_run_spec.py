"""RunSpec (p2ptrain.run.spec): one schema for `init` and the library API, the same run ids
as before it existed; run keys; what a status client imports."""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys

import pytest

from p2ptrain.cli import init as init_cli
from p2ptrain.dht.record import NAMESPACE
from p2ptrain.identity import Identity
from p2ptrain.records import codecs as records, keys
from p2ptrain.run import manifest as mf
from p2ptrain.run.spec import RunSpec, SpecError, TrainSpec

# What `p2ptrain init --name t --inner-steps 6 --aggregation robust` wrote before RunSpec
# existed (its build_manifest, `created` fixed): the schema, byte for byte.
TODAY = {
    "created": 1700000000, "name": "t", "version": 1,
    "data": {"content_hash": "d" * 64, "spec": "stdlib"},
    "genesis": {"bytes": 1234, "sha256": "e" * 64},
    "model": {"d_model": 128, "ffn_hidden": 352, "max_seq_len": 128, "n_heads": 4, "n_layers": 4,
              "norm_eps": 1e-05, "rope_theta": 10000.0, "vocab_size": 256},
    "timeouts": {"exchange": 5.0, "join_window": 30.0},
    "train": {"aggregation": "robust", "allreduce": "int8", "batch_size": 8, "group_size": 4, "inner_lr": 0.002,
              "inner_steps": 6, "outer_lr": 0.7, "outer_momentum": 0.9, "planned_outer_steps": 10,
              "schedule": "cosine", "seed": 0, "seq_len": 128, "warmup": 20, "weight_decay": 0.1},
}
TODAY_ID = mf.run_id(TODAY)


def init_args(*argv: str):
    p = argparse.ArgumentParser()
    init_cli.add_parser(p.add_subparsers())
    return p.parse_args(["init", "--out", "x", *argv])


def test_init_builds_todays_schema_exactly_and_keeps_run_ids():
    spec = init_cli.build_spec(init_args("--name", "t", "--inner-steps", "6", "--aggregation", "robust"),
                               "d" * 64, "e" * 64, 1234)
    body = dict(spec.to_dict(), created=1700000000)
    assert mf.canonical(body) == mf.canonical(TODAY) and mf.run_id(body) == TODAY_ID
    assert RunSpec.from_dict(TODAY).to_dict() == TODAY


def test_a_signed_manifest_parses_and_its_signature_is_not_part_of_the_spec():
    signed = mf.sign(TODAY, Identity.from_seed(b"\x05" * 32))
    spec = RunSpec.from_dict(signed)
    assert spec.to_dict() == TODAY and spec.train.aggregation == "robust" and spec.genesis.bytes == 1234


def test_manifests_from_before_the_aggregation_field_mean_mean():
    old = copy.deepcopy(TODAY)
    del old["train"]["aggregation"]
    assert RunSpec.from_dict(old).train.aggregation == "mean"


@pytest.mark.parametrize("section,field,value,msg", [
    ("train", "aggregation", "median", "unknown aggregation 'median'"),
    ("train", "allreduce", "int4", "unknown allreduce"),
    ("train", "group_size", 0, "train.group_size"),
    ("train", "outer_momentum", 1.0, "train.outer_momentum"),
    ("train", "inner_lr", float("nan"), "train.inner_lr"),
    ("train", "surprise", 1, "schema"),
    ("timeouts", "join_window", -1.0, "timeouts.join_window"),
    ("genesis", "sha256", "short", "genesis.sha256"),
])
def test_invalid_fields_are_named(section, field, value, msg):
    bad = copy.deepcopy(TODAY)
    bad[section][field] = value
    with pytest.raises(SpecError, match=msg):
        RunSpec.from_dict(bad)
    assert issubclass(SpecError, mf.ManifestError)  # join reports it like any bad manifest


def test_missing_sections_and_mixed_library_fields_are_refused():
    for name in ("model", "data", "train", "timeouts", "genesis"):
        bad = {k: v for k, v in TODAY.items() if k != name}
        with pytest.raises(SpecError, match=name):
            RunSpec.from_dict(bad)
    lib = copy.deepcopy(TODAY)
    lib["model"] = {"source": "user", "n_params": 10}  # a library model with a CLI inner loop
    with pytest.raises(SpecError, match="library run"):
        RunSpec.from_dict(lib)
    with pytest.raises(SpecError, match="train.inner_lr"):  # half an inner loop
        TrainSpec(inner_steps=1, group_size=1, outer_lr=0.7, outer_momentum=0.9, seed=0)


def test_library_run_id_covers_every_shared_setting_and_the_genesis():
    torch = pytest.importorskip("torch")
    from p2ptrain.api import library_spec
    from p2ptrain.train.outer import OuterConfig, OuterOptimizer

    def spec_of(**kw):
        torch.manual_seed(kw.pop("seed", 0))
        args = {**dict(run="r", inner_steps=5, group_size=4, outer_lr=0.7, outer_momentum=0.9, allreduce="int8",
                       aggregation="mean", join_window=30.0), **kw}
        outer = OuterOptimizer(torch.nn.Linear(4, 3), OuterConfig(args["outer_lr"], args["outer_momentum"]))
        return library_spec(outer, **args)

    base = spec_of()
    assert mf.run_id(base.to_dict()) == mf.run_id(spec_of().to_dict())  # every peer derives the same id
    assert base.genesis.bytes > 0 and len(base.genesis.sha256) == 64
    variants = [dict(inner_steps=6), dict(group_size=2), dict(outer_lr=0.5), dict(outer_momentum=0.8),
                dict(allreduce="fp32"), dict(aggregation="robust"), dict(join_window=10.0), dict(seed=1),
                dict(run="other")]
    ids = {mf.run_id(spec_of(**v).to_dict()) for v in variants}
    assert len(ids) == len(variants) and mf.run_id(base.to_dict()) not in ids


def test_every_run_key_is_under_the_dht_namespace():
    rid = "ab" * 32
    ks = [keys.manifest(rid), keys.ready(rid, 3), keys.state(rid), keys.providers(rid), keys.reputation(rid),
          keys.presence("lobby")]
    assert all(k.startswith(NAMESPACE) for k in ks) and len(set(ks)) == len(ks)
    assert keys.ready(rid, 3) == f"/p2ptrain/{rid}/ready/3" and keys.presence("lobby") == "/p2ptrain/lobby/peers"


def test_state_record_codec_round_trips_and_bounds():
    st = records.State(4, "p" * 64, "c" * 64, 1.234567, float("nan"), tuple(f"/a/{i}" for i in range(30)),
                       {"direct": 2, "bogus": 1})
    got = records.decode_state(records.encode_state(st))
    assert (got.step, got.params, got.ckpt, got.loss, got.val_loss) == (4, "p" * 64, "c" * 64, 1.23457, None)
    assert len(got.addrs) == keys.MAX_ADDRS and got.conns == {"direct": 2}
    for bad in (b"\x00" * (records.MAX_STATE_BYTES + 1), b"\xc1", records.encode_state(st)[:-3],
                __import__("msgpack").packb({"step": -1, "params": "", "ckpt": ""}),
                __import__("msgpack").packb({"step": 1, "params": 5, "ckpt": ""})):
        with pytest.raises(records.RecordError):
            records.decode_state(bad)


def test_status_and_dashboard_decode_records_without_the_trainer(tmp_path):
    code = ("import sys, p2ptrain.cli.status, p2ptrain.records, p2ptrain.run.states, p2ptrain.dashboard.server; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('numba', 'torch') "
            "or m.startswith(('p2ptrain.reduce', 'p2ptrain.train', 'p2ptrain.kernels'))]; print(bad)")
    # cwd: not the checkout, whose p2ptrain/ (without dht/ etc.) would shadow the installed package
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_skipped_step_is_retried_after_two_join_windows():
    """Since rule T7 (every try has its own round ids) a retry no longer waits out every
    kept message of the first try (120 s before): two join windows, at least 30 s."""
    from p2ptrain.run.spec import TimeoutsSpec

    assert TimeoutsSpec().early_ttl == 60.0 and TimeoutsSpec().retry_wait == 60.0  # the defaults
    for join_window in (1.0, 30.0, 45.0, 100.0, 600.0):
        t = TimeoutsSpec(join_window=join_window, exchange=5.0)
        assert join_window < t.early_ttl and t.retry_wait == max(30.0, 2 * join_window)
