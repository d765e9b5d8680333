"""Hugging Face models, a trained BPE tokenizer and jsonl data, end to end in real processes on
127.0.0.1: `init --model hf: --tokenizer --data jsonl:`, two peers commit identical outer
steps, and a joiner given only `--run ID` (no data files, no tokenizer) fetches the tokenizer
and the token shards from the peers, hash-checks them against the manifest and commits."""

from __future__ import annotations

from pathlib import Path

import pytest

import hf_fixtures
from conftest import start_bootstrap
from p2ptrain.identity import load_or_create
from p2ptrain.procs import run as run_cli

pytestmark = pytest.mark.integration
# 32 KiB chunks: the token stream (~100 KB) is several chunks, so the joiner's fetch is a
# real multi-chunk, multi-donor download.
ENV = {"P2PTRAIN_SERVE_CHUNK_KIB": "32"}


def init_run(d: Path, *extra: str) -> str:
    hf_fixtures.write_llama(d / "model")
    hf_fixtures.train_bpe(d / "tok" / "tokenizer.json")
    hf_fixtures.write_jsonl(d / "data")
    out = run_cli(
        ["init", "--out", "run", "--key", "initiator.key", "--model", "hf:model",
         "--tokenizer", "tok/tokenizer.json", "--data", "jsonl:data/*.jsonl", "--inner-steps", "16",
         "--batch-size", "4", "--seq-len", "64", "--warmup", "2", "--planned-outer-steps", "6",
         "--join-window", "10", "--group-size", "4", "--seed", "7", *extra],
        timeout=300, cwd=d, env={**ENV, "P2PTRAIN_CACHE": str(d / "cache0"),
                                                                  **_base_env()})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def _base_env() -> dict:
    import os

    return dict(os.environ)


def join(procs, baddr: str, name: str, which: list[str], steps: int, min_peers: int, device: str = "cpu"):
    key = procs.log_dir / f"{name}.key"
    load_or_create(key)
    # each peer its own token cache: a shared one would hide a missing fetch
    env = {**ENV, "P2PTRAIN_CACHE": str(procs.log_dir / f"cache-{name}")}
    return procs.start(["join", "--bootstrap", baddr, "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(key),
                        "--workdir", str(procs.log_dir / name), *which, "--max-outer-steps", str(steps),
                        "--min-peers", str(min_peers), "--threads", "1", "--device", device, "--json"], name, env=env)


def committed(peer, step: int, timeout: float = 180) -> dict:
    for ev in list(peer.all_events):
        if ev["event"] == "outer_step_committed" and ev["step"] == step:
            return ev
    return peer.wait_event(lambda e: e["event"] == "outer_step_committed" and e["step"] == step, timeout)


@pytest.mark.xfail(strict=False, reason=(
    "issue 31: since the coordination redesign a merge round fetched a base from a peer that had "
    "gone and the run stalled past 180 s in 1 of 3 full-suite runs. G2 for merges drops a crashed "
    "holder at once since; passed in the full suites since 2026-11-30, and (2026-12-07) failed only "
    "while the checkout's kernels/ shadowed Hugging Face's kernels package (fixed: "
    "p2ptrain.checkout_off_sys_path); kept non-strict until more full-suite runs show it holds"))
def test_hf_llama_bpe_jsonl_two_peers_then_a_data_less_joiner(procs):
    d = procs.log_dir  # the processes' cwd: the manifest's relative data spec resolves here
    rid = init_run(d)
    boot, baddr = start_bootstrap(procs)
    p0 = join(procs, baddr, "p0", ["--manifest", str(d / "run" / "run.toml")], 400, 2)
    p1 = join(procs, baddr, "p1", ["--run", rid], 400, 2)  # has the files, but not the tokenizer
    for step in (1, 2):
        evs = [committed(p, step) for p in (p0, p1)]
        assert evs[0]["params_sha256"] == evs[1]["params_sha256"], evs
        assert sorted(evs[0]["members"]) == sorted(evs[1]["members"]) and len(evs[0]["members"]) == 2
    assert all(e["val_loss"] == e["val_loss"] for e in evs)  # finite
    # p1 had no tokenizer.json: it came from p0 by hash (p1 tokenized the local files with it)
    assert not any(e["event"] == "data_fetched" for e in p1.all_events)

    (d / "data").rename(d / "data-gone")  # the joiner's machine holds no data files
    joiner = join(procs, baddr, "p2", ["--run", rid], 1, 1)
    fetched = joiner.wait_event(lambda e: e["event"] == "data_fetched", 120)
    assert fetched["chunks"] >= 2 and not fetched["excluded"], fetched
    first = joiner.wait_event(lambda e: e["event"] == "outer_step_committed", 180)
    want = committed(p0, first["step"])
    assert first["params_sha256"] == want["params_sha256"], (first, want)
    assert (d / "p2" / "data").is_dir()  # kept for a restart without the network


def test_a_cuda_peer_and_a_cpu_peer_commit_identical_params(procs):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine (torch.cuda.is_available() is False)")
    d = procs.log_dir
    rid = init_run(d)
    boot, baddr = start_bootstrap(procs)
    gpu = join(procs, baddr, "gpu", ["--manifest", str(d / "run" / "run.toml")], 2, 2, device="cuda")
    cpu = join(procs, baddr, "cpu", ["--run", rid], 2, 2, device="cpu")
    for step in (1, 2):
        evs = [committed(p, step) for p in (gpu, cpu)]
        assert evs[0]["params_sha256"] == evs[1]["params_sha256"] and len(evs[0]["members"]) == 2, evs


@pytest.mark.parametrize("extra", [[], ["--fragments", "2"]], ids=["whole", "streaming"])
def test_an_overlapped_cuda_peer_and_cpu_peer_commit_identical_params(procs, extra):
    """The overlapped loop on a GPU (issue 17): the phase worker lands committed states and
    the hand-over's eager start onto CUDA params between inner steps (an in-place add of a
    host offset, `device.scatter_from_host(add=True)`), and the committed params must stay
    the same bytes as a CPU member's; also with streaming steps (one fragment a step)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine (torch.cuda.is_available() is False)")
    d = procs.log_dir
    rid = init_run(d, "--overlap", "eager", *extra)
    boot, baddr = start_bootstrap(procs)
    gpu = join(procs, baddr, "gpu", ["--manifest", str(d / "run" / "run.toml")], 4, 2, device="cuda")
    cpu = join(procs, baddr, "cpu", ["--run", rid], 4, 2, device="cpu")
    for step in (1, 2, 3):
        evs = [committed(p, step) for p in (gpu, cpu)]
        assert evs[0]["params_sha256"] == evs[1]["params_sha256"] and len(evs[0]["members"]) == 2, evs
    phases = [e for e in gpu.all_events if e["event"] == "inner_phase" and e.get("phase", 0) >= 2]
    assert phases, "the GPU peer ran no overlapped phase"
