"""`p2ptrain bench scale`: one run of many real peer processes in groups of G (issue 31).

A bootstrap and PEERS trainers (real `p2ptrain join` processes on 127.0.0.1, one run, group
size G < PEERS) start together (`--min-peers PEERS`, so the figure is about groups, not about
a run that starts alone: tests/test_one_model.py checks that) and train until each has
committed STEPS outer steps (`--max-outer-steps`) or BOUND seconds pass; then the bench stops
what still runs and reports, from the peers' `--json` events (p2ptrain.bench.lineage):

- commit fraction per peer: of the outer steps it started training (a retried step counts
  once, joining with zeros is not training), how many it committed. A step a peer was in when
  the bench stopped it, started in the last GRACE seconds, had no chance to end and is not
  counted; a peer that trained nothing scores 0. Min and mean over the peers.
- lineages: distinct params hashes at the newest state step that at least two peers
  committed (1: they ended on one model; groups average separately, so today several).
- val_loss spread: (max - min) / mean of each peer's final val_loss (that of its last commit),
  in per cent (every peer scores the same held-out batches); val_loss_step_min/max say at
  which steps those were scored (a peer that caught up since its last commit has no newer one).
- goals (issue 31): every peer's commit fraction >= 0.9; val_loss spread <= 1 %.

The model is the tiny preset (0.84 M parameters) on batches of 4 x 64 tokens, H = 4 inner
steps and 2 eval batches: the smallest settings that still train (val loss falls from 5.5
to ~3.5 in 10 steps) so that 16 processes fit 2 shared cores. What the bench measures is
coordination, not learning: the figures do not depend on the model being useful.
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

from p2ptrain.bench import lineage

GRACE = 30.0
"""Seconds: a step started this close to the bench stopping its peer is not counted."""
GOAL_FRACTION = 0.9
GOAL_SPREAD_PCT = 1.0


@dataclass
class ScaleSettings:
    peers: int = 16
    group_size: int = 4
    steps: int = 10
    """Outer steps each peer commits before it leaves (`--max-outer-steps`)."""
    bound: float = 480.0
    """Seconds of training (after the processes start) before the bench stops what still runs."""
    inner_steps: int = 4
    eval_batches: int = 2
    join_window: float = 5.0
    seed: int = 7

    def __post_init__(self) -> None:
        if self.peers < 2 or not 1 <= self.group_size or self.steps < 1 or self.bound <= 0:
            raise ValueError("need peers >= 2, group_size >= 1, steps >= 1, bound > 0")
        if self.inner_steps < 1 or self.eval_batches < 1 or self.join_window <= 0:
            raise ValueError("need inner_steps >= 1, eval_batches >= 1, join_window > 0")


def init_run(work: Path, s: ScaleSettings) -> tuple[Path, str]:
    out = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "init", "--out", str(work / "run"), "--key", str(work / "init.key"),
         "--inner-steps", str(s.inner_steps), "--batch-size", "4", "--seq-len", "64", "--warmup", "5",
         "--planned-outer-steps", "1000", "--join-window", str(s.join_window), "--group-size", str(s.group_size),
         "--seed", str(s.seed)], capture_output=True, text=True, timeout=300, cwd=work)
    if out.returncode != 0:
        raise RuntimeError(f"p2ptrain init failed: {out.stderr.strip()[-500:]}")
    return work / "run", out.stdout.strip().splitlines()[-1]


def join_args(baddr: str, run: tuple[Path, str], work: Path, i: int, s: ScaleSettings) -> list[str]:
    which = ["--manifest", str(run[0] / "run.toml")] if i == 0 else ["--run", run[1]]
    return ["join", "--bootstrap", baddr, "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(work / f"p{i}.key"),
            "--workdir", str(work / f"p{i}"), *which, "--min-peers", str(s.peers), "--max-outer-steps",
            str(s.steps), "--eval-batches", str(s.eval_batches), "--threads", "1", "--json"]


def summarize(events: list[dict], cut: dict[str, int], s: ScaleSettings, seconds: float) -> dict:
    """The `bench_scale_summary` fields from every peer's events (pure: tested without processes)."""
    fr = lineage.commit_fraction(events, cut)
    peers = {e["peer"] for e in events if e.get("event") == "run_joined"}
    fractions = {p: (fr[p][1] / fr[p][0] if p in fr and fr[p][0] else 0.0) for p in peers}
    step, hashes, at = lineage.lineages_at_newest_shared(events)
    spread, final = lineage.val_loss_spread(events)
    st = lineage.states(events)
    fmin = min(fractions.values(), default=0.0)
    return {
        "peers": s.peers, "group_size": s.group_size, "steps": s.steps, "joined": len(peers),
        "commit_fraction_min": round(fmin, 4),
        "commit_fraction_mean": round(statistics.mean(fractions.values()), 4) if fractions else 0.0,
        "started": sum(v[0] for v in fr.values()), "committed": sum(v[1] for v in fr.values()),
        "newest_step_min": min((max(v) for v in st.values()), default=0),
        "newest_step_max": max((max(v) for v in st.values()), default=0),
        "lineages": hashes, "lineage_step": step, "lineage_peers": at,
        "val_loss_spread_pct": spread, "val_loss_peers": len(final),
        "val_loss_min": min((v for _, v in final.values()), default=None),
        "val_loss_max": max((v for _, v in final.values()), default=None),
        # the steps those losses were scored at: a peer that caught up since its last commit
        # reports an older step's loss (today's protocol), which the spread then includes
        "val_loss_step_min": min((s for s, _ in final.values()), default=None),
        "val_loss_step_max": max((s for s, _ in final.values()), default=None),
        "alone_commits": sum(len(e.get("members") or ()) == 1 for e in events
                             if e.get("event") == "outer_step_committed"),
        "skips": sum(e.get("event") == "outer_step_skipped" for e in events),
        "seconds": round(seconds, 1),
        "goals": {"commit_fraction_ge_0.9": bool(peers) and fmin >= GOAL_FRACTION,
                  "val_loss_spread_le_1pct": spread is not None and len(final) == len(peers) == s.peers
                  and spread <= GOAL_SPREAD_PCT},
    }


def run_scale(work: Path, s: ScaleSettings, say=print) -> dict:
    from p2ptrain.procs import ProcessGroup

    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    run = init_run(work, s)
    cut: dict[str, int] = {}
    with ProcessGroup(work / "procs") as group:
        boot = group.start(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(work / "boot.key"),
                            "--json"], "bootstrap")
        baddr = boot.first_line(60)
        peers = [group.start(join_args(baddr, run, work, i, s), f"p{i}") for i in range(s.peers)]
        say(f"scale: {s.peers} peers, group size {s.group_size}, {s.steps} outer steps each, bound {s.bound:.0f}s")
        start = time.monotonic()
        last = start
        while any(p.proc.poll() is None for p in peers) and time.monotonic() - start < s.bound:
            time.sleep(1.0)
            if time.monotonic() - last >= 30:
                last = time.monotonic()
                done = sum(p.proc.poll() is not None for p in peers)
                evs = [e for p in peers for e in list(p.all_events)]
                n = sum(e["event"] == "outer_step_committed" for e in evs)
                say(f"scale: {time.monotonic() - start:.0f}s, {n} commits, {done}/{s.peers} peers done")
        now = time.time()
        stopped = sum(p.proc.poll() is None for p in peers)
        for p in peers:  # stopped by the bench: its step in flight, if young, is not counted
            if p.proc.poll() is None:
                started = [e for e in p.all_events if e["event"] == "outer_step_started"]
                if started and now - started[-1]["t"] < GRACE:
                    cut[started[-1]["peer"]] = int(started[-1]["step"])
        seconds = time.monotonic() - start
        events = [e for p in peers for e in list(p.all_events)]
        failed = [f"{p.name} exited {p.proc.returncode}: {p.stderr_tail(2)}" for p in peers
                  if p.proc.poll() not in (None, 0)]
    out = summarize(events, cut, s, seconds)
    out["stopped_by_bound"] = stopped
    out["failed"] = failed
    out["total_seconds"] = round(time.monotonic() - t0, 1)
    return out


def add_arguments(p) -> None:
    p.add_argument("--peers", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4, metavar="G")
    p.add_argument("--steps", type=int, default=10, metavar="N", help="outer steps each peer commits")
    p.add_argument("--bound", type=float, default=480.0, help="seconds before what still trains is stopped")
    p.add_argument("--inner-steps", type=int, default=4, metavar="H")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", action="store_true", help="JSON lines; the last is bench_scale_summary")


def run(args) -> int:
    s = ScaleSettings(peers=args.peers, group_size=args.group_size, steps=args.steps, bound=args.bound,
                      inner_steps=args.inner_steps, seed=args.seed)
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-scale-"))
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    res = run_scale(work, s, say)
    out = {"event": "bench_scale_summary", **res, "settings": asdict(s), "logs": str(work)}
    if args.json:
        print(json.dumps(out))
    else:
        g = res["goals"]
        print(f"{s.peers} peers, G {s.group_size}, {s.steps} steps: commit fraction min "
              f"{res['commit_fraction_min']:.2f} mean {res['commit_fraction_mean']:.2f} "
              f"({res['committed']}/{res['started']}) [goal >= 0.9: {g['commit_fraction_ge_0.9']}]")
        print(f"lineages at step {res['lineage_step']} ({res['lineage_peers']} peers): {res['lineages']}; "
              f"val_loss spread {res['val_loss_spread_pct']} % over {res['val_loss_peers']} peers "
              f"[goal <= 1 %: {g['val_loss_spread_le_1pct']}]")
        print(f"alone commits {res['alone_commits']}, skips {res['skips']}, {res['seconds']}s; logs: {work}")
    return 0 if all(res["goals"].values()) and not res["failed"] else 1
