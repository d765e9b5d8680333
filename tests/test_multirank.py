"""A node is a machine (issue 19): a 2-rank torchrun peer (FSDP2 over gloo) and a
single-process peer train one run on 127.0.0.1 and commit identical parameters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import start_bootstrap
from p2ptrain.identity import load_or_create

pytestmark = pytest.mark.integration
STEPS = 2


def init_run(d: Path) -> tuple[Path, str]:
    out = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "init", "--out", str(d / "run"), "--key", str(d / "initiator.key"),
         "--preset", "tiny", "--inner-steps", "3", "--batch-size", "4", "--seq-len", "32", "--warmup", "2",
         "--planned-outer-steps", "4", "--join-window", "15", "--group-size", "4", "--seed", "5"],
        capture_output=True, text=True, timeout=300, cwd=d)
    assert out.returncode == 0, out.stderr
    return d / "run", out.stdout.strip().splitlines()[-1]


def torchrun_args(nproc: int) -> list[str]:
    # c10d rendezvous on an OS-chosen port of 127.0.0.1: no fixed port to collide on
    return ["--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
            "-m", "p2ptrain"]


def join_args(baddr: str, key: Path, work: Path, which: list[str]) -> list[str]:
    return ["join", "--bootstrap", baddr, "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(key),
            "--workdir", str(work), *which, "--max-outer-steps", str(STEPS), "--min-peers", "2",
            "--threads", "1", "--device", "cpu", "--json"]


def test_two_rank_peer_and_single_peer_commit_identical_params(procs, tmp_path):
    run_path, rid = init_run(tmp_path)
    keys = [tmp_path / "single.key", tmp_path / "node.key"]
    for k in keys:
        load_or_create(k)
    boot, baddr = start_bootstrap(procs)
    single = procs.start(join_args(baddr, keys[0], tmp_path / "w0", ["--manifest", str(run_path / "run.toml")]),
                         "single")
    node = procs.start(torchrun_args(2) + join_args(baddr, keys[1], tmp_path / "w1", ["--run-id", rid]), "node",
                       env={"P2PTRAIN_RANKS_VERIFY": "1"}, module="torch.distributed.run")
    for step in range(1, STEPS + 1):
        evs = [p.wait_event(lambda e: e["event"] == "outer_step_committed" and e["step"] == step, 120)
               for p in (single, node)]
        assert evs[0]["params_sha256"] == evs[1]["params_sha256"], evs
        assert len(evs[0]["members"]) == 2 and sorted(evs[0]["members"]) == sorted(evs[1]["members"]), evs
        assert evs[1]["loss"] is not None or step == 1
    assert node.proc.wait(60) == 0, node.stderr_tail()
    err = node.stderr_text()
    # every committed step reached both ranks' shards (checked by hash on rank 0, P2PTRAIN_RANKS_VERIFY)
    assert err.count("shards verified: 2 ranks") >= STEPS + 1, err[-3000:]
    # rank 0 speaks for the node: one peer id in the events, and only JSON from rank 0 on stdout
    peers = {e["peer"] for e in node.all_events if "peer" in e}
    assert len(peers) == 1, peers


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for a 2-rank NCCL node "
                    "(this machine has %d)" % torch.cuda.device_count())
def test_two_rank_peer_on_cuda_nccl(procs, tmp_path):
    run_path, rid = init_run(tmp_path)
    keys = [tmp_path / "single.key", tmp_path / "node.key"]
    for k in keys:
        load_or_create(k)
    boot, baddr = start_bootstrap(procs)
    single_args = join_args(baddr, keys[0], tmp_path / "w0", ["--manifest", str(run_path / "run.toml")])
    single = procs.start([a if a != "cpu" else "cuda:0" for a in single_args], "single")
    node_args = join_args(baddr, keys[1], tmp_path / "w1", ["--run-id", rid])
    node = procs.start(torchrun_args(2) + [a if a != "cpu" else "cuda" for a in node_args], "node",
                       env={"P2PTRAIN_RANKS_VERIFY": "1"}, module="torch.distributed.run")
    for step in range(1, STEPS + 1):
        evs = [p.wait_event(lambda e: e["event"] == "outer_step_committed" and e["step"] == step, 180)
               for p in (single, node)]
        assert evs[0]["params_sha256"] == evs[1]["params_sha256"], evs
