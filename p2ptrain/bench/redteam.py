"""`p2ptrain bench redteam`: a real run attacked one attack at a time (issues 15 and 32).

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
 Issue 32's attacks (hostile join processes: p2ptrain/bench/adversary.py; record writers and
 requesters: p2ptrain/bench/squatter.py):
  selective       2 Sybils join; Sybil j sends round control traffic (roster confirmations,
                  headers, votes) only to honest peer j and the other Sybil, and resets every
                  control stream anyone else opens to it
  inflate         2 Sybils join and name a pool of 6 Sybil identities (4 never run) in every
                  roster confirmation they send, each view hashed as an honest one
  expiry          from before the honest peers start, a squatter re-stores a ready record for
                  the current and next step every 5 s, 8 s expiry, ready time 10 minutes
                  early; it serves no rounds
  eclipse         before the honest peers start, a squatter stores 5 ~60 KiB records under each
                  of the next 3 `ready/<t>` keys (and keeps 3 steps ahead)
  provider        the last honest peer joins late, after a squatter copied the newest honest
                  provider record under 2 identities whose peer ids sort first, on hosts that
                  accept the fetch stream and never answer
  slot            the last honest peer joins late, after one squatter identity holds 8 requests
                  read at 1 KiB/s (reopened as they end) at every donor of the newest checkpoint
  slowloris       one member trains honestly but sends every bulk frame a byte per 0.1 s
  trickle         one member trains honestly but is silent 0.9 x the frame timeout before each
                  bulk frame, then sends it whole: within every frame rule, so its rounds
                  close at their data budget with nobody blamed (leave-one-out must find it)
  reputation      on a run of its own with `--aggregation robust` (measured against that
                  run's own baseline, `baseline-robust`): 2 Sybil identities publish reports
                  naming every honest peer, refreshed every 5 s; `not_applicable` in the
                  summary when a robust run cannot be made
  sybil-kK        K = 4 or 8 identities join and each sends -2.5 x its pseudo-gradient from
                  its first step, header true to it: within the probation bound (3 x each
                  honest anchor) and the 10x-median rule (issue 32 item 9; `ANTI_SCALE`)
  late-honest     (a control, only when named) provider's and slot's late join, no attacker:
                  provider and slot are measured against it when it ran (in all three the
                  first H-1 peers commit STEPS + 20 steps, the newcomer STEPS)
Groups hold up to H + 8 members (sybil-k8 can share a group with all honest peers).
Per scenario: honest outer steps committed (each honest peer stops after STEPS; a peer left
alone after the others finished gets 30 s more) vs the baseline's (`progress_ratio`; the goal
is >= 0.8), the fraction of started steps that committed, the honest commit rate vs the baseline's
(`rate_ratio`: on 2 shared cores the attackers' own training steals CPU, so this one mixes
protocol harm with plain load), steps where honest peers committed different params
(`param_forks`), honest peers rejected by honest peers (`wrongly_excluded`), and the honest
peers' validation loss at the run's last step (the highest step at least two honest peers
committed) vs the baseline's at the same step (`val_loss_pct`), and over every step both
committed (`val_curve_pct`: the mean of the honest per-step means vs the baseline's).
For provider and slot, `newcomer` says when the late peer started, what it fetched and when it
first committed. The last JSON line is `bench_redteam_summary`: the worst ratios over the
attacks (controls excluded), `sybil_k4_val_loss_pct` and `sybil_k8_val_loss_pct` (None when not
run), and `not_applicable`. Figures are from a noisy shared machine.
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
           "withhold", "garbage", "dropfwd", "selective", "inflate", "expiry", "eclipse", "provider", "slowloris",
           "trickle", "slot", "reputation", "sybil-k4", "sybil-k8")
# Not attacks, not in the default list: one more plain `join` process with its own identity
# (the same process the attacks build, with no hostile part), so an attack that joins the
# group (dropfwd) can be told apart from the effect of a 4th honest member; and the late
# joiner's run with no attacker (what provider and slot are measured against, when named).
CONTROLS = ("extra-honest", "late-honest")
# Attacks on a newcomer: the last honest peer joins once the attacker is in place and a step
# committed, so it must fetch a checkpoint; the others start with --min-peers H-1.
LATE = ("provider", "slot", "late-honest")
LATE_EXTRA = 20
"""In those, the first peers commit STEPS + LATE_EXTRA steps (the newcomer STEPS): they are
still training when it arrives (its start takes 10-20 s on a loaded machine, a tiny step 1-2 s)."""
# Attacks by a record writer or requester process (p2ptrain/bench/squatter.py), and whether
# it must be in place before the honest peers start (it writes under keys they will read).
SQUATTERS = {"expiry": True, "eclipse": True, "provider": False, "slot": False, "reputation": False}
# Sybil pool sizes: inflate runs 2 Sybils that name a pool of 6 (4 never run: names are free).
INFLATE_RUNNING, INFLATE_POOL = 2, 6


def init_run(work: Path, inner_steps: int, window: float, group: int, aggregation: str = "mean",
             name: str = "run") -> tuple[Path, str]:
    out = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "init", "--out", str(work / name), "--key", str(work / "init.key"),
         "--preset", "tiny", "--inner-steps", str(inner_steps), "--batch-size", "4", "--seq-len", "64",
         "--warmup", "5", "--planned-outer-steps", "100", "--join-window", str(window),
         "--group-size", str(group), "--seed", "11", "--aggregation", aggregation],
        capture_output=True, text=True, timeout=300, cwd=work)
    if out.returncode != 0:
        raise RuntimeError(f"p2ptrain init failed: {out.stderr.strip()[-500:]}")
    return work / name, out.stdout.strip().splitlines()[-1]


def peer_ids(where: Path, names: list[str]) -> list[str]:
    """The peer ids of the keys `where/NAME.key` (created now if absent: join loads them)."""
    from p2ptrain.identity import Identity, load_or_create

    out = []
    for n in names:
        if n.startswith("free"):  # a pool member that never runs: a name costs nothing
            out.append(Identity.generate().peer_id_str)
        else:
            out.append(load_or_create(where / f"{n}.key").peer_id_str)
    return out


def hostile_modes(attack: str, work: Path, keys: Path) -> list[str]:
    """The adversary join processes' modes for `attack` (one per process, keys a0, a1, ...)."""
    if attack == "selective":  # Sybil j talks to honest member j and the other Sybil only
        h, a = peer_ids(keys, ["h0", "h1"]), peer_ids(work, ["a0", "a1"])
        return [f"selective:{h[0]},{a[1]}", f"selective:{h[1]},{a[0]}"]
    if attack == "inflate":
        running = [f"a{j}" for j in range(INFLATE_RUNNING)]
        pool = peer_ids(work, running + [f"free{j}" for j in range(INFLATE_POOL - INFLATE_RUNNING)])
        return ["inflate:" + ",".join(pool)] * INFLATE_RUNNING
    if attack.startswith("sybil-k"):
        return ["anti"] * int(attack[len("sybil-k"):])
    if attack.startswith("sybil-"):
        return ["sybil"] * int(attack.split("-")[1])
    if attack in ("early-ready", "chunknorm", "replay", "forge", "nan", "norm", "withhold", "dropfwd", "extra-honest",
                  "slowloris", "trickle"):
        return [attack]
    return []


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
        hostile = []
        if attack == "plant":
            planter = group.start([str(run[0]), "--run", run[1], "--bootstrap", baddr, "--sybils", "2"], "planter",
                                  module="p2ptrain.bench.planter")
            planter.wait_event(lambda e: e.get("event") == "planted", 90)
        placed = work / "attacker.ready"

        def squat() -> None:
            hostile.append(group.start([attack, "--run", run[1], "--bootstrap", baddr, "--ready-file", str(placed)],
                                       "a0", module="p2ptrain.bench.squatter"))
        if SQUATTERS.get(attack):  # in place before anyone reads those keys
            squat()
            _wait_file(placed, hostile[0], 60)
        late = attack in LATE
        early = honest - 1 if late else honest
        mine = ["--max-outer-steps", str(steps), "--min-peers", str(early)]
        # the first peers train on while the newcomer starts and catches up (its own STEPS)
        theirs = ["--max-outer-steps", str(steps + LATE_EXTRA), "--min-peers", str(early)] if late else mine
        peers = [group.start(_join(baddr, run, work, f"h{i}", i == 0, theirs, run[0].parent), f"h{i}")
                 for i in range(early)]
        if attack in SQUATTERS and not SQUATTERS[attack]:
            squat()
        # dropfwd and its control share one key: same data windows, they differ only by the drops
        keys = run[0].parent if attack in ("dropfwd", "extra-honest") else None
        hostile += [group.start([mode, *_join(baddr, run, work, f"a{j}", False, [], keys)], f"a{j}",
                                module="p2ptrain.bench.adversary")
                    for j, mode in enumerate(hostile_modes(attack, work, run[0].parent))]
        if attack == "garbage":  # bounded: 400 streams over 20 s, to every peer it finds
            hostile = [group.start(["garbage", "--bootstrap", baddr, "--count", "400", "--seconds", "20"], "a0",
                                   module="p2ptrain.bench.attacker")]
        late_t0 = None
        if late:  # the newcomer: once a step committed (so it must catch up) and the attacker is in place
            if attack != "late-honest":
                _wait_file(placed, hostile[0], limit / 2)
            _wait_commit(peers, t0 + limit / 2)
            late_t0 = time.monotonic()
            peers.append(group.start(_join(baddr, run, work, f"h{early}", False, mine, run[0].parent), f"h{early}"))
        wait_for(peers, t0 + limit, straggle=30.0)
        honest_ids = {e["peer"] for p in peers for e in p.all_events if "peer" in e}
        events = [e for p in peers for e in p.all_events]
        # the attacker's last report (it reports as it goes: the run may end before it does)
        said = [{k: v for k, v in e.items() if k != "event"} for h in hostile
                for e in h.all_events if str(e.get("event", "")).startswith("attacker_")][-1:]
        crashed = sum(p.proc.returncode not in (None, 0) for p in peers)
        newcomer = peers[-1].all_events if late else []
    row = measure(attack, events, honest_ids, steps, round(time.monotonic() - t0, 1))
    row["honest_crashed"] = crashed
    if late:  # what the attack on newcomers costs the newcomer
        first = min((e["t"] for e in newcomer if e["event"] == "outer_step_committed"), default=None)
        row["newcomer"] = {"started_after_s": round(late_t0 - t0, 1),
                           "checkpoint_fetched": [{k: e.get(k) for k in ("step", "seconds", "excluded") if k in e}
                                                  for e in newcomer if e["event"] == "checkpoint_fetched"],
                           "committed": sum(e["event"] == "outer_step_committed" for e in newcomer),
                           "first_commit_t": first}
    if said:
        row["attacker"] = said[0]
    return row


def _wait_file(path: Path, proc, seconds: float) -> bool:
    """Until the attacker wrote `path` (it is in place), it died, or `seconds` passed."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not path.exists() and proc.proc.poll() is None:
        time.sleep(0.5)
    return path.exists()


def _wait_commit(peers, deadline: float) -> None:
    while time.monotonic() < deadline and not any(e.get("event") == "outer_step_committed"
                                                  for p in peers for e in p.all_events):
        time.sleep(0.5)


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


def _base_of(r: dict, rows: list[dict]) -> dict:
    """What a row is measured against: its `baseline` row when it names one (reputation: the
    robust run's own baseline), the late joiner's control for attacks on a newcomer when it
    ran, else the first row."""
    named = {x["attack"]: x for x in rows}
    if r["attack"] in LATE and r["attack"] != "late-honest" and "late-honest" in named:
        return named["late-honest"]
    return named.get(r.get("baseline", ""), rows[0])


def summarize(rows: list[dict]) -> dict:
    worst_prog, worst_val = 1.0, 0.0
    measured = [r for r in rows[1:] if not r.get("not_applicable") and not r["attack"].startswith("baseline")]
    for r in measured:
        base = _base_of(r, rows)
        r["measured_against"] = base["attack"]
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
        if r["attack"] in CONTROLS:  # not attacks: they tell structure apart from harm
            continue
        worst_prog = min(worst_prog, r["progress_ratio"])
        if r["val_loss_pct"] is not None:
            worst_val = max(worst_val, r["val_loss_pct"])
    by = {r["attack"]: r for r in measured}
    return {"event": "bench_redteam_summary", "attacks": [r["attack"] for r in rows[1:]
                                                          if not r["attack"].startswith("baseline")],
            "honest_progress_min_ratio": round(worst_prog, 3),
            "honest_param_forks": sum(r.get("param_forks", 0) for r in rows),
            "honest_wrongly_excluded": sum(r.get("wrongly_excluded", 0) for r in rows),
            "honest_crashed": sum(r.get("honest_crashed", 0) for r in rows),
            "worst_val_loss_pct": round(worst_val, 2),
            **{f"sybil_k{k}_val_loss_pct": by[f"sybil-k{k}"]["val_loss_pct"] if f"sybil-k{k}" in by else None
               for k in (4, 8)},
            "missing_val_loss": [r["attack"] for r in measured if r["val_loss_pct"] is None],
            "not_applicable": {r["attack"]: r["not_applicable"] for r in rows if r.get("not_applicable")}}


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
    # groups big enough for the honest peers and the largest Sybil crowd (sybil-k8) at once
    group = args.honest + 8
    run_dir = init_run(work, args.inner_steps, 3.0, group)
    rows = []

    def one(attack: str, where, **extra) -> None:
        say(f"redteam: {attack} ...")
        r = {**scenario(work / attack, where, attack, args.honest, args.steps, args.limit, say), **extra}
        rows.append(r)
        if not args.json:
            say(json.dumps(r))

    for attack in ["baseline", *(a for a in args.attacks if a != "reputation")]:
        one(attack, run_dir)
    if "reputation" in args.attacks:  # reports are read in robust runs only: its own run and baseline
        try:
            robust = init_run(work, args.inner_steps, 3.0, group, aggregation="robust", name="run-robust")
        except RuntimeError as exc:
            rows.append({"event": "bench_redteam_attack", "attack": "reputation", "not_applicable": str(exc)[-300:]})
        else:
            one("baseline-robust", robust)
            one("reputation", robust, baseline="baseline-robust")
    summary = summarize(rows)
    for r in rows:
        if args.json:
            print(json.dumps(r))
    if args.json:
        print(json.dumps({**summary, "logs": str(work)}))
    else:
        for r in rows[1:]:
            if "progress_ratio" not in r:
                continue
            print(f"{r['attack']:>12}: progress {r['progress_ratio']:.2f}x, rate {r['rate_ratio']:.2f}x, "
                  f"forks {r['param_forks']}, wrongly excluded {r['wrongly_excluded']}, "
                  f"val loss {r['val_loss_pct']} %, attackers rejected {r['attackers_rejected']}")
        print(json.dumps(summary))
        print(f"logs: {work}")
    ok = summary["honest_param_forks"] == 0 and summary["honest_wrongly_excluded"] == 0 \
        and summary["honest_crashed"] == 0
    return 0 if ok else 1
