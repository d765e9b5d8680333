"""`p2ptrain bench redteam`: a real run attacked one attack at a time (issue 15).

Each scenario is a fresh run on 127.0.0.1: a bootstrap, HONEST `p2ptrain join` processes
(tiny preset, H inner steps, `--max-outer-steps STEPS`) and the attack's own processes with
their own identities:
  baseline        nobody attacks (measured in the same bench, first)
  early-ready     one peer claims ready_at = 1.0 in every ready record (hole 2)
  plant           a planter (p2ptrain/bench/planter.py) advertises a poisoned checkpoint
                  (noise params, outer lr 50 in its metadata) as step 10**6 from a "group" of
                  itself, a state record at that step, and 2 Sybil records (holes 3 and 5)
  chunknorm       one peer signs chunk norms of 1e30 and sends 1000 x its update (hole 4)
  replay, forge, nan, norm   the older hostile-header modes (p2ptrain/bench/adversary.py)
  withhold        one member trains and sends honest data but withholds its commit vote in
                  every ring round (closes its ring channels after the data plane)
  dropfwd         one member contributes honestly but drops every partial sum it relays in the
                  ring (forwards only its own values; as owner publishes own / W): passes the
                  frame checks and commits (hole 5, not defended); its `attacker_dropfwd`
                  report says how much of the others' contribution each committed round lost
  extra-honest    (a control, only when named) one more member with no hostile part
  garbage         after the honest peers started, a process with its own identity sends
                  random and malformed bytes on every run protocol (DHT, round/vote, bulk,
                  blob fetch) to every peer it finds: a fixed number of streams over 20 s
  sybil-K         K identities join with the honest peers, free-ride (zeros) for their first
                  2 steps, then each sends -4 x its pseudo-gradient with a header true to it
                  (hole 6; K = 1, 2, 4)
Per scenario: honest outer steps committed (each honest peer stops after STEPS; a peer left
alone after the others finished gets 30 s more) vs the baseline's (`progress_ratio`; the goal
is >= 0.8), the fraction of started steps that committed, the honest commit rate vs the baseline's
(`rate_ratio`: on 2 shared cores the attackers' own training steals CPU, so this one mixes
protocol harm with plain load), steps where honest peers committed different params
(`param_forks`), honest peers rejected by honest peers (`wrongly_excluded`), and the honest
peers' validation loss at the run's last step (the highest step at least two honest peers
committed) vs the baseline's at the same step (`val_loss_pct`), and over every step both
committed (`val_curve_pct`: the mean of the honest per-step means vs the baseline's).
The last JSON line is `bench_redteam_summary`. Figures are from a noisy shared machine.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ATTACKS = ("early-ready", "plant", "chunknorm", "replay", "forge", "nan", "norm", "sybil-1", "sybil-2", "sybil-4",
           "withhold", "garbage", "dropfwd")
# Not attacks, not in the default list: one more plain `join` process with its own identity
# (the same process the attacks build, with no hostile part), so an attack that joins the
# group (dropfwd) can be told apart from the effect of a 4th honest member.
CONTROLS = ("extra-honest",)


def init_run(work: Path, inner_steps: int, window: float, group: int) -> tuple[Path, str]:
    out = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "init", "--out", str(work / "run"), "--key", str(work / "init.key"),
         "--preset", "tiny", "--inner-steps", str(inner_steps), "--batch-size", "4", "--seq-len", "64",
         "--warmup", "5", "--planned-outer-steps", "100", "--join-window", str(window),
         "--group-size", str(group), "--seed", "11"], capture_output=True, text=True, timeout=300, cwd=work)
    if out.returncode != 0:
        raise RuntimeError(f"p2ptrain init failed: {out.stderr.strip()[-500:]}")
    return work / "run", out.stdout.strip().splitlines()[-1]


def _join(baddr: str, run: tuple[Path, str], work: Path, name: str, first: bool, extra: list[str],
          keys: Path | None = None) -> list[str]:
    """`keys`: where the key lives (honest peers keep theirs across scenarios, so they see the
    same data windows in every one and differ from the baseline only by what the attack did)."""
    which = ["--manifest", str(run[0] / "run.toml")] if first else ["--run", run[1]]
    key = (keys or work) / f"{name}.key"
    return ["join", "--bootstrap", baddr, "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(key),
            "--workdir", str(work / name), *which, "--threads", "1", "--json", *extra]


def scenario(work: Path, run: tuple[Path, str], attack: str, honest: int, steps: int, limit: float,
             say=print) -> dict:
    from p2ptrain.procs import ProcessGroup

    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with ProcessGroup(work / "procs") as group:
        boot = group.start(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(work / "boot.key"),
                            "--json"], "bootstrap")
        baddr = boot.first_line(60)
        if attack == "plant":
            planter = group.start([str(run[0]), "--run", run[1], "--bootstrap", baddr, "--sybils", "2"], "planter",
                                  module="p2ptrain.bench.planter")
            planter.wait_event(lambda e: e.get("event") == "planted", 90)
        mine = ["--max-outer-steps", str(steps), "--min-peers", str(honest)]
        peers = [group.start(_join(baddr, run, work, f"h{i}", i == 0, mine, run[0].parent), f"h{i}")
                 for i in range(honest)]
        hostile = []
        mode, k = (attack.split("-")[0], int(attack.split("-")[1])) if attack.startswith("sybil") else (attack, 1)
        if mode in ("early-ready", "chunknorm", "replay", "forge", "nan", "norm", "sybil", "withhold", "dropfwd",
                    "extra-honest"):
            # dropfwd and its control share one key: same data windows, they differ only by the drops
            keys = run[0].parent if mode in ("dropfwd", "extra-honest") else None
            hostile = [group.start([mode, *_join(baddr, run, work, f"a{j}", False, [], keys)], f"a{j}",
                                   module="p2ptrain.bench.adversary") for j in range(k)]
        elif mode == "garbage":  # bounded: 400 streams over 20 s, to every peer it finds
            hostile = [group.start(["garbage", "--bootstrap", baddr, "--count", "400", "--seconds", "20"], "a0",
                                   module="p2ptrain.bench.attacker")]
        wait_for(peers, t0 + limit, straggle=30.0)
        honest_ids = {e["peer"] for p in peers for e in p.all_events if "peer" in e}
        events = [e for p in peers for e in p.all_events]
        # the attacker's last report (it reports as it goes: the run may end before it does)
        said = [{k: v for k, v in e.items() if k != "event"} for h in hostile
                for e in h.all_events if str(e.get("event", "")).startswith("attacker_")][-1:]
        crashed = sum(p.proc.returncode not in (None, 0) for p in peers)
    row = measure(attack, events, honest_ids, steps, round(time.monotonic() - t0, 1))
    row["honest_crashed"] = crashed
    if said:
        row["attacker"] = said[0]
    return row


def wait_for(peers, deadline: float, straggle: float) -> None:
    """Until every honest peer has left (its --max-outer-steps done), or `straggle` seconds
    after the first one left (a peer left behind alone cannot commit: nobody to reduce with),
    or the deadline."""
    while time.monotonic() < deadline:
        done = [p for p in peers if p.proc.poll() is not None]
        if len(done) == len(peers):
            return
        if done:
            deadline = min(deadline, time.monotonic() + straggle)
        time.sleep(0.5)


def measure(attack: str, events: list[dict], honest_ids: set[str], steps: int, seconds: float) -> dict:
    commits = [e for e in events if e["event"] == "outer_step_committed"]
    started = [e for e in events if e["event"] == "outer_step_started"]
    by_step: dict[int, set[str]] = {}
    val: dict[int, list[float]] = {}
    for e in commits:
        by_step.setdefault(e["step"], set()).add(e["params_sha256"])
        val.setdefault(e["step"], []).append(e["val_loss"])
    # the run's last step: the highest step that at least two honest peers committed
    common = max([s for s in val if len(val[s]) >= min(2, len(honest_ids))], default=0)
    wrongly = sorted({e["remote"] for e in events if e["event"] in ("contribution_rejected", "peer_excluded")
                      and e.get("remote") in honest_ids})
    rejected = sorted({e["remote"][-8:] for e in events if e["event"] in ("contribution_rejected", "peer_excluded")
                       and e.get("remote") not in honest_ids})
    t_first = min((e["t"] for e in started), default=0.0)
    t_last = max((e["t"] for e in commits), default=t_first)
    return {"event": "bench_redteam_attack", "attack": attack, "honest_committed": len(commits),
            "honest_started": len(started),
            "committed_fraction": round(len(commits) / max(1, len(started)), 4),
            "common_step": common, "reached_all": common >= steps,
            "rate": round(len(commits) / max(1e-9, t_last - t_first), 4),
            "param_forks": sum(len(h) > 1 for h in by_step.values()),
            "wrongly_excluded": len(wrongly), "attackers_rejected": rejected,
            "val_loss": round(statistics.fmean(val[common]), 5) if common in val else None,
            # the honest mean at every step: one step's val loss is noisy at this scale (+-5 %)
            "val_curve": {s: round(statistics.fmean(v), 4) for s, v in sorted(val.items())},
            "seconds": seconds}


def summarize(rows: list[dict]) -> dict:
    base = rows[0]
    worst_prog, worst_val = 1.0, 0.0
    for r in rows[1:]:
        # honest outer steps committed (every honest peer stops at --steps) vs the baseline's
        r["progress_ratio"] = round(r["honest_committed"] / max(1, base["honest_committed"]), 3)
        r["rate_ratio"] = round(r["rate"] / max(1e-9, base["rate"]), 3)
        if r["val_loss"] is not None and base["val_loss"] and r["common_step"] == base["common_step"]:
            r["val_loss_pct"] = round(100 * (r["val_loss"] - base["val_loss"]) / base["val_loss"], 2)
        else:
            r["val_loss_pct"] = None
        both = [s for s in r["val_curve"] if s in base["val_curve"]]
        r["val_curve_pct"] = round(100 * (sum(r["val_curve"][s] for s in both)
                                          / sum(base["val_curve"][s] for s in both) - 1), 2) if both else None
        worst_prog = min(worst_prog, r["progress_ratio"])
        if r["val_loss_pct"] is not None:
            worst_val = max(worst_val, r["val_loss_pct"])
    return {"event": "bench_redteam_summary", "attacks": [r["attack"] for r in rows[1:]],
            "honest_progress_min_ratio": round(worst_prog, 3),
            "honest_param_forks": sum(r["param_forks"] for r in rows),
            "honest_wrongly_excluded": sum(r["wrongly_excluded"] for r in rows),
            "honest_crashed": sum(r.get("honest_crashed", 0) for r in rows),
            "worst_val_loss_pct": round(worst_val, 2),
            "missing_val_loss": [r["attack"] for r in rows[1:] if r["val_loss_pct"] is None]}


def add_arguments(p) -> None:
    p.add_argument("--honest", type=int, default=4, help="honest peers (default 4)")
    p.add_argument("--steps", type=int, default=6, help="outer steps each honest peer commits")
    p.add_argument("--inner-steps", type=int, default=5, metavar="H")
    p.add_argument("--limit", type=float, default=240.0, help="seconds a scenario may take")
    p.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS + CONTROLS)
    p.add_argument("--json", action="store_true", help="JSON lines; the last is the summary")


def run(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-redteam-"))
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    run_dir = init_run(work, args.inner_steps, 3.0, args.honest + 4)
    rows = []
    for attack in ["baseline", *args.attacks]:
        say(f"redteam: {attack} ...")
        r = scenario(work / attack, run_dir, attack, args.honest, args.steps, args.limit, say)
        rows.append(r)
        if not args.json:
            say(json.dumps(r))
    summary = summarize(rows)
    for r in rows:
        if args.json:
            print(json.dumps(r))
    if args.json:
        print(json.dumps({**summary, "logs": str(work)}))
    else:
        for r in rows[1:]:
            print(f"{r['attack']:>12}: progress {r['progress_ratio']:.2f}x, rate {r['rate_ratio']:.2f}x, "
                  f"forks {r['param_forks']}, wrongly excluded {r['wrongly_excluded']}, "
                  f"val loss {r['val_loss_pct']} %, attackers rejected {r['attackers_rejected']}")
        print(json.dumps(summary))
        print(f"logs: {work}")
    ok = summary["honest_param_forks"] == 0 and summary["honest_wrongly_excluded"] == 0 \
        and summary["honest_crashed"] == 0
    return 0 if ok else 1
