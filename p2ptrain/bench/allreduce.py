"""`p2ptrain bench allreduce`: our ring over libp2p vs hivemind and the raw-socket ceiling.

All in one run, each peer its own process on 127.0.0.1:
  - p2ptrain int8 and fp32: `allreduce_worker` processes (real libp2p nodes; bulk bytes on
    the direct AES-GCM path, and optionally the libp2p-stream fallback with --fallback).
    The main row is the path training uses ("verified": signed contribution headers
    exchanged and checked, every frame held to them by FrameChecker, `bench.signed_round`;
    its round time includes building, exchanging and checking the headers); the unverified
    data plane alone is the second row;
  - the ceiling: a plain ring over raw AES-GCM sockets (`p2ptrain.bench.raw_ring`);
  - hivemind's DecentralizedAverager, no compression and fp16 (its 8-bit codecs are broken
    under NumPy 2), in its own processes (`p2ptrain.bench.hivemind_allreduce`).
MiB/s = fp32 tensor MiB / round seconds, median of ROUNDS after a warm-up. Our rounds start at a
barrier (one CLOCK_MONOTONIC instant for every member, as the ceiling's multiprocessing
barrier) and end when the last member has committed, votes included.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from p2ptrain.reduce import roundtrace


def add_arguments(p) -> None:
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--mb", type=int, default=64, help="fp32 tensor size in MiB")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up)")
    p.add_argument("--fallback", action="store_true", help="also measure the libp2p-stream fallback path")
    p.add_argument("--no-baselines", action="store_true", help="skip hivemind and the raw ring")
    p.add_argument("--lab-mbit", type=float, action="append", default=None, metavar="MBIT",
                   help="run the peers in the emulated internet (p2ptrain.bench.inetlab) on links of this rate, "
                        "against the bandwidth bound; repeatable (e.g. --lab-mbit 100 --lab-mbit 1000)")
    p.add_argument("--lab-fp32", action="store_true", help="with --lab-mbit: also a verified fp32 row")
    p.add_argument("--trace", action="store_true",
                   help="each row also gets every member's timeline (ms after the start, median over rounds: "
                        "first frame sent, each step's last frame in, headers, data plane done, votes; "
                        "p2ptrain.reduce.roundtrace)")
    p.add_argument("--json", action="store_true")


def measure_ours(peers: int, mb: int, rounds: int, mode: str, direct: bool, work: Path,
                 verified: bool = False, lab=None, trace: bool = False) -> dict:
    """`lab`: an `inetlab.InternetLab` with >= `peers` peers; member i then runs in its
    namespace on its shaped link, else all members run on 127.0.0.1. `trace`: the members
    mark their rounds (`roundtrace`) and the result carries `timeline_ms`."""
    from p2ptrain.bench.allreduce_worker import make_tensor
    from p2ptrain.procs import ProcessGroup

    n = mb * (1 << 20) // 4
    extra = [] if direct else ["--no-direct"]
    name = f"{mode}-{'direct' if direct else 'libp2p'}{'-verified' if verified else ''}"
    with ProcessGroup(work / name) as group:
        env = {"P2PTRAIN_ROUND_TRACE": "1"} if trace else None
        ws = [group.start(extra + _where(lab, i), f"w{i}", env=env, module="p2ptrain.bench.allreduce_worker",
                          stdin=True, prefix=lab.prefix(i) if lab else None) for i in range(peers)]
        ready = [w.wait_event(lambda e: e["event"] == "worker_ready", 120) for w in ws]
        members = [[r["peer"], r["addrs"][0]] for r in ready]
        for i, w in enumerate(ws):
            w.send({"cmd": "prepare", "seed": 1000 + i, "n": n})
        prepared = [w.wait_event(lambda e: e["event"] == "prepared", 120)["rss_mib"] for w in ws]
        secs, own, digests, rss, cpu, reused, phases, timelines = [], [], set(), [], [], [], {}, []
        for k in range(rounds + 1):
            rid = f"{mode}-{k}"
            # A barrier like the ceiling's: all members start at one CLOCK_MONOTONIC instant
            # (after their reset copy), and a round lasts until the last member commits.
            start_at = time.monotonic() + 0.3
            for i, w in enumerate(ws):
                w.send({"cmd": "round", "round": rid, "members": members, "seed": 1000 + i, "n": n,
                        "mode": mode, "reset": True, "start_at": start_at, "verified": verified})
            res = [w.wait_event(lambda e: e.get("round") == rid and e["event"] in ("round_committed", "round_failed"),
                                300) for w in ws]
            if any(r["event"] != "round_committed" for r in res):
                raise RuntimeError(f"round {rid} failed: {[r.get('reason') for r in res]}")
            if k:
                secs.append(max(r["ended"] for r in res) - start_at)
                own.append(max(r["seconds"] for r in res))  # each member's own clock, for comparison
                cpu.append(statistics.mean(r["cpu_s"] for r in res))
                reused.append(all(r["reused"] for r in res))
                for key in res[0]["phases"]:  # the slowest member's seconds in each phase
                    phases.setdefault(key, []).append(max(r["phases"].get(key, 0.0) for r in res))
                digests |= {r["digest"] for r in res}
                if trace:
                    timelines.append([roundtrace.milestones(r.get("trace", [])) for r in res])
                rss = [max(a, r["rss_mib"]) for a, r in zip(rss or [0] * peers, res)]
        dump = work / f"{name}.npy"
        ws[0].send({"cmd": "dump", "path": str(dump)})
        ws[0].wait_event(lambda e: e["event"] == "dumped", 60)
        for w in ws:
            w.send({"cmd": "exit"})
    result = np.load(dump)
    exact = np.zeros(n, np.float64)
    for i in range(peers):
        exact += make_tensor(1000 + i, n)
    exact /= peers
    err = float(np.linalg.norm(result - exact) / np.linalg.norm(exact))
    idle = [r["rss_mib"] for r in ready]
    mib_s = [mb / s for s in secs]
    return {"event": "bench_allreduce_p2ptrain", "mode": mode, "path": "direct" if direct else "libp2p",
            "verified": verified,
            "peers": peers, "mb": mb, "mib_s": {"median": round(statistics.median(mib_s), 1),
                                                  "all": [round(x, 1) for x in mib_s]},
            "rel_err": err, "identical": len(digests) == 1,
            "round_s": {"median": round(statistics.median(secs), 4), "all": [round(x, 4) for x in secs]},
            # The longest any member's own allreduce() call took (the pre-barrier measure).
            "member_round_s_max": {"median": round(statistics.median(own), 4)},
            "phases_s_max": {k: round(statistics.median(v), 4) for k, v in phases.items()},
            "cpu_s_per_member": round(statistics.median(cpu), 4), "links_reused": sum(reused), "peak_rss_mib": rss, "idle_rss_mib": idle,
            "inputs_rss_mib": prepared,
            **({"timeline_ms": _median_timelines(timelines, peers),
                # a stall hides in the medians: the slowest round's own timeline
                "timeline_slowest_ms": {"round_s": round(max(secs), 4), "members": timelines[secs.index(max(secs))]}}
               if trace and timelines else {}),
            # What the all-reduce itself adds on top of a process holding its input tensor
            # (the harness also keeps a pristine copy to reset rounds: that copy is excluded).
            "allreduce_rss_x_tensor": round(max(r - p for r, p in zip(rss, prepared)) / mb, 2),
            "rss_over_idle_x_tensor": round(max(r - i for r, i in zip(rss, idle)) / mb, 2)}


def _median_timelines(timelines: list[list[dict]], peers: int) -> list[dict]:
    """Per member, each milestone's median over the measured rounds."""
    out = []
    for i in range(peers):
        keys = sorted({k for rnd in timelines for k in rnd[i]})
        out.append({k: round(statistics.median(rnd[i][k] for rnd in timelines if k in rnd[i]), 2) for k in keys})
    return out


def _where(lab, i: int) -> list[str]:
    return ["--listen", f"/ip4/{lab.ip(i)}/tcp/0", "--bulk-ip", lab.ip(i)] if lab else []


def _sub(module: str, args: list[str], work: Path) -> dict | None:
    r = subprocess.run([sys.executable, "-m", module, *args, "--json"], capture_output=True, text=True,
                       timeout=1800, cwd=str(work))
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
        print(f"{module}: unavailable: {last}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(args) -> int:
    if args.lab_mbit:
        from p2ptrain.bench.allreduce_lab import run_lab

        return run_lab(args)
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-allreduce-"))
    common = ["--peers", str(args.peers), "--mb", str(args.mb), "--rounds", str(args.rounds)]
    rows: list[tuple[str, dict | None]] = []
    rows.append(("p2ptrain int8 (direct)", measure_ours(args.peers, args.mb, args.rounds, "int8", True, work, True,
                                                                  trace=args.trace)))
    rows.append(("p2ptrain int8 unverified (direct)",
                 measure_ours(args.peers, args.mb, args.rounds, "int8", True, work, trace=args.trace)))
    rows.append(("p2ptrain fp32 unverified (direct)",
                 measure_ours(args.peers, args.mb, args.rounds, "fp32", True, work, trace=args.trace)))
    if args.fallback:
        rows.append(("p2ptrain int8 (libp2p stream)",
                     measure_ours(args.peers, args.mb, args.rounds, "int8", False, work)))
    if not args.no_baselines:
        for mode in ("int8", "fp32"):
            rows.append((f"raw AES-GCM ring {mode} (ceiling)",
                         _sub("p2ptrain.bench.raw_ring", common + ["--mode", mode, "--cipher", "aesgcm"], work)))
        for comp in ("none", "fp16"):
            rows.append((f"hivemind {comp}", _sub("p2ptrain.bench.hivemind_allreduce",
                                                  common + ["--compression", comp], work)))
    by = {label: r for label, r in rows}

    def med(label: str) -> float | None:
        r = by.get(label)
        return r["mib_s"]["median"] if r else None

    def ratio(a: str, b: str) -> float | None:
        x, y = med(a), med(b)
        return round(x / y, 2) if x and y else None

    hm_best = max([v for v in (med("hivemind none"), med("hivemind fp16")) if v] or [0]) or None
    ratios = {
        "int8_vs_ceiling_int8": ratio("p2ptrain int8 (direct)", "raw AES-GCM ring int8 (ceiling)"),
        "int8_unverified_vs_ceiling_int8": ratio("p2ptrain int8 unverified (direct)",
                                                 "raw AES-GCM ring int8 (ceiling)"),
        "verified_vs_unverified_int8": ratio("p2ptrain int8 (direct)", "p2ptrain int8 unverified (direct)"),
        "fp32_vs_ceiling_fp32": ratio("p2ptrain fp32 unverified (direct)", "raw AES-GCM ring fp32 (ceiling)"),
        "int8_vs_best_hivemind": round(med("p2ptrain int8 (direct)") / hm_best, 2) if hm_best else None,
    }
    summary = {"event": "bench_allreduce_summary", "peers": args.peers, "mb": args.mb, "rounds": args.rounds,
               "results": {label: r for label, r in rows}, "ratios": ratios,
               "goals": {"int8_vs_best_hivemind": ">= 10", "int8_vs_ceiling_int8": ">= 0.7",
                         "rel_err_int8": "<= 0.01", "peak_rss": "<= 3x the tensor"}}
    if args.json:
        for _, r in rows:
            if r:
                print(json.dumps(r))
        print(json.dumps(summary))
        return 0
    print(f"All-reduce, {args.peers} peers, {args.mb} MiB fp32, median of {args.rounds} rounds (MiB/s of fp32 payload)")
    print("p2ptrain int8 (direct) is the training path: signed headers, every frame checked")
    print(f"{'system':<36}{'MiB/s':>9}{'rel err':>10}{'identical':>10}{'peak RSS MiB':>16}")
    for label, r in rows:
        if r is None:
            print(f"{label:<36}{'unavailable':>9}")
            continue
        rss = r.get("peak_rss_mib") or []
        print(f"{label:<36}{r['mib_s']['median']:>9.1f}{r.get('rel_err', float('nan')):>10.4f}"
              f"{str(r.get('identical')):>10}{(max(rss) if rss else float('nan')):>16.0f}")
    for k, v in ratios.items():
        print(f"{k}: {v}")
    ours = by["p2ptrain int8 (direct)"]
    print(f"p2ptrain int8 RSS: peak {max(ours['peak_rss_mib']):.0f} MiB; above an idle node "
          f"{ours['rss_over_idle_x_tensor']}x the tensor (incl. the harness's 2 input copies); "
          f"added by the all-reduce {ours['allreduce_rss_x_tensor']}x (goal: peak <= 3x)")
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m p2ptrain.bench.allreduce")
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
