"""`p2ptrain bench robust`: DiLoCo with poisoned contributions, plain mean vs robust aggregation.

Like `bench diloco`, one process simulates the workers in turn (6 by default) on the embedded
data, from a shared warm start. After every H inner steps the pseudo-gradients are combined by
  mean     the int8 ring all-reduce, bit for bit as the network runs it (simulate_ring_mean)
  robust   the butterfly reduce-scatter of `aggregation = "robust"` runs, bit for bit as the
           network runs it (`p2ptrain.reduce.butterfly.simulate`: each owner decodes every member's
           int8 chunk, applies CenteredClip, quantizes once)
with 0, 1 or 2 of the workers attacking every round:
  signflip  trains honestly, sends -10 x its pseudo-gradient
  noise     sends Gaussian noise whose norm is 10 x the honest members' mean norm
  zeros     free-rides: sends zeros (and trains nothing)
Honest worker w sees the same batches in every configuration, so the configurations differ
only in the aggregation and the attack. The goal: robust with 2 attackers ends within 3 % of
the honest-only (plain mean, no attacker) validation loss; the plain mean's damage is shown
beside it. Also counted: how often `robust.flagged` (the reputation rule) names an attacker
and how often an honest worker.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict

from p2ptrain.bench.diloco import Settings, _optimizer, _peer, _start, _step, print_results, warm_start_state

ATTACKS = ("signflip", "noise", "zeros")
RULES = ("mean", "robust")


def default_settings() -> Settings:
    # bench diloco's 123k-parameter model and warm start, shortened to fit a few minutes.
    return Settings(workers=6, steps=100, batch=8, warm_start=300, warmup=20, eval_batches=8)


def _init_worker(threads: int) -> None:
    os.environ["P2PTRAIN_KERNELS"] = "numpy"  # numba's OpenMP pool slows torch ~10x (bench diloco)
    import torch

    torch.set_num_threads(threads)


def run_config(st: Settings, H: int, rule: str, attack: str, n_bad: int, seed: int, warm) -> dict:
    """One configuration: the last `n_bad` workers attack. Returns its validation loss."""
    import numpy as np
    import torch

    from p2ptrain.reduce import butterfly
    from p2ptrain.reduce import robust
    from p2ptrain.train.data import evaluate, load_dataset, train_batch
    from p2ptrain.kernels import reference, simulate_ring_mean
    from p2ptrain.run.contribution import trained_scale
    from p2ptrain.train.outer import OuterConfig, OuterOptimizer, flatten, unflatten_into
    from p2ptrain.reduce.ring import RingConfig

    t0 = time.perf_counter()
    ds = load_dataset(st.data)
    M, S, W = st.workers, st.steps, st.warm_start
    model, opt_state = _start(st, seed, warm)
    bad = set(range(M - n_bad, M))
    trains = [w for w in range(M) if w not in bad or attack == "signflip"]
    models = {w: (model if w == 0 else copy.deepcopy(model)) for w in trains}  # worker 0 is honest
    opts = {w: _optimizer(m, st, S, opt_state) for w, m in models.items()}
    outer = OuterOptimizer(model, OuterConfig(st.outer_lr, st.outer_momentum, st.nesterov))
    rng = np.random.default_rng([seed, n_bad, len(attack)])
    cfg = RingConfig(block=st.block)
    flags = {"attacker": 0, "honest": 0}
    diverged = False
    for r in range(S // H):
        for w in trains:
            m, (opt, sched) = models[w], opts[w]
            for h in range(H):
                _step(m, opt, sched, [train_batch(ds, _peer(w), W + r * H + h, st.batch, st.seq_len, seed)])
        honest = {w: (outer.outer - flatten(models[w].parameters())).numpy() for w in trains}
        ref = float(np.mean([np.linalg.norm(honest[w]) for w in range(M) if w not in bad]))
        deltas = []
        for w in range(M):
            if w not in bad:
                deltas.append(honest[w])
            elif attack == "signflip":
                deltas.append((-10 * honest[w]).astype(np.float32))
            elif attack == "noise":
                z = rng.standard_normal(outer.numel)
                deltas.append((z * (10 * ref / np.linalg.norm(z))).astype(np.float32))
            else:
                deltas.append(np.zeros(outer.numel, np.float32))
        if rule == "mean":
            avg = simulate_ring_mean(deltas, st.block, kernels=reference)
            # as a round commits it: the mean over those that sent anything (free-riders' zeros
            # do not shorten the step: ContributionRound, contribution.trained_scale)
            avg = avg * np.float32(trained_scale((float(d.any()) for d in deltas), M))
        else:
            avg, rows = butterfly.simulate(deltas, cfg, robust.RobustConfig())
            for i in robust.flagged(rows):
                flags["attacker" if i in bad else "honest"] += 1
        try:
            outer.step(torch.from_numpy(np.ascontiguousarray(avg)))
        except ValueError:  # inf/NaN: the plain mean blew up
            diverged = True
            break
        for w in trains:
            if w != 0:
                unflatten_into(outer.outer, list(models[w].parameters()))
    val = float("inf") if diverged else evaluate(model, ds, batch=st.eval_batch, seq_len=st.seq_len,
                                                   max_batches=st.eval_batches)
    if not np.isfinite(val):
        diverged, val = True, float("inf")
    return {"rule": rule, "attack": attack, "attackers": n_bad, "seed": seed, "val_loss": val,
            "diverged": diverged, "outer_steps": S // H, "flags": flags, "seconds": round(time.perf_counter() - t0, 1)}


def plan(args) -> list[tuple[str, str, int, int]]:
    tasks = []
    for s in range(args.first_seed, args.first_seed + args.seeds):
        for rule in RULES:
            tasks.append((rule, "none", 0, s))
            for attack in args.attacks:
                for k in (1, 2):
                    tasks.append((rule, attack, k, s))
    return tasks


def add_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=None, help="inner steps per worker (default 100)")
    p.add_argument("--H", type=int, default=10, help="inner steps per outer step (default 10)")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--first-seed", type=int, default=0, help="seeds run: first-seed .. first-seed + seeds - 1")
    p.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    p.add_argument("--warm-start", type=int, default=None, help="shared single-worker pre-training steps")
    p.add_argument("--quick", action="store_true", help="smoke test (seconds; the figures mean nothing)")
    p.add_argument("--jobs", type=int, default=2, help="configurations run in parallel processes")
    p.add_argument("--json", action="store_true", help="JSON lines; the last is the summary")


def summarize(results: list[dict]) -> tuple[list[dict], dict]:
    by: dict[tuple, list[dict]] = {}
    for r in results:
        by.setdefault((r["rule"], r["attack"], r["attackers"]), []).append(r)
    mean = {k: statistics.fmean(x["val_loss"] for x in v) for k, v in by.items()}
    base = mean.get(("mean", "none", 0))
    rows = []
    for attack, k in sorted({(a, n) for _, a, n in by}, key=lambda t: (t[1], t[0])):
        row = {"event": "bench_robust_config", "attack": attack, "attackers": k}
        for rule in RULES:
            v = mean.get((rule, attack, k))
            if v is None:
                continue
            row[f"{rule}_val_loss"] = round(v, 4) if v != float("inf") else None
            row[f"{rule}_vs_honest_pct"] = round(100 * (v / base - 1), 2) if base and v != float("inf") else None
            row[f"{rule}_diverged"] = any(x["diverged"] for x in by[(rule, attack, k)])
        rb = by.get(("robust", attack, k), [])
        row["flagged_attackers"] = sum(x["flags"]["attacker"] for x in rb)
        row["flagged_honest"] = sum(x["flags"]["honest"] for x in rb)
        rows.append(row)
    two = [r for r in rows if r["attackers"] == 2 and r.get("robust_vs_honest_pct") is not None]
    summary = {"event": "bench_robust_summary", "honest_val_loss": round(base, 4) if base else None,
               "robust_honest_val_loss": round(mean[("robust", "none", 0)], 4) if ("robust", "none", 0) in mean else None,
               "worst_robust_2_attackers_pct": max((r["robust_vs_honest_pct"] for r in two), default=None),
               "goal_robust_2_attackers_within_3pct": bool(two) and all(r["robust_vs_honest_pct"] <= 3.0 for r in two),
               "worst_mean_2_attackers_pct": max((r["mean_vs_honest_pct"] if r["mean_vs_honest_pct"] is not None
                                                  else float("inf") for r in rows if r["attackers"] == 2), default=None),
               "flagged_honest_total": sum(r["flagged_honest"] for r in rows)}
    if summary["worst_mean_2_attackers_pct"] == float("inf"):
        summary["worst_mean_2_attackers_pct"] = "diverged"
    return rows, summary


def _table(rows: list[dict]) -> str:
    def cell(r, rule):
        if r.get(f"{rule}_diverged"):
            return f"{'diverged':>17}"
        v, p = r.get(f"{rule}_val_loss"), r.get(f"{rule}_vs_honest_pct")
        return f"{v:>8.4f} ({p:+6.1f}%)" if v is not None else f"{'-':>17}"

    lines = [f"{'attack':<9} {'attackers':>9} {'plain mean':>17} {'robust':>17} {'flagged (attacker/honest)':>26}"]
    for r in rows:
        lines.append(f"{r['attack']:<9} {r['attackers']:>9} {cell(r, 'mean')} {cell(r, 'robust')} "
                     f"{r['flagged_attackers']:>16}/{r['flagged_honest']}")
    return "\n".join(lines)


def run(args) -> int:
    os.environ["P2PTRAIN_KERNELS"] = "numpy"
    st = default_settings()
    st.workers = args.workers
    if args.quick:
        st.steps, st.warm_start, st.eval_batches, args.H = 20, 10, 2, 10
    if args.steps is not None:
        st.steps = args.steps
    if args.warm_start is not None:
        st.warm_start = args.warm_start
    if args.workers < 3 or st.steps % args.H:
        print("error: need --workers >= 3 and --steps a multiple of --H", file=sys.stderr)
        return 2
    say = (lambda obj: print(json.dumps(obj), flush=True)) if args.json else (lambda obj: None)
    log = (lambda s: None) if args.json else (lambda s: print(s, flush=True))
    tasks = plan(args)
    say({"event": "bench_robust_plan", "tasks": len(tasks), "H": args.H, "settings": asdict(st)})
    log(f"plan: {len(tasks)} runs of {st.workers} workers x {st.steps} steps (H={args.H}), warm start "
        f"{st.warm_start}\nsettings: {asdict(st)}")
    t0 = time.perf_counter()
    import multiprocessing as mp

    results = []
    with ProcessPoolExecutor(max(1, args.jobs), mp_context=mp.get_context("spawn"), initializer=_init_worker,
                             initargs=(1,)) as pool:
        seeds = sorted({t[3] for t in tasks})
        warm = dict(zip(seeds, pool.map(warm_start_state, [st] * len(seeds), seeds)))
        futs = {pool.submit(run_config, st, args.H, *t[:3], t[3], warm[t[3]]): t for t in tasks}
        for f in as_completed(futs):
            r = f.result()
            results.append(r)
            log(f"  {r['rule']:<6} {r['attack']:<8} x{r['attackers']} seed {r['seed']}: {r['val_loss']:.4f} "
                f"({r['seconds']} s)")
    rows, summary = summarize(results)
    summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
    summary["H"] = args.H
    summary["settings"] = asdict(st)
    print_results(rows, summary, say, args.json, _table)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m p2ptrain.bench.robust", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
