"""`p2ptrain bench sim`: the protocol in the simulator, over many seeds (issue 30).

    p2ptrain bench sim [--peers N] [--seeds S] [--first-seed K] [--json]   # random worlds
    p2ptrain bench sim --scenario lone_start --seed 3 --trace              # one world, every event
    p2ptrain bench sim --churn 60 [--peers 8] [--seeds 10]                 # churn with period T

Each seed draws a world (`p2ptrain.sim.scenarios.random_world`: 5-300 ms links around a
100 ms median RTT, slow peers, clock skew, late joiners, churn, a partition) and runs the
real peers in it; a quarter as many fault-free worlds measure the committed fraction. The
last JSON line, `bench_sim_summary`, totals the invariant violations (each with its seed:
`--seed S --trace` replays it event for event), the fault-free committed fraction, the most
outer steps any world needed after its last fault to hold one state, and simulated events
per wall second. With `--churn T`, each seed's world kills one peer every T seconds and
restarts it 5 s later (`scenarios.churn`), beside the same world without churn; the summary
sets the committed fraction of the steps started in the churn window against the bound
1 - t_step/T, t_step measured in the worlds without churn. Replays are exact only under one PYTHONHASHSEED (set iteration order), so
this command re-executes itself with PYTHONHASHSEED=0.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def add_arguments(p) -> None:
    p.add_argument("--peers", type=int, default=8, help="peers per world (default 8)")
    p.add_argument("--seeds", type=int, default=20, help="worlds with faults (default 20)")
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--seed", type=int, default=None, help="run this one seed only (replay)")
    p.add_argument("--scenario", default="random",
                   help="random, or a named scenario: lone_start, six_in_threes, restart_pair, selective_sybils, "
                        "selective_six, hot_pair, or an attack: withhold, inflate, expiry, trickle, grind, flood, flood_wide")
    p.add_argument("--no-faults", action="store_true", help="random worlds without faults")
    p.add_argument("--sybils", type=int, default=0, help="adversaries per random world (scripted attacks)")
    p.add_argument("--rtt", type=float, default=0.1, help="median RTT in seconds (default 0.1)")
    p.add_argument("--duration", type=float, default=None, help="simulated seconds per world")
    p.add_argument("--trace", action="store_true", help="print every event of the world (with --seed)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--control", action="store_true",
                   help="with a named scenario: also run each seed with its adversaries honest (the baseline)")
    p.add_argument("--churn", type=float, default=None, metavar="T",
                   help="churn worlds: one peer killed and restarted every T seconds, each beside its calm twin")
    p.add_argument("--json", action="store_true")


def _scenario(name: str, seed: int, peers: int, faults: bool, rtt: float, duration: float | None, sybils: int = 0):
    from p2ptrain.sim import scenarios

    if name.startswith("churn:"):
        return scenarios.churn(seed, peers, float(name[len("churn:"):]), duration=duration or 400.0)
    if name == "random":
        return scenarios.random_world(seed, peers, faults=faults, median_rtt=rtt, duration=duration, sybils=sybils)
    if name.startswith("control:"):
        return scenarios.without_adversaries(_scenario(name[len("control:"):], seed, peers, faults, rtt, duration))
    if name not in scenarios.NAMED:
        raise SystemExit(f"p2ptrain: error: no scenario {name!r} (choose random, {', '.join(scenarios.NAMED)})")
    return scenarios.NAMED[name]()


def _one(job: tuple) -> dict:
    from p2ptrain.sim import scenarios, world

    name, seed, peers, faults, rtt, duration, trace, sybils = job
    sc = _scenario(name, seed, peers, faults, rtt, duration, sybils)
    w = world.World(sc, seed, trace)
    rep = world.simulate(w)
    out = rep.to_dict()
    if name.startswith("churn:"):
        out |= _churn_figures(w, float(name[len("churn:"):]))
    out["describe"] = scenarios.describe(sc)
    out["faults"] = faults
    out["control"] = name.startswith("control:")
    out["median_rtt"] = sc.links.median_rtt
    if trace:
        out["trace"] = rep.trace
    return out


def _churn_figures(w, period: float) -> dict:
    """A churn world's t_step, and the steps started in its churn window (first kill to one
    period after the last) and committed; the calm twin (period inf) gives t_step only."""
    m = w.monitor
    out = {"churn_period": period, "t_step": m.step_time()}
    kills = sorted(down for p in w.sc.peers for down, _ in p.outages)
    if kills:
        started = m.started(kills[0], until=kills[-1] + period)
        out |= {"churn_started": len(started), "churn_committed": sum(k in m.committed for k in started),
                "churn_kills": len(kills)}
    return out


def jobs_for(args) -> list[tuple]:
    """The worlds a command line asks for: one seed (a replay), a named scenario's seeds (and
    their controls), or random worlds -- with faults plus a quarter as many without, or with
    `--no-faults` the fault-free worlds only (before, a sweep ignored the flag)."""
    faults = not args.no_faults
    if args.seed is not None:
        return [(args.scenario, args.seed, args.peers, faults, args.rtt, args.duration, args.trace, args.sybils)]
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    if getattr(args, "churn", None) is not None:
        return [(f"churn:{period}", s, args.peers, True, args.rtt, args.duration, False, 0)
                for s in seeds for period in (args.churn, float("inf"))]
    if args.scenario != "random":
        jobs = [(args.scenario, s, args.peers, True, args.rtt, args.duration, False, 0) for s in seeds]
        return jobs + ([(f"control:{args.scenario}", *job[1:]) for job in jobs] if args.control else [])
    if not faults:
        return [("random", s, args.peers, False, args.rtt, args.duration, False, 0) for s in seeds]
    calm = range(10_000 + args.first_seed, 10_000 + args.first_seed + max(1, args.seeds // 4))
    return ([("random", s, args.peers, True, args.rtt, args.duration, False, args.sybils) for s in seeds]
            + [("random", s, args.peers, False, args.rtt, args.duration, False, 0) for s in calm])


def run(args) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":  # exact replays need one set order
        env = dict(os.environ, PYTHONHASHSEED="0")
        os.execve(sys.executable, [sys.executable, "-m", "p2ptrain", *sys.argv[1:]], env)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    jobs = jobs_for(args)
    t0 = time.perf_counter()
    results = []
    if len(jobs) == 1 or args.workers <= 1:
        it = map(_one, jobs)
    else:
        pool = ProcessPoolExecutor(max_workers=min(args.workers, len(jobs)))
        it = pool.map(_one, jobs)
    for r in it:
        results.append(r)
        for line in r.pop("trace", []):
            print(line, flush=True)
        bad = sum(r["counts"].values())
        say(f"seed {r['seed']:>6} {'(control) ' if r.get('control') else ''}{r['describe']}: {r['events']} events in {r['wall_seconds']:.1f}s, "
            f"committed {r['commit_fraction']:.3f}, converged in {r['steps_to_converge']} steps, "
            f"{bad} violation(s){': ' + '; '.join(v['invariant'] + ' ' + v['detail'] for v in r['violations'][:3]) if bad else ''}"
            + (f"; attack: {json.dumps(r['attack_figures'])}" if r.get("attack_figures") else "")
            + (f"; honest excluded: {r['honest_verdicts']['excluded'][:3]}"
               if r.get("honest_verdicts", {}).get("excluded") else ""))
        if args.json:
            # each peer's final step is too long a list at 1,000 peers; its range says how far the
            # world got (an A/B of two rules compares progress, not only the committed fraction)
            steps = r["final_steps"].values()
            print(json.dumps({"event": "bench_sim_seed", **{k: v for k, v in r.items() if k != "final_steps"},
                              "final_step_min": min(steps, default=0), "final_step_max": max(steps, default=0)}),
                  flush=True)
    wall = time.perf_counter() - t0
    summary = summarize(results, wall)
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        say(json.dumps(summary, indent=1))
    return 0


def attack_figures(results: list[dict]) -> dict:
    """The adversaries' figures over every world that has them: counts summed, fractions and
    means averaged over the worlds that report them (`sim.sybil.Arms.figures`)."""
    keys = sorted({k for r in results for k in r.get("attack_figures", {})})
    out = {}
    for k in keys:
        vals = [r["attack_figures"][k] for r in results if r.get("attack_figures", {}).get(k) is not None]
        if not vals:
            continue
        avg = any(w in k for w in ("fraction", "chance", "mean", "isolable"))
        out[k] = round(sum(vals) / len(vals), 4) if avg else sum(vals)
    return out


def summarize(results: list[dict], wall: float) -> dict:
    from p2ptrain.sim.invariants import NAMES

    control = [r for r in results if r.get("control")]
    twins = [r for r in results if r.get("churn_period") == float("inf")]  # churn's calm twins: t_step
    results = [r for r in results if not r.get("control") and r.get("churn_period") != float("inf")]

    counts = {name: sum(r["counts"][name] for r in results) for name in NAMES}
    calm = [r for r in results if not r["faults"]]
    conv = [r["steps_to_converge"] for r in results if r["faults"] and r.get("settled", True)]
    return {
        "event": "bench_sim_summary",
        "peers_max": max((r["peers"] for r in results), default=0),
        "seeds": len(results),
        "invariant_violations_total": sum(counts.values()),
        **{f"violations_{k}": v for k, v in counts.items()},
        "violating_seeds": sorted({r["seed"] for r in results if sum(r["counts"].values())})[:50],
        "commit_fraction_nofault": round(min((r["commit_fraction"] for r in calm), default=1.0), 4),
        "steps_to_converge_max": (None if any(c is None for c in conv) else max(conv, default=0)),
        "worlds_never_converged": sum(c is None for c in conv),
        "worlds_unsettled": sum(1 for r in results if r["faults"] and not r.get("settled", True)),
        **_after_faults(results),
        "median_rtt_s": results[0].get("median_rtt", 0.1) if results else None,
        "events_per_second": round(sum(r["events"] for r in results) / wall, 1) if wall > 0 else None,
        "attack_figures": attack_figures(results),
        **_verdicts(results),
        "simulated_seconds": sum(r["sim_seconds"] for r in results),
        "wall_seconds": round(wall, 1),
        **(_versus(results, control) if control else {}),
        **(_churn(results, twins) if twins else {}),
    }


def _verdicts(results: list[dict]) -> dict:
    """Honest peers' strikes and exclusions of honest peers, summed (`Monitor.verdicts`)."""
    per = [(r["seed"], r.get("honest_verdicts", {})) for r in results]
    return {"honest_struck": sum(v.get("struck", 0) for _, v in per),
            "honest_excluded": sum(len(v.get("excluded", ())) for _, v in per),
            "honest_excluded_seeds": sorted({s for s, v in per if v.get("excluded")})[:50]}


def _churn(churned: list[dict], calm: list[dict]) -> dict:
    """Churn against its bound (issue 31): the fraction of the steps honest peers started in
    the churn windows that they committed, pooled, against 1 - t_step/T, where t_step is the
    median step time of the same worlds without churn; and the run's progress against theirs."""
    import statistics

    period = churned[0]["churn_period"]
    t_step = statistics.median([r["t_step"] for r in calm if r.get("t_step")] or [float("nan")])
    started = sum(r.get("churn_started", 0) for r in churned)
    frac = sum(r.get("churn_committed", 0) for r in churned) / started if started else None
    bound = 1 - t_step / period
    return {"churn_period_s": period, "churn_kills": sum(r.get("churn_kills", 0) for r in churned),
            "t_step_s": round(t_step, 2), "churn_commit_fraction": None if frac is None else round(frac, 4),
            "churn_commit_fraction_min": round(min(r["churn_committed"] / r["churn_started"] for r in churned
                                                   if r.get("churn_started")), 4) if started else None,
            "churn_bound": round(bound, 4),
            "churn_ratio": None if frac is None else round(frac / bound, 3),
            # what churn costs the run in time: its newest step at the end against the twins'
            "churn_progress_ratio": round(_newest_step_mean(churned) / max(1e-9, _newest_step_mean(calm)), 3)}


def _newest_step_mean(rs: list[dict]) -> float:
    """The newest step any peer of a world reached, averaged over the worlds."""
    return sum(max(r["final_steps"].values(), default=0) for r in rs) / max(1, len(rs))


def _after_faults(results: list[dict]) -> dict:
    """Liveness once faults ended (`sim.world.Report.after_faults`): honest steps started
    after the live honest peers first held one state again, over the worlds that had faults
    and no adversaries; the pooled fraction committed, and the worst world's."""
    got = [tuple(r["after_faults"]) for r in results if r.get("after_faults") and r["after_faults"][1]]
    # Held one state once the faults ended, then started no step: a stall no invariant flags
    # (seed 126833: every peer a joiner of one step, rule E19).
    idle = sorted(r["seed"] for r in results if r.get("after_faults") and not r["after_faults"][1])
    if not got:
        return {"idle_after_faults_seeds": idle} if idle else {}
    return {"commit_fraction_after_faults": round(sum(c for c, _ in got) / sum(n for _, n in got), 4),
            "commit_fraction_after_faults_min": round(min(c / n for c, n in got), 4),
            "worlds_after_faults": len(got), "idle_after_faults_seeds": idle}


def _versus(attacked: list[dict], control: list[dict]) -> dict:
    """The same worlds with their adversaries honest (`--control`): the baseline, and ratios."""
    from p2ptrain.sim.invariants import NAMES

    top = _newest_step_mean

    def frac(rs: list[dict]) -> float:
        return sum(r["commit_fraction"] for r in rs) / max(1, len(rs))

    return {"control_seeds": len(control),
            "control_violations_total": sum(sum(r["counts"][n] for n in NAMES) for r in control),
            "control_violating_seeds": sorted({r["seed"] for r in control if sum(r["counts"].values())}),
            "newest_step_mean": round(top(attacked), 2), "control_newest_step_mean": round(top(control), 2),
            "newest_step_ratio": round(top(attacked) / top(control), 3) if top(control) else None,
            "commit_fraction_mean": round(frac(attacked), 4), "control_commit_fraction_mean": round(frac(control), 4)}
