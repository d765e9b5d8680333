"""Benchmark of the int8 all-reduce kernels against np.copyto of the same fp32 vector.

For each kernel: median wall time over --repeat interleaved runs after one warm-up, "payload
MB/s" = fp32 bytes of the vector processed per second (MB = 1e6 bytes), and the ratio to
np.copyto's payload MB/s from the same run (the machines are shared and noisy: only same-run
ratios are comparable; the goal is >= 0.7x copy). Usage:

    python -m p2ptrain.bench.kernels [--mb 64] [--repeat 7] [--block 16] [--threads N] [--json]
    p2ptrain bench kernels ...          (the CLI calls add_arguments / run)

Run `python -m` from outside the repository root: there, ./p2ptrain (without the kernels,
which are mapped in from ./kernels at install time) would shadow the installed package.

With --json, one JSON object per kernel and a final {"event": "bench_kernels_summary", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

GOAL_RATIO = 0.7
# Extra row, outside the goal: the owner's result written over its own input (out=local), which
# spares the write-allocate of a separate output.
INPLACE = "owner_hop(out=local)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mb", type=float, default=64.0,
                        help="fp32 vector size in MiB (default 64)")
    parser.add_argument("--repeat", type=int, default=7,
                        help="timed runs per kernel; the median is reported (default 7)")
    parser.add_argument("--block", type=int, default=None,
                        help="sub-block size (default: the kernels' DEFAULT_BLOCK)")
    parser.add_argument("--threads", type=int, default=0,
                        help="numba threads (default 0: numba's default, all cores)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per line instead of a table")


def _median_times(cases, repeat: int) -> dict[str, float]:
    """Median seconds per case. Runs are interleaved (copy, kernel 1, ..., copy, ...) so a
    burst of load from other processes hits every case alike and the ratios stay fair."""
    for _, fn in cases:
        fn()  # warm-up: JIT compile or cache load, page faults of fresh outputs
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _ in range(repeat):
        for name, fn in cases:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(args) -> int:
    from p2ptrain import kernels as K

    block = args.block if args.block is not None else K.DEFAULT_BLOCK
    if args.mb <= 0 or args.repeat < 1 or block < 1 or args.threads < 0:
        print("bench kernels: --mb, --repeat and --block must be positive", file=sys.stderr)
        return 2
    threads = 1
    if K.BACKEND == "numba":
        import numba

        if args.threads:
            if args.threads > numba.config.NUMBA_NUM_THREADS:
                print(f"bench kernels: --threads at most {numba.config.NUMBA_NUM_THREADS}",
                      file=sys.stderr)
                return 2
            numba.set_num_threads(args.threads)
        threads = numba.get_num_threads()
    n = int(args.mb * (1 << 20)) // 4
    rng = np.random.default_rng(1234)
    x = rng.standard_normal(n, dtype=np.float32)
    local = rng.standard_normal(n, dtype=np.float32)
    dst = np.empty_like(x)
    acc = np.zeros_like(x)
    out = np.empty_like(x)
    q, meta = K.quantize(x, block)
    q2, meta2 = np.empty_like(q), np.empty_like(meta)
    local2 = local.copy()  # overwritten in place by the last row; mul 0.5 keeps it bounded

    cases = [
        ("np.copyto", lambda: np.copyto(dst, x)),
        ("quantize", lambda: K.quantize(x, block, q2, meta2)),
        ("dequantize", lambda: K.dequantize(q, meta, block, out)),
        ("dequantize_add", lambda: K.dequantize_add(q, meta, acc, block)),
        ("ring_hop", lambda: K.ring_hop(q, meta, local, block, q2, meta2)),
        ("owner_hop", lambda: K.owner_hop(q, meta, local, 0.25, block, q2, meta2, out)),
        (INPLACE, lambda: K.owner_hop(q, meta, local2, 0.5, block, q2, meta2, local2)),
        # The verified path's norms: every header and every received frame (float64 lanes).
        ("sumsq", lambda: K.sumsq(x)),
        # ... of an int8 frame, from its payload (the ring's checks; no decode).
        ("sumsq_q8", lambda: K.sumsq_q8(q, meta, block)),
    ]
    payload = 4 * n
    load_before = os.getloadavg()[0]
    medians = _median_times(cases, args.repeat)
    rows = [{"event": "bench_kernels", "kernel": name, "seconds": t,
             "payload_mb_s": payload / t / 1e6, "in_goal": name not in ("np.copyto", INPLACE)}
            for name, t in medians.items()]
    copy_rate = rows[0]["payload_mb_s"]
    for r in rows:
        r["ratio_vs_copy"] = r["payload_mb_s"] / copy_rate
    kernel_rows = [r for r in rows if r["in_goal"]]
    worst = min(kernel_rows, key=lambda r: r["ratio_vs_copy"])
    summary = {
        "event": "bench_kernels_summary", "backend": K.BACKEND, "n": n, "mib": payload / (1 << 20),
        "block": block, "wire_bytes": K.quantized_nbytes(n, block), "repeat": args.repeat,
        "threads": threads,
        "cpus": os.cpu_count(), "loadavg_1min": [load_before, os.getloadavg()[0]],
        "copy_payload_mb_s": copy_rate,
        "hop_ratio_vs_copy": next(r["ratio_vs_copy"] for r in rows if r["kernel"] == "ring_hop"),
        "worst_kernel": worst["kernel"], "worst_ratio_vs_copy": worst["ratio_vs_copy"],
        "goal_ratio": GOAL_RATIO, "goal_met": worst["ratio_vs_copy"] >= GOAL_RATIO,
    }
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps(summary))
    else:
        print(f"int8 kernels, backend={K.BACKEND}, {summary['mib']:.0f} MiB fp32 "
              f"(n={n}), block={block}, threads={summary['threads']}, "
              f"median of {args.repeat} interleaved runs, 1-min load average "
              f"{summary['loadavg_1min'][0]:.2f} -> {summary['loadavg_1min'][1]:.2f}")
        print(f"{'kernel':<22}{'ms':>9}{'payload MB/s':>15}{'x copy':>9}")
        for r in rows:
            print(f"{r['kernel']:<22}{r['seconds'] * 1e3:>9.2f}{r['payload_mb_s']:>15,.0f}"
                  f"{r['ratio_vs_copy']:>9.2f}")
        print(f"wire bytes: {summary['wire_bytes']:,} ({summary['wire_bytes'] / n:.4f} per value);"
              f" worst kernel {worst['kernel']} at {worst['ratio_vs_copy']:.2f}x copy "
              f"(goal >= {GOAL_RATIO}x: {'met' if summary['goal_met'] else 'NOT met'})")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.bench.kernels",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
