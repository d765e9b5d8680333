"""Throughput and memory of a peer's inner loop against a plain torch training loop.

Same model (a Hugging Face Llama built from a config: ~25M and ~125M parameters by default, or
--model hf:PATH), same batch, same precision, same AdamW hyperparameters and gradient
clipping, same device, measured in the same run. The peer side is `LocalModel.inner()`
exactly as `p2ptrain join` runs it (seeded window sampling from the token stream, the batch
copy to the device, autocast, one loss sync per H steps); the plain loop feeds batches
made beforehand on the device and never syncs. Goals: tokens/s ratio >= 0.97x, peak memory
ratio <= 1.1x.

Speed: both loops in one child process, H steps of one then H steps of the other, --rounds
times (the order alternating), medians compared: load from other processes on these shared
machines then hits both alike. Memory: each loop alone in a fresh child process (so one's
allocations cannot hide in the other's): on a GPU, torch.cuda.max_memory_allocated over the
timed steps; on the CPU, the peak resident set size sampled every 2 ms over the timed steps
(after gc and malloc_trim, so set-up transients do not count). The peer's outer state
(fp32 master copy, momentum and the pseudo-gradient staging vector: 3 x 4 bytes per
parameter, host memory) is reported separately, and the CPU ratio is given with and without
it. Usage:

    p2ptrain bench throughput [--sizes 25m,125m] [--steps 4] [--batch 4] [--seq-len 128]
                              [--rounds 3] [--device auto] [--precision auto] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

SIZES = {
    # hidden, layers, heads, ffn, vocab (untied head): ~25.4M and ~123M parameters
    "25m": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=1408, vocab_size=12288),
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=2048,
                 vocab_size=24576),
}
GOAL_SPEED, GOAL_MEMORY = 0.97, 1.1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="25m,125m", help="comma-separated of " + ", ".join(SIZES))
    p.add_argument("--model", default="", metavar="hf:PATH", help="a local HF config instead of --sizes")
    p.add_argument("--steps", type=int, default=4, help="timed inner steps per run (H)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of H steps per loop (median kept)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", choices=["speed", "plain", "peer"], help=argparse.SUPPRESS)
    p.add_argument("--section", help=argparse.SUPPRESS)


def model_section(size: str, model: str, seq_len: int) -> dict:
    from p2ptrain.train import hf

    if model:
        return hf.model_section(model.partition(":")[2])[0]
    cfg = {"model_type": "llama", "num_key_value_heads": SIZES[size]["num_attention_heads"],
           "max_position_embeddings": max(seq_len, 128), "tie_word_embeddings": False, **SIZES[size]}
    text = hf.canonical_json(cfg)
    import hashlib

    return {"kind": "hf", "config_json": text, "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "vocab_size": cfg["vocab_size"], "max_seq_len": cfg["max_position_embeddings"], "weights_sha256": ""}


class PeakRSS:
    """Peak resident set size (bytes) sampled from /proc/self/statm while running."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self):
        self.peak = self._rss()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())


def _trim() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed set-up memory to the OS
    except OSError:
        pass


def _setup(args, variant: str):
    """(step function running H timed steps, params, outer-state bytes, device, autocast dtype)."""
    import numpy as np
    import torch

    from p2ptrain.train import device as dev
    from p2ptrain.train.data import Dataset, _hash

    section = json.loads(args.section)
    device = dev.resolve_device(args.device)
    amp = dev.resolve_precision(args.precision, device)
    H, B, T = args.steps, args.batch, args.seq_len
    tr = {"seed": 0, "inner_steps": H, "inner_lr": 3e-4, "warmup": 1, "weight_decay": 0.1, "batch_size": B,
          "seq_len": T, "schedule": "cosine", "planned_outer_steps": 100, "outer_lr": 0.7, "outer_momentum": 0.9}
    if variant == "peer":
        from p2ptrain.train.data import train_batch
        from p2ptrain.train.local import LocalModel, genesis_state

        from p2ptrain.run.spec import RunSpec

        manifest = RunSpec.from_dict({"version": 1, "name": "bench", "created": 0, "model": section,
                                      "data": {"spec": "bench", "content_hash": ""},
                                      "train": {**tr, "group_size": 1},
                                      "timeouts": {}, "genesis": {"sha256": "", "bytes": 0}})
        tokens = np.random.default_rng(0).integers(0, section["vocab_size"], 1 << 20).astype(np.uint16)
        ds = Dataset("bench", tokens[:-4096], tokens[-4096:], _hash("bench", tokens[:-4096], tokens[-4096:]), 1, 0)
        local = LocalModel(manifest, ds, b"bench-peer", genesis_state(manifest), args.threads, args.device,
                           args.precision)
        for i in range(args.warmup):
            local.inner_step(dev.to_device(train_batch(ds, b"w", i, B, T, 0), local.device), [])
        local.pseudo_gradient()  # its staging vector is resident from the first outer step on
        outer_bytes = sum(t.numel() * t.element_size()
                          for t in (local.outer.outer, local.outer.momentum, local.outer._staging))
        return (lambda: local.inner()), local.n_params, outer_bytes, device, amp
    from p2ptrain.train.hf import build_run_model

    model = build_run_model(section, 0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, section["vocab_size"], (B, T + 1), generator=g).to(device) for _ in range(H)]

    def train(bs) -> None:
        for b in bs:
            with dev.autocast(device, amp):
                loss = model.loss(b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

    train(batches[:args.warmup])
    return (lambda: train(batches)), sum(p.numel() for p in model.parameters()), 0, device, amp


def _timed(fn, device) -> float:
    import torch

    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def worker(args) -> dict:
    """`speed`: both loops in this process, H steps of each in turn for --rounds rounds (so
    load from other processes hits both alike); `plain`/`peer`: one loop's peak memory."""
    import statistics

    import torch

    from p2ptrain.train import device as dev

    torch.set_num_threads(args.threads)
    if args.worker == "speed":
        loops = {v: _setup(args, v) for v in ("plain", "peer")}
        times: dict[str, list[float]] = {"plain": [], "peer": []}
        for r in range(args.rounds):
            for v in (("plain", "peer") if r % 2 == 0 else ("peer", "plain")):
                times[v].append(_timed(loops[v][0], loops[v][3]))
        tokens = args.steps * args.batch * args.seq_len
        med = {v: statistics.median(ts) for v, ts in times.items()}
        return {"plain_tokens_per_s": tokens / med["plain"], "peer_tokens_per_s": tokens / med["peer"],
                "params": loops["peer"][1], "device": str(loops["peer"][3]),
                "precision": dev.precision_name(loops["peer"][4]),
                "seconds": {v: [round(t, 3) for t in ts] for v, ts in times.items()}}
    step, params, outer_bytes, device, amp = _setup(args, args.worker)
    _trim()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    with PeakRSS() as rss:
        _timed(step, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss.peak
    return {"variant": args.worker, "peak_bytes": peak, "outer_state_bytes": outer_bytes,
            "memory": "cuda_max_allocated" if device.type == "cuda" else "peak_rss"}


def _child(args, variant: str, section: dict) -> dict:
    cmd = [sys.executable, "-m", "p2ptrain.bench.throughput", "--worker", variant, "--section", json.dumps(section),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--device", args.device, "--precision", args.precision,
           "--threads", str(args.threads), "--rounds", str(args.rounds)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} worker failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args, label: str, section: dict) -> dict:
    speed = _child(args, "speed", section)
    mem = {v: _child(args, v, section) for v in ("plain", "peer")}
    outer = mem["peer"]["outer_state_bytes"]
    plain_b, peer_b = mem["plain"]["peak_bytes"], mem["peer"]["peak_bytes"]
    on_host = mem["plain"]["memory"] == "peak_rss"
    return {"event": "bench_throughput", "model": label, "params": speed["params"], "device": speed["device"],
            "precision": speed["precision"], "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps,
            "rounds": args.rounds, "plain_tokens_per_s": round(speed["plain_tokens_per_s"], 1),
            "peer_tokens_per_s": round(speed["peer_tokens_per_s"], 1),
            "speed_ratio": round(speed["peer_tokens_per_s"] / speed["plain_tokens_per_s"], 3),
            "memory": mem["plain"]["memory"], "plain_peak_mb": round(plain_b / 1e6, 1),
            "peer_peak_mb": round(peer_b / 1e6, 1), "outer_state_mb": round(outer / 1e6, 1),
            "memory_ratio": round(peer_b / plain_b, 3),
            # on the host the peer's RSS includes its outer state: also without it (counted separately)
            "memory_ratio_without_outer": round((peer_b - (outer if on_host else 0)) / plain_b, 3),
            "round_seconds": speed["seconds"]}


def run(args) -> int:
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    plan = [(args.model, model_section("", args.model, args.seq_len))] if args.model else \
        [(s, model_section(s, "", args.seq_len)) for s in args.sizes.split(",")]
    for label, section in plan:
        r = compare(args, label, section)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        print(f"{label}: {r['params'] / 1e6:.1f}M params on {r['device']} ({r['precision']}), batch {args.batch}x"
              f"{args.seq_len}, {args.steps} steps: peer {r['peer_tokens_per_s']:.0f} tok/s vs plain "
              f"{r['plain_tokens_per_s']:.0f} tok/s = {r['speed_ratio']:.3f}x (goal >= {GOAL_SPEED}); "
              f"peak {r['memory']} peer {r['peer_peak_mb']:.0f} MB vs plain {r['plain_peak_mb']:.0f} MB = "
              f"{r['memory_ratio']:.3f}x, {r['memory_ratio_without_outer']:.3f}x without the "
              f"{r['outer_state_mb']:.0f} MB host outer state (goal <= {GOAL_MEMORY})", flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
