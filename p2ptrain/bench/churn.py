"""`p2ptrain bench churn`: a run under churn -- one peer SIGKILLed and restarted every T seconds.

A bootstrap and PEERS trainers (real `p2ptrain join` processes on 127.0.0.1) train one run.
After a warm-up of undisturbed outer steps (which measures t_step, the baseline step time of
the same machine in the same run), every PERIOD seconds the next peer in turn is SIGKILLed
and at once restarted with the same key and workdir: it resumes from its newest checkpoint
and catches up from the others. After DURATION seconds everything stops and the bench reports:

- committed_fraction: outer steps committed / outer steps started, over every (peer, step)
  started in the churn window but its last 2 t_step (a step a peer started and did not commit -- killed, skipped,
  round aborted -- counts as lost). torchft's figure (82.3 % at one failure a minute) is the
  same ratio for its synchronous group.
- expected: 1 - t_step/T, the fraction left if each failure cost one step's worth of time.
- throughput_ratio: distinct run steps committed per second in the churn window / in the
  warm-up (the run's progress, whoever made it).
- mismatches: every committed step is checked -- all members of a group that committed step s
  report the same params_sha256 -- and, at the end, the params hash each peer published in the
  DHT (`p2ptrain status --run`) is the one it committed. Any mismatch fails the bench (exit 1).
- groups_per_step: how many distinct groups committed each run step. Under churn, peers can
  see different ready sets and elect different groups (the run forks into groups that
  average separately, as with group_size < peers); 1.0 means it never did.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class ChurnSettings:
    peers: int = 5
    period: float = 60.0
    """Seconds between kills (T)."""
    duration: float = 300.0
    """Seconds of churn after the warm-up."""
    warmup_steps: int = 3
    """Undisturbed outer steps first; their timing gives t_step."""
    inner_steps: int = 10
    join_window: float = 5.0
    seed: int = 11

    def __post_init__(self) -> None:
        if self.peers < 3 or self.period <= 0 or self.duration <= 0 or self.warmup_steps < 2:
            raise ValueError("need peers >= 3, period > 0, duration > 0, warmup_steps >= 2")


@dataclass
class ChurnResult:
    settings: dict
    t_step: float
    kills: int
    started: int
    committed: int
    committed_fraction: float
    expected: float
    throughput_ratio: float
    run_steps_churn: int
    groups_per_step: float = 0.0
    """Distinct groups committing each run step (1.0 = one group, the run never forked)."""
    mismatches: list = field(default_factory=list)
    seconds: float = 0.0


def init_run(work: Path, s: ChurnSettings) -> tuple[Path, str]:
    out = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "init", "--out", str(work / "run"), "--key", str(work / "init.key"),
         "--inner-steps", str(s.inner_steps), "--batch-size", "4", "--seq-len", "64", "--warmup", "5",
         "--planned-outer-steps", "1000", "--join-window", str(s.join_window), "--group-size", str(s.peers + 3),
         "--seed", str(s.seed)], capture_output=True, text=True, timeout=300, cwd=work)
    if out.returncode != 0:
        raise RuntimeError(f"p2ptrain init failed: {out.stderr.strip()[-500:]}")
    return work / "run", out.stdout.strip().splitlines()[-1]


def _join_args(baddr: str, run: tuple[Path, str], work: Path, i: int, peers: int) -> list[str]:
    which = ["--manifest", str(run[0] / "run.toml")] if i == 0 else ["--run", run[1]]
    return ["join", "--bootstrap", baddr, "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(work / f"p{i}.key"),
            "--workdir", str(work / f"p{i}"), *which, "--min-peers", str(peers), "--threads", "1", "--json"]


def check_groups(events: list[dict]) -> list[str]:
    """Mismatches among committed steps: members of one group at one step must agree."""
    groups: dict[tuple, set[str]] = {}
    for e in events:
        if e["event"] == "outer_step_committed":
            groups.setdefault((e["step"], tuple(sorted(e["members"]))), set()).add(e["params_sha256"])
    return [f"step {step}: group of {len(members)} committed {len(h)} different params"
            for (step, members), h in sorted(groups.items()) if len(h) > 1]


def check_published(rows: list[dict], events: list[dict]) -> list[str]:
    """Mismatches between the params hash each peer published in the DHT (`status --run`)
    and the one it reported when it committed that step. (Peers of different groups may
    hold different params at one step: groups average separately. Within a group they
    must not differ, which `check_groups` checks.)"""
    said = {(e["peer"], e["step"]): e["params_sha256"] for e in events if e["event"] == "outer_step_committed"}
    out = []
    for r in rows:
        want = said.get((r["remote"], r.get("step")))
        if want is not None and r.get("params_sha256") != want:
            out.append(f"DHT: {r['remote'][-8:]} published {str(r.get('params_sha256'))[:8]} for step "
                       f"{r['step']}, committed {want[:8]}")
    return out


def groups_per_step(events: list[dict]) -> float:
    """Mean number of distinct groups committing a run step (1.0: the run never forked)."""
    by_step: dict[int, set] = {}
    for e in events:
        if e["event"] == "outer_step_committed":
            by_step.setdefault(e["step"], set()).add(tuple(sorted(e["members"])))
    return round(statistics.mean(len(g) for g in by_step.values()), 3) if by_step else 0.0


def summarize(events: list[dict], t_start: float, t_end: float, t_step: float, period: float,
              warmup_rate: float) -> dict:
    # Steps started in the last 2 t_step of the window had no time to commit: not counted.
    started = [e for e in events if e["event"] == "outer_step_started" and t_start <= e["t"] < t_end - 2 * t_step]
    done = {(e["peer"], e["step"] - 1) for e in events if e["event"] == "outer_step_committed"}
    committed = sum((e["peer"], e["step"]) in done for e in started)
    run_steps = {e["step"] for e in events if e["event"] == "outer_step_committed" and t_start <= e["t"] < t_end}
    rate = len(run_steps) / max(1e-9, t_end - t_start)
    return {"started": len(started), "committed": committed,
            "committed_fraction": round(committed / len(started), 4) if started else 0.0,
            "expected": round(max(0.0, 1 - t_step / period), 4),
            "throughput_ratio": round(rate / warmup_rate, 4) if warmup_rate else 0.0,
            "run_steps_churn": len(run_steps)}


def run_churn(work: Path, s: ChurnSettings, say=print) -> ChurnResult:
    from p2ptrain.procs import ProcessGroup

    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    run = init_run(work, s)
    with ProcessGroup(work / "procs") as group:
        boot = group.start(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(work / "boot.key"),
                            "--json"], "bootstrap")
        baddr = boot.first_line(60)
        live = [group.start(_join_args(baddr, run, work, i, s.peers), f"p{i}") for i in range(s.peers)]
        say(f"churn: {s.peers} peers started; warm-up of {s.warmup_steps} outer steps")
        warm = [p.wait_event(lambda e: e["event"] == "outer_step_committed" and e["step"] >= s.warmup_steps,
                             120 + 60 * s.warmup_steps) for p in live]
        commits = [e for p in live for e in p.all_events if e["event"] == "outer_step_committed"]
        first = {}
        for e in commits:  # the run's commit times: step -> earliest commit
            first[e["step"]] = min(first.get(e["step"], e["t"]), e["t"])
        ts = [first[k] for k in sorted(first)]
        t_step = statistics.median(b - a for a, b in zip(ts, ts[1:]))
        warmup_rate = 1 / t_step
        say(f"churn: t_step {t_step:.2f}s over the warm-up; killing one peer every {s.period:.0f}s "
            f"for {s.duration:.0f}s")
        t_start = max(e["t"] for e in warm)
        churn0 = time.monotonic()
        kills = 0
        while (kills + 1) * s.period < s.duration:
            time.sleep(max(0.0, churn0 + (kills + 1) * s.period - time.monotonic()))
            i = kills % s.peers
            live[i].kill(signal.SIGKILL)
            live[i].proc.wait(10)
            kills += 1
            live[i] = group.start(_join_args(baddr, run, work, i, s.peers), f"p{i}-r{kills}")
            say(f"churn: killed and restarted p{i} ({kills})")
        time.sleep(max(0.0, churn0 + s.duration - time.monotonic()))
        t_end = time.time()
        events = [e for p in group.procs for e in p.all_events]
        status = subprocess.run([sys.executable, "-m", "p2ptrain", "status", "--bootstrap", baddr, "--run", run[1],
                                 "--json"], capture_output=True, text=True, timeout=120, cwd=work)
        rows = json.loads(status.stdout.strip().splitlines()[-1])["peers"] if status.returncode == 0 else []
    summary = summarize(events, t_start, t_end, t_step, s.period, warmup_rate)
    mismatches = check_groups(events) + check_published(rows, events)
    if status.returncode != 0:
        mismatches.append(f"status --run failed: {status.stderr.strip()[-200:]}")
    return ChurnResult(asdict(s), round(t_step, 3), kills, groups_per_step=groups_per_step(events),
                       mismatches=mismatches,
                       seconds=round(time.monotonic() - t0, 1), **summary)


def add_arguments(p) -> None:
    p.add_argument("--peers", type=int, default=5)
    p.add_argument("--period", type=float, default=60.0, metavar="T", help="seconds between kills")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of churn after the warm-up")
    p.add_argument("--inner-steps", type=int, default=10, metavar="H")
    p.add_argument("--json", action="store_true", help="JSON lines; the last is the summary")


def run(args) -> int:
    s = ChurnSettings(peers=args.peers, period=args.period, duration=args.duration, inner_steps=args.inner_steps)
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-churn-"))
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    res = run_churn(work, s, say)
    out = {"event": "bench_churn", **asdict(res), "logs": str(work)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"t_step {res.t_step:.2f}s, T {s.period:.0f}s, {res.kills} kills in {s.duration:.0f}s")
        print(f"outer steps committed: {res.committed}/{res.started} = {res.committed_fraction:.1%} "
              f"(1 - t_step/T = {res.expected:.1%}; ratio {res.committed_fraction / max(res.expected, 1e-9):.2f})")
        print(f"run progress under churn vs warm-up: {res.throughput_ratio:.2f}x; "
              f"groups per run step: {res.groups_per_step}")
        print(f"params mismatches after committed steps: {len(res.mismatches)} {res.mismatches[:3]}")
        print(f"logs: {work}")
    return 0 if not res.mismatches else 1
