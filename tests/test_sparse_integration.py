"""Issue 18 end to end: a bootstrap and 3 real trainer processes on 127.0.0.1 train a run
initialised with `--allreduce sparse`: identical params after every step, loss falls, and the
bytes each peer's sparse collective sent and received (counted on the exchange path) are
reported next to the computed payload size."""

from __future__ import annotations


import pytest

from conftest import start_bootstrap
from p2ptrain.kernels import quantized_nbytes
from p2ptrain.reduce.sparse import wire_nbytes
from p2ptrain.reduce.sparsecodec import SparseConfig
from test_training_integration import committed, start_trainers
from p2ptrain.procs import run as run_cli

pytestmark = pytest.mark.integration
STEPS = 3


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sparse-run")
    out = run_cli(
        ["init", "--out", str(d / "run"), "--key", str(d / "initiator.key"),
         "--inner-steps", "6", "--batch-size", "4", "--seq-len", "64", "--warmup", "5",
         "--planned-outer-steps", "6", "--join-window", "20", "--group-size", "4", "--seed", "3",
         "--allreduce", "sparse", "--topk-fraction", "0.02"],
        timeout=300, cwd=d)
    assert out.returncode == 0, out.stderr
    text = (d / "run" / "run.toml").read_text()
    assert 'allreduce = "sparse"' in text and "topk_fraction = 0.02" in text and "ef_decay = 0.8" in text
    return d / "run", out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    from p2ptrain.identity import load_or_create

    d = tmp_path_factory.mktemp("sparse-keys")
    paths = [d / f"peer{i}.key" for i in range(3)]
    for p in paths:
        load_or_create(p)
    return paths


def test_three_peers_sparse_run_identical_params_loss_falls_bytes_counted(procs, sparse_run, keys, report):
    boot, baddr = start_bootstrap(procs)
    peers = start_trainers(procs, baddr, sparse_run, keys, 3, STEPS)
    n = peers[0].wait_event(lambda e: e["event"] == "run_joined", 120)["params"]
    steps = [[committed(p, s) for p in peers] for s in range(1, STEPS + 1)]
    computed = wire_nbytes(n, SparseConfig(topk_fraction=0.02), 3)
    for evs in steps:
        assert len({e["params_sha256"] for e in evs}) == 1, evs
        assert all(len(e["members"]) == 3 for e in evs), evs
    val = [evs[0]["val_loss"] for evs in steps]
    assert val[-1] < val[0], val
    for evs in steps:
        for e in evs:
            # counted: header + payload fragments + commit vote to each of the 2 others
            payload = e["payload_bytes"]
            assert 2 * payload < e["bytes_sent"] < 2 * payload * 1.15, e
            assert e["bytes_recv"] == e["bytes_sent"], e  # same sizes both ways when all arrived
            # and what the bench computes for the same messages, to within a few bytes of varint sizes
            assert abs(e["bytes_sent"] - 2 * computed) <= 64, (e["bytes_sent"], computed)
    e = steps[-1][0]
    ring_int8 = round(2 * 2 / 3 * quantized_nbytes(n))  # what the int8 ring sends per member
    report(f"sparse run, {n} params, 3 peers: sent {e['bytes_sent']} B / recv {e['bytes_recv']} B per peer "
           f"per outer step (counted; computed {2 * computed} B), payload {e['payload_bytes']} B (computed), int8 ring would send "
           f"{ring_int8} B ({ring_int8 / e['bytes_sent']:.0f}x more); val loss {val}")
    for p in peers:
        assert not [x for x in p.all_events if x["event"] == "contribution_rejected"]
