"""Throughput and memory of a peer's inner loop against a plain torch training loop.

Same model (a Hugging Face Llama built from a config: ~25M and ~125M parameters by default, or
--model hf:PATH), same batch, same precision, same AdamW hyperparameters and gradient
clipping, same device, measured in the same run. The peer side is `LocalModel.inner()`
exactly as `p2ptrain join` runs it (seeded window sampling from the token stream, the batch
copy to the device, autocast, one loss sync per H steps); the plain loop feeds batches
made beforehand on the device and never syncs. Goals: tokens/s ratio >= 0.97x, peak memory
ratio <= 1.1x.

Each (variant, repeat) runs in a fresh child process (so one's allocations cannot hide in
the other's), alternating plain/peer so load from other processes hits both alike; the best
tokens/s of each variant is compared. Memory: on a GPU, torch.cuda.max_memory_allocated over
the timed steps; on the CPU, the peak resident set size sampled every 2 ms over the timed
steps (after gc and malloc_trim, so set-up transients do not count). The peer's outer state
(fp32 master copy, momentum and the pseudo-gradient staging vector: 3 x 4 bytes per
parameter, host memory) is reported separately, and the CPU ratio is given with and without
it. Usage:

    p2ptrain bench throughput [--sizes 25m,125m] [--steps 4] [--batch 4] [--seq-len 128]
                              [--device auto] [--precision auto] [--threads 2] [--json]
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
    p.add_argument("--repeats", type=int, default=2, help="runs per variant (best tokens/s kept)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", choices=["plain", "peer"], help=argparse.SUPPRESS)
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


def worker(args) -> dict:
    import numpy as np
    import torch

    from p2ptrain.train import device as dev
    from p2ptrain.train.data import Dataset, _hash

    torch.set_num_threads(args.threads)
    section = json.loads(args.section)
    device = dev.resolve_device(args.device)
    amp = dev.resolve_precision(args.precision, device)
    H, B, T = args.steps, args.batch, args.seq_len
    tr = {"seed": 0, "inner_steps": H, "inner_lr": 3e-4, "warmup": 1, "weight_decay": 0.1, "batch_size": B,
          "seq_len": T, "schedule": "cosine", "planned_outer_steps": 100, "outer_lr": 0.7, "outer_momentum": 0.9}
    outer_bytes = 0
    if args.worker == "peer":
        from p2ptrain.train.data import train_batch
        from p2ptrain.train.local import LocalModel, genesis_state

        manifest = {"model": section, "train": tr}
        tokens = np.random.default_rng(0).integers(0, section["vocab_size"], 1 << 20).astype(np.uint16)
        ds = Dataset("bench", tokens[:-4096], tokens[-4096:], _hash("bench", tokens[:-4096], tokens[-4096:]), 1, 0)
        local = LocalModel(manifest, ds, b"bench-peer", genesis_state(manifest), args.threads, args.device,
                           args.precision)
        for i in range(args.warmup):
            local.inner_step(dev.to_device(train_batch(ds, b"w", i, B, T, 0), local.device), [])
        local.pseudo_gradient()  # its staging vector is resident from the first outer step on
        outer_bytes = sum(t.numel() * t.element_size()
                          for t in (local.outer.outer, local.outer.momentum, local.outer._staging))
        step = lambda: local.inner()  # noqa: E731
        params = local.n_params
    else:
        from p2ptrain.train.hf import build_run_model

        model = build_run_model(section, 0).to(device)
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, section["vocab_size"], (B, T + 1), generator=g).to(device)
                   for _ in range(H + args.warmup)]

        def train(bs) -> None:
            for b in bs:
                with dev.autocast(device, amp):
                    loss = model.loss(b)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()

        train(batches[:args.warmup])
        step = lambda: train(batches[args.warmup:])  # noqa: E731
    _trim()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss.peak
    return {"variant": args.worker, "tokens_per_s": H * B * T / sec, "seconds": sec, "peak_bytes": peak,
            "memory": "cuda_max_allocated" if device.type == "cuda" else "peak_rss", "outer_state_bytes": outer_bytes,
            "params": params, "device": str(device), "precision": dev.precision_name(amp)}


def _child(args, variant: str, section: dict) -> dict:
    cmd = [sys.executable, "-m", "p2ptrain.bench.throughput", "--worker", variant, "--section", json.dumps(section),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--device", args.device, "--precision", args.precision,
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} worker failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args, label: str, section: dict) -> dict:
    runs: dict[str, list[dict]] = {"plain": [], "peer": []}
    for _ in range(args.repeats):
        for variant in ("plain", "peer"):
            runs[variant].append(_child(args, variant, section))
    best = {v: max(rs, key=lambda r: r["tokens_per_s"]) for v, rs in runs.items()}
    mem = {v: min(r["peak_bytes"] for r in rs) for v, rs in runs.items()}
    plain, peer = best["plain"], best["peer"]
    outer = peer["outer_state_bytes"]
    on_host = plain["memory"] == "peak_rss"
    return {"event": "bench_throughput", "model": label, "params": peer["params"], "device": peer["device"],
            "precision": peer["precision"], "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps,
            "plain_tokens_per_s": round(plain["tokens_per_s"], 1), "peer_tokens_per_s": round(peer["tokens_per_s"], 1),
            "speed_ratio": round(peer["tokens_per_s"] / plain["tokens_per_s"], 3),
            "memory": plain["memory"], "plain_peak_mb": round(mem["plain"] / 1e6, 1),
            "peer_peak_mb": round(mem["peer"] / 1e6, 1), "outer_state_mb": round(outer / 1e6, 1),
            "memory_ratio": round(mem["peer"] / mem["plain"], 3),
            # on the host the peer's RSS includes its outer state: also without it (counted separately)
            "memory_ratio_without_outer": round((mem["peer"] - (outer if on_host else 0)) / mem["plain"], 3),
            "tokens_per_s_runs": {v: [round(r["tokens_per_s"], 1) for r in rs] for v, rs in runs.items()}}


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
