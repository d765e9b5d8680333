"""`p2ptrain bench utilization`: compute utilization of real peers on emulated home links.

A bootstrap and PEERS `p2ptrain join` processes, each in its own network namespace of the
emulated internet (`p2ptrain.bench.inetlab`: every peer's access link shaped to MBIT both
ways with tc tbf, no added latency), train two runs back to back in the same lab: one
sequential (inner -> ready -> election -> round -> outer step) and one overlapped
(`--overlap`, p2ptrain.train.overlap: round t reduces while phase t+1 trains). Same model,
data, H, seeds and machine.

Per peer, over whole cycles after the warm-up (the start of phase WARM to the start of
phase STEPS-1; `utilization_commits` is the older commit-to-commit window, see `measure`):
  utilization = time spent in inner phases (the `inner_phase` events: the loop of H inner
                steps, data windows included) / wall time
  inner_step_ms = that time / inner steps: how much slower each inner step ran while the
                reduce shared the CPU (on 2 shared cores, 4 peers plus their rounds compete)
  steps_per_s   = inner steps / wall time, the throughput the utilization stands for.
`comm_over_inner` (sequential run) says how the chosen H compares the round to the phase:
~1 means the all-reduce and its protocol take about as long as the inner steps. Peers score
one held-out batch per committed step (`join --eval-batches 1`): at this bench's small
batches the default 8 cost more than a whole inner phase.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class UtilSettings:
    peers: int = 4
    mbit: float = 100.0
    inner_steps: int = 4
    steps: int = 10
    """Committed outer steps per run (the first WARM are not measured)."""
    warm: int = 2
    preset: str = "tiny"
    batch: int = 8
    seq_len: int = 64
    """512 tokens per inner step: at batch 2 the tiny model's steps were mostly Python
    overhead, which holds the GIL the round's thread needs (BENCHMARKS.md, issue 17)."""
    join_window: float = 10.0
    overlap: str = "eager"
    seed: int = 17
    eval_batches: int = 1
    max_inner_steps: int | None = None
    """The overlapped run's phases extend up to this many steps while their round is in
    flight (train.max_inner_steps; None: `init`'s default, 2 H), and a third run, overlapped
    with fixed H, is measured beside it; 0: fixed H only."""

    fragments: int = 0
    """P > 1: a streaming run beside the others (train.fragments: a round of 1/P of the
    payload every H / P steps), over P times as many outer steps (the same inner steps)."""

    def __post_init__(self) -> None:
        if self.fragments and (self.fragments < 2 or self.inner_steps % self.fragments):
            raise ValueError("fragments must be 0 or >= 2 and divide inner_steps")
        if self.peers < 2 or self.mbit <= 0 or self.inner_steps < 1 or not 1 <= self.warm < self.steps:
            raise ValueError("need peers >= 2, mbit > 0, inner_steps >= 1, 1 <= warm < steps")
        if self.overlap not in ("delayed", "eager"):
            raise ValueError("overlap must be 'delayed' or 'eager'")
        if self.max_inner_steps and self.max_inner_steps < self.inner_steps:
            raise ValueError("max_inner_steps must be 0 or >= inner_steps")

    @property
    def extends(self) -> bool:
        return self.max_inner_steps != 0


def init_run(work: Path, s: UtilSettings, overlap: str, extend: bool = False, fragments: int = 0) -> tuple[Path, str]:
    name = f"run-{overlap}{'-extend' if extend else ''}{f'-p{fragments}' if fragments else ''}"
    ext: list[str] = []  # the sequential run, or extendable phases at init's default
    if overlap != "none" and (not extend or s.max_inner_steps):
        ext = ["--max-inner-steps", str(s.max_inner_steps if extend else 0)]
    if fragments:  # (init's outer step for streaming runs: DiLoCo's 0.7 / 0.9)
        ext += ["--fragments", str(fragments)]
    out = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "init", "--out", str(work / name), "--key", str(work / "init.key"),
         "--preset", s.preset, "--inner-steps", str(s.inner_steps), "--batch-size", str(s.batch), "--seq-len",
         str(s.seq_len), "--warmup", "5", "--planned-outer-steps", "100", "--join-window", str(s.join_window),
         "--group-size", str(s.peers), "--seed", str(s.seed), "--overlap", overlap, *ext],
        capture_output=True, text=True, timeout=300, cwd=work)
    if out.returncode != 0:
        raise RuntimeError(f"p2ptrain init failed: {out.stderr.strip()[-500:]}")
    return work / name, out.stdout.strip().splitlines()[-1]


def run_in_lab(lab, work: Path, s: UtilSettings, run: tuple[Path, str], name: str, port: int,
               steps: int | None = None) -> list[list[dict]]:
    """Every peer's events once each has committed step `steps` (default s.steps; raises on a
    timeout). A fresh `port` per run: the last run's sockets may still hold the old one."""
    steps = steps or s.steps
    from p2ptrain.procs import ProcessGroup

    with ProcessGroup(work / name) as group:
        boot = group.start(["bootstrap", "--listen", f"/ip4/{lab.boot_ip}/tcp/{port}", "--key",
                            str(work / "boot.key"), "--json"], "bootstrap", prefix=lab.boot_prefix)
        baddr = boot.first_line(60)
        peers = []
        for i in range(s.peers):
            which = ["--manifest", str(run[0] / "run.toml")] if i == 0 else ["--run", run[1]]
            peers.append(group.start(
                ["join", "--bootstrap", baddr, "--listen", f"/ip4/{lab.ip(i)}/tcp/{port + 1}", "--key",
                 str(work / f"p{i}.key"), "--workdir", str(work / name / f"w{i}"), *which, "--min-peers",
                 str(s.peers), "--max-outer-steps", str(steps), "--threads", "1", "--eval-batches", str(s.eval_batches), "--json"],
                f"p{i}", prefix=lab.prefix(i)))
        for p in peers:
            p.wait_event(lambda e: e["event"] == "outer_step_committed" and e["step"] >= steps, 120 + 60 * steps)
        return [list(p.all_events) for p in peers]


def _phase_starts(events: list[dict]) -> dict[int, float]:
    """When each inner phase began: `inner_phase_started` (overlapped loop), else the
    `outer_step_started` that the sequential loop emits right before its phase."""
    starts = {e["step"]: e["t"] for e in events if e["event"] == "outer_step_started"}
    starts.update({e["phase"]: e["t"] for e in events if e["event"] == "inner_phase_started"})
    return starts


def measure(events: list[dict], warm: int, steps: int) -> dict:
    """One peer's utilization figures (module docstring) over whole cycles: phases
    warm..steps-2, wall from the start of phase `warm` to the start of phase steps-1, so
    every phase counted and every wait after it lies inside the window. The commit-window
    figure (`utilization_commits`: commit of step warm to commit of step steps) is kept for
    comparison with older runs; its ends move with the commit events, which come after
    evaluation, beside the next phase."""
    commits = {e["step"]: e for e in events if e["event"] == "outer_step_committed"}
    phases = {e["phase"]: e for e in events if e["event"] == "inner_phase"}
    starts = _phase_starts(events)
    last = steps - 1
    if not all(k in commits for k in (warm, steps)) or not all(k in starts for k in (warm, last)):
        raise RuntimeError(f"peer did not commit steps {warm} and {steps} or start phases {warm} and {last}")
    wall = starts[last] - starts[warm]
    used = [phases[p] for p in range(warm, last) if p in phases]
    inner = sum(e["seconds"] for e in used)
    n_steps = sum(e["steps"] for e in used)
    c_wall = commits[steps]["t"] - commits[warm]["t"]
    c_inner = sum(phases[p]["seconds"] for p in range(warm, steps) if p in phases)
    comm = [commits[k]["seconds_comm"] for k in range(warm + 1, steps + 1) if k in commits]
    return {"wall_s": round(wall, 3), "inner_s": round(inner, 3), "utilization": round(inner / wall, 4),
            "utilization_commits": round(c_inner / c_wall, 4),
            "inner_step_ms": round(1000 * inner / max(1, n_steps), 1), "steps_per_s": round(n_steps / wall, 3),
            "steps_per_phase": round(n_steps / max(1, len(used)), 2),
            "comm_s_mean": round(statistics.fmean(comm), 3) if comm else None,
            "inner_phase_s_mean": round(inner / max(1, len(used)), 3)}


def step_timing(events: list[list[dict]], warm: int) -> dict:
    """Mean seconds per part of a step (the trainer's `step_timing` events) over every peer's
    measured steps: where the coordination time goes."""
    parts: dict[str, list[float]] = {}
    for ev in events:
        for e in ev:
            if e["event"] == "step_timing" and e["step"] >= warm:
                for k, v in e["seconds"].items():
                    parts.setdefault(k, []).append(v)
    return {k: round(statistics.fmean(v), 3) for k, v in parts.items()}


def summarize_mode(per_peer: list[dict]) -> dict:
    keys = ("utilization", "utilization_commits", "inner_step_ms", "steps_per_s", "comm_s_mean",
            "inner_phase_s_mean", "wall_s", "steps_per_phase")
    out = {k: round(statistics.fmean(p[k] for p in per_peer if p[k] is not None), 4) for k in keys}
    out["utilization_min"] = min(p["utilization"] for p in per_peer)
    return out


def add_arguments(p) -> None:
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--mbit", type=float, default=100.0, help="every peer's access link, both ways")
    p.add_argument("--inner-steps", type=int, default=None, metavar="H")
    p.add_argument("--steps", type=int, default=None, help="committed outer steps per run")
    p.add_argument("--batch", type=int, default=None, help="sequences per inner step (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 64)")
    p.add_argument("--eval-batches", type=int, default=None, help="peers' held-out batches per step (default 1)")
    p.add_argument("--overlap", default="eager", choices=["delayed", "eager"])
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "base"])
    p.add_argument("--max-inner-steps", type=int, default=None, metavar="N",
                   help="overlapped phases extend up to N steps while their round is in flight (default: "
                        "init's, 2 H; a third run, overlapped with fixed H, is measured beside it); 0: fixed H")
    p.add_argument("--fragments", type=int, default=None, metavar="P",
                   help="also a streaming run (init --fragments P: a round of 1/P of the payload every H/P steps)")
    p.add_argument("--json", action="store_true", help="JSON lines; the last is bench_utilization_summary")


def run(args) -> int:
    from p2ptrain.bench.inetlab import LabUnavailable, internet_lab, unavailable_reason

    s = UtilSettings(peers=args.peers, mbit=args.mbit, overlap=args.overlap, preset=args.preset)
    for name in ("inner_steps", "steps", "batch", "seq_len", "eval_batches", "max_inner_steps", "fragments"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    s.__post_init__()
    say = (lambda o: print(json.dumps(o), flush=True)) if args.json else (lambda o: None)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    if (why := unavailable_reason()):
        print(f"error: the emulated internet is not available here: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-util-"))
    t0 = time.monotonic()
    runs = {"sequential": init_run(work, s, "none"), "overlapped": init_run(work, s, s.overlap, s.extends)}
    if s.extends:
        runs["overlapped_fixed_h"] = init_run(work, s, s.overlap)
    if s.fragments:
        runs["overlapped_streaming"] = init_run(work, s, s.overlap, s.extends, s.fragments)
    result: dict = {}
    try:
        with internet_lab(rates_mbit=[s.mbit] * s.peers, boot=True) as lab:
            for k, (mode, run_) in enumerate(runs.items()):
                log(f"utilization: {mode} run, {s.peers} peers at {s.mbit:g} Mbit/s, H={s.inner_steps}")
                P = s.fragments if mode == "overlapped_streaming" else 1  # P rounds per H inner steps
                events = run_in_lab(lab, work, s, run_, mode, 4000 + 10 * k, s.steps * P)
                per_peer = [measure(ev, s.warm * P, s.steps * P) for ev in events]
                result[mode] = summarize_mode(per_peer)
                hashes = {}
                for ev in events:
                    for e in ev:
                        if e["event"] == "outer_step_committed":
                            hashes.setdefault(e["step"], set()).add(e["params_sha256"])
                result[mode]["identical_params"] = all(len(h) == 1 for h in hashes.values())
                result[mode]["step_timing"] = step_timing(events, s.warm)
                say({"event": "bench_utilization_mode", "mode": mode, **result[mode], "peers": per_peer})
                log(f"  {mode}: utilization {result[mode]['utilization']:.3f} (min {result[mode]['utilization_min']:.3f}), "
                    f"{result[mode]['inner_step_ms']:.0f} ms/inner step, round {result[mode]['comm_s_mean']:.2f} s "
                    f"vs phase {result[mode]['inner_phase_s_mean']:.2f} s")
    except LabUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    seq, ovl = result["sequential"], result["overlapped"]
    summary = {"event": "bench_utilization_summary", "utilization_overlapped": ovl["utilization"],
               "utilization_sequential": seq["utilization"],
               "utilization_commits_overlapped": ovl["utilization_commits"],
               "utilization_commits_sequential": seq["utilization_commits"],
               "throughput_ratio": round(ovl["steps_per_s"] / seq["steps_per_s"], 3),
               "inner_step_ms_overlapped": ovl["inner_step_ms"], "inner_step_ms_sequential": seq["inner_step_ms"],
               "comm_over_inner_sequential": round(seq["comm_s_mean"] / seq["inner_phase_s_mean"], 3),
               "steps_per_phase_overlapped": ovl["steps_per_phase"],
               **({"utilization_overlapped_fixed_h": result["overlapped_fixed_h"]["utilization"],
                   "throughput_ratio_fixed_h": round(result["overlapped_fixed_h"]["steps_per_s"] / seq["steps_per_s"], 3)}
                  if s.extends else {}),
               **({"utilization_overlapped_streaming": result["overlapped_streaming"]["utilization"],
                   "throughput_ratio_streaming": round(result["overlapped_streaming"]["steps_per_s"] / seq["steps_per_s"], 3),
                   "round_s_streaming": result["overlapped_streaming"]["comm_s_mean"]} if s.fragments else {}),
               "identical_params": all(r["identical_params"] for r in result.values()),
               "settings": asdict(s), "seconds": round(time.monotonic() - t0, 1), "logs": str(work)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"utilization: overlapped {summary['utilization_overlapped']:.3f}, sequential "
              f"{summary['utilization_sequential']:.3f}; inner-step throughput x{summary['throughput_ratio']:.2f}; "
              f"round/phase (sequential) {summary['comm_over_inner_sequential']:.2f}")
    return 0 if summary["identical_params"] else 1
