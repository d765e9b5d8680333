"""`p2ptrain bench diloco`: does DiLoCo train as well as data-parallel on these CPUs?

One process simulates the M workers in turn (no networking): each DiLoCo worker runs H AdamW
steps on its own data shard (`train_batch` keyed by the worker id), then the pseudo-gradients
are averaged -- exactly (fp32) or through `simulate_ring_mean`, the int8 ring all-reduce
bit-for-bit as the network runs it -- and `OuterOptimizer` applies the Nesterov outer step.

Configurations, all from the same initial model (per seed) and at equal compute per worker:
  single       1 worker, S steps at batch b            (the paper's baseline: 1/M of the tokens)
  single_Mx    1 worker, M*S steps at batch b          (same tokens as everything below, M x time)
  dp           synchronous data-parallel, S steps at batch M*b (the M workers' batches of each
               step, by gradient accumulation); sends a full fp32 gradient every step
  diloco_H*_fp32 / _int8   M workers, S steps each at batch b, outer step every H steps
  diloco_H*_sparse         the same with issue 18's compressed contributions (top-k + 2-bit +
               error feedback, all-gathered; `sparse_mean`) and its own outer lr/momentum
Optionally all of them start from a briefly pre-trained checkpoint (--warm-start steps of one
worker, shared by every configuration of a seed). Overlapped schemes: `diloco_overlap`; merge
rounds of N peers in groups of G against one group (--groups-of G --peers N): `diloco_groups`.
Wire bytes per worker: the ring formula 2 (M-1)/M * payload per all-reduce (payload
quantized_nbytes(n) for int8, 4n for fp32); data-parallel all-reduces fp32 gradients every step;
sparse sends its framed messages to each of the M-1 others (`p2ptrain.reduce.sparse.wire_nbytes`).
Configurations run in separate processes (--jobs) of one thread each by default: on two shared
cores that was faster and far steadier than one two-thread process (OpenMP barriers stall)."""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field

from p2ptrain.bench.diloco_report import _name, _table, print_results, summarize  # noqa: F401 (robust.py)
from p2ptrain.bench import diloco_groups, diloco_overlap
from p2ptrain.bench.diloco_sparse import sparse_mean, sparse_wire_nbytes

DEFAULT_H = (10, 50, 100)


@dataclass
class Settings:
    """Everything a configuration's result depends on (printed with the results)."""
    model: dict = field(default_factory=lambda: dict(d_model=64, n_layers=2, n_heads=2, ffn_hidden=192,
                                                     max_seq_len=64))
    """ModelConfig fields. Default: a 123k-parameter model (the 0.84M 'tiny' preset costs ~10x
    more per step, too much for 50+ worker-runs in 25 minutes on two cores)."""
    data: str = "stdlib"
    workers: int = 4
    steps: int = 1000
    """Inner steps per worker after the warm start."""
    batch: int = 16  # sequences per worker per inner step
    seq_len: int = 64
    inner_lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    warm_start: int = 500
    """Steps of single-worker pre-training shared by every configuration of a seed. From
    scratch, DiLoCo with the paper's outer step lost to a single worker (FACTS.md, and again
    here); after 500 warm steps the same settings match or beat data-parallel (BENCHMARKS.md)."""
    eval_batches: int = 8
    eval_batch: int = 64
    block: int = 16  # int8 sub-block size of the ring (the network's default)
    topk_fraction: float = 0.0369
    """sparse: entries kept per chunk: k = 151 of 4096, the most that stays >= 2000x below
    data-parallel's bytes at H=50 with Elias-Fano offsets (SparseLoCo: 1-3 %)."""
    chunk: int = 4096  # sparse: top-k chunk
    ef_decay: float = 0.8
    """sparse: error-feedback decay beta. Seed-0 sweep at H=50: 0.8 and 0.9 beat SparseLoCo's
    0.95 (1.5151 / 1.5160 vs ~1.52), 1.0 and 0.65 are worse (BENCHMARKS.md)."""
    sparse_outer_lr: float = 2.0
    sparse_outer_momentum: float = 0.5
    """sparse: the best outer step measured at H=50 (3 seeds). With beta 0.8 the error feedback
    forgets part of what it did not send, and a larger outer lr makes up for it (1.5: 0.9 %
    worse, 2.5 worse on seed 0); SparseLoCo's plain 1.0 / 0 and DiLoCo's 0.7 / 0.9 were far worse (BENCHMARKS.md)."""
    overlap_land: float = 1.0
    """Overlapped schemes (issue 17, `diloco_overlap`): the fraction of the next phase done when
    a round's average lands (1.0: the reduce takes a whole phase), their own outer step (None:
    DiLoCo's), eager's stand-in as a multiple of own delta, extra steps per worker ("E0,E1"),
    eager's start point landing this many steps into the phase (`overlap_shift`)."""
    overlap_outer_lr: float | None = None
    overlap_outer_momentum: float | None = None
    eager_scale: float = 1.0
    overlap_extra: str = ""
    overlap_shift: int = 0
    stream_fragments: int = 4
    """streaming (`diloco_stream`): fragments P, start point in flight, final flush round."""
    stream_scheme: str = "eager"
    stream_flush: bool = True

    def __post_init__(self) -> None:
        if self.workers < 2 or self.steps < 1 or self.batch < 1 or self.warm_start < 0 or not 0 <= self.overlap_land <= 1:
            raise ValueError("need workers >= 2, steps >= 1, batch >= 1, warm_start >= 0, 0 <= overlap_land <= 1")


# ----------------------------------------------------------------------------- training
def _optimizer(model, st: Settings, total: int, opt_state=None):
    """AdamW + cosine schedule over `total` steps; continues a warm start's Adam moments."""
    from p2ptrain.train.outer import make_inner_optimizer

    warmup = 0 if opt_state is not None else min(st.warmup, total)
    opt, sched = make_inner_optimizer(model, st.inner_lr, st.weight_decay, warmup, total, "cosine")
    if opt_state is not None:
        opt.load_state_dict(opt_state)
        for g in opt.param_groups:  # the schedule, not the warm phase, sets the lr from here on
            g["lr"] = g["initial_lr"] = st.inner_lr
    return opt, sched


def _step(model, opt, sched, batches) -> float:
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for tokens in batches:  # gradient accumulation: one AdamW step over all micro-batches
        loss = model.loss(tokens) / len(batches)
        loss.backward()
        total += float(loss.detach())
    opt.step()
    sched.step()
    return total


def _start(st: Settings, seed: int, warm):
    from p2ptrain.train.model import ModelConfig, build_model

    model = build_model(ModelConfig(**st.model), seed)
    if warm is None:
        return model, None
    model.load_state_dict(warm["model"])
    return model, copy.deepcopy(warm["opt"])


def warm_start_state(st: Settings, seed: int) -> dict | None:
    """One worker pre-trained for st.warm_start steps (linear warmup, then the peak lr)."""
    if st.warm_start == 0:
        return None
    import torch

    from p2ptrain.train.data import load_dataset, train_batch
    from p2ptrain.train.model import ModelConfig, build_model

    ds = load_dataset(st.data)
    model = build_model(ModelConfig(**st.model), seed)
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": st.weight_decay},
                             {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=st.inner_lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, st.warmup)))
    for s in range(st.warm_start):
        _step(model, opt, sched, [train_batch(ds, b"warm", s, st.batch, st.seq_len, seed)])
    return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}


def _peer(w: int) -> bytes:
    return f"worker-{w}".encode()


def run_config(st: Settings, kind: str, H: int, avg: str, seed: int, warm) -> dict:
    """Train one configuration for one seed; returns its final validation loss and counters."""
    import numpy as np
    import torch

    from p2ptrain.train.data import evaluate, load_dataset, train_batch
    from p2ptrain.kernels import quantized_nbytes, reference, simulate_ring_mean
    from p2ptrain.train.outer import OuterConfig, OuterOptimizer, flatten, unflatten_into

    t0 = time.perf_counter()
    ds = load_dataset(st.data)
    M, S, W = st.workers, st.steps, st.warm_start
    batch = lambda w, s: train_batch(ds, _peer(w), W + s, st.batch, st.seq_len, seed)  # noqa: E731
    model, opt_state = _start(st, seed, warm)
    n = sum(p.numel() for p in model.parameters())
    ring = 2 * (M - 1) / M
    out = {"kind": kind, "H": H, "avg": avg, "seed": seed, "params": n}
    if kind in ("single", "single_Mx"):
        steps = S if kind == "single" else M * S
        opt, sched = _optimizer(model, st, steps, opt_state)
        for s in range(steps):
            _step(model, opt, sched, [batch(0, s)])
        out.update(wire_bytes=0, inner_steps=steps, tokens=steps * st.batch * st.seq_len)
    elif kind == "dp":
        opt, sched = _optimizer(model, st, S, opt_state)
        for s in range(S):
            _step(model, opt, sched, [batch(w, s) for w in range(M)])
        out.update(wire_bytes=round(S * ring * 4 * n), inner_steps=S, tokens=S * M * st.batch * st.seq_len)
    elif kind == "diloco":
        if S % H:
            raise ValueError(f"steps {S} is not a multiple of H {H}")
        models = [model] + [copy.deepcopy(model) for _ in range(M - 1)]
        opts = [_optimizer(m, st, S, opt_state) for m in models]
        sparse = avg == "sparse"
        lr, mom = (st.sparse_outer_lr, st.sparse_outer_momentum) if sparse else (st.outer_lr, st.outer_momentum)
        lr, mom = diloco_overlap.outer_step(st, avg, lr, mom)
        outer = OuterOptimizer(model, OuterConfig(lr, mom, st.nesterov))
        efs = [np.zeros(n, np.float32) for _ in range(M)] if sparse else None
        errs = []
        simulated = diloco_overlap.simulate(st, avg, models, opts, outer, batch, _step, H, S // H)
        out.update(simulated or {})
        for r in range(0 if simulated is not None else S // H):
            for w, (m, (opt, sched)) in enumerate(zip(models, opts)):
                for h in range(H):
                    _step(m, opt, sched, [batch(w, r * H + h)])
            deltas = [outer.outer - flatten(m.parameters()) for m in models]
            exact = torch.stack(deltas).mean(0)
            if avg == "int8":
                # the numpy kernels (bit-identical to numba's): numba's OpenMP pool next to
                # torch's made every later torch step ~10x slower in the same process
                ring_mean = simulate_ring_mean([d.numpy() for d in deltas], st.block, kernels=reference)
                mean = torch.from_numpy(ring_mean)
                errs.append(float((mean - exact).norm() / exact.norm().clamp_min(1e-30)))
            elif sparse:
                mean = torch.from_numpy(sparse_mean([d.numpy() for d in deltas], efs, st))
                errs.append(float((mean - exact).norm() / exact.norm().clamp_min(1e-30)))
            else:
                mean = exact
            outer.step(mean)  # worker 0's model now holds the outer parameters
            for m in models[1:]:
                unflatten_into(outer.outer, list(m.parameters()))
        payload = quantized_nbytes(n, st.block) if avg == "int8" else 4 * n
        # all-gather: each worker sends its messages to each of the M - 1 others; streaming: 1/P each
        per_round = (M - 1) * sparse_wire_nbytes(n, st) if sparse else ring * payload
        out.update(wire_bytes=round(out.get("fragment_rounds", S // H) / out.get("fragments", 1) * per_round),
                   inner_steps=S, outer_steps=S // H, tokens=S * M * st.batch * st.seq_len, outer_sha256=outer.params_sha256()[:16])
        if errs:
            out[f"{avg}_rel_err"] = statistics.fmean(errs)
    else:
        raise ValueError(f"unknown configuration kind {kind!r}")
    out["val_loss"] = evaluate(model, ds, batch=st.eval_batch, seq_len=st.seq_len, max_batches=st.eval_batches)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


# ----------------------------------------------------------------------------- plan
def plan(args, st: Settings) -> list[tuple[str, int, str, int]]:
    """(kind, H, avg, seed) tasks. Seeds: all of them for the baselines and for the DiLoCo H
    values in --seeded-h, the first one elsewhere."""
    seeds = list(range(args.seeds))
    tasks = []
    for s in seeds:
        tasks.append(("dp", 0, "fp32", s))
        tasks.append(("single", 0, "fp32", s))
    if args.single_mx:
        tasks.append(("single_Mx", 0, "fp32", 0))
    for H in args.H:
        for avg in args.avg:
            for s in (seeds if H in args.seeded_h else seeds[:1]):
                tasks.append(("diloco", H, avg, s))
    if args.only:
        keep = set(args.only.split(","))
        tasks = [t for t in tasks if _name(t[0], t[1], t[2], st.workers) in keep]
    cost = {"single": 1, "single_Mx": st.workers}
    return sorted(tasks, key=lambda t: -cost.get(t[0], st.workers))  # long jobs first


def _cost_steps(tasks, st: Settings) -> int:
    per = {"single": st.steps, "single_Mx": st.workers * st.steps}
    return sum(per.get(k, st.workers * st.steps) for k, *_ in tasks) + st.warm_start * len({t[3] for t in tasks})


def _init_worker(threads: int) -> None:
    import torch
    torch.set_num_threads(threads)


def _measure_step_ms(st: Settings, threads: int) -> float:
    import torch

    from p2ptrain.train.data import load_dataset, train_batch
    from p2ptrain.train.model import ModelConfig, build_model

    torch.set_num_threads(threads)
    ds = load_dataset(st.data)
    model = build_model(ModelConfig(**st.model), 0)
    opt, sched = _optimizer(model, st, 100)
    b = train_batch(ds, b"probe", 0, st.batch, st.seq_len, 0)
    _step(model, opt, sched, [b])
    t = time.perf_counter()
    for _ in range(5):
        _step(model, opt, sched, [b])
    return (time.perf_counter() - t) / 5 * 1000


# ----------------------------------------------------------------------------- CLI
def add_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=None, help="inner steps per worker (default 1000)")
    p.add_argument("--seeds", type=int, default=3, help="seeds for the baselines and --seeded-h (default 3)")
    p.add_argument("--H", type=int, nargs="+", default=list(DEFAULT_H), help="DiLoCo sync intervals")
    p.add_argument("--seeded-h", type=int, nargs="*", default=[100], help="H values run with every seed (the others one)")
    p.add_argument("--quick", action="store_true", help="smoke test in about a minute")
    p.add_argument("--batch", type=int, default=None, help="sequences per worker step (default 16)")
    p.add_argument("--workers", type=int, default=4, help="DiLoCo workers M (default 4)")
    p.add_argument("--model", default=None, help="model preset (tiny/small/base) instead of the 123k bench model")
    p.add_argument("--inner-lr", type=float, default=None)
    p.add_argument("--outer-lr", type=float, default=None)
    p.add_argument("--outer-momentum", type=float, default=None)
    p.add_argument("--no-nesterov", action="store_true")
    p.add_argument("--warm-start", type=int, default=None, help="steps of shared single-worker pre-training")
    p.add_argument("--single-mx", action=argparse.BooleanOptionalAction, default=True,
                   help="also run 1 worker for M x steps (same tokens as DP/DiLoCo), one seed")
    p.add_argument("--avg", nargs="+", default=["fp32", "int8", "sparse"],
                   choices=["fp32", "int8", "sparse", *diloco_overlap.SIMULATED],
                   help="DiLoCo averaging schemes (sparse: top-k + 2-bit + error feedback, issue 18; "
                        "delayed/eager/mixed: fp32, overlapped outer steps, issue 17)")
    diloco_overlap.add_arguments(p)  # and streaming's
    diloco_groups.add_arguments(p)
    p.add_argument("--topk-fraction", type=float, default=None)
    p.add_argument("--ef-decay", type=float, default=None)
    p.add_argument("--sparse-outer-lr", type=float, default=None)
    p.add_argument("--sparse-outer-momentum", type=float, default=None)
    p.add_argument("--only", default="", help="comma-separated configuration names to run")
    p.add_argument("--jobs", type=int, default=2, help="configurations run in parallel processes")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default 2 // jobs)")
    p.add_argument("--json", action="store_true", help="JSON lines; the last is the summary")


def settings_from_args(args) -> Settings:
    st = Settings(workers=args.workers)
    if args.quick:
        st.steps, st.batch, st.eval_batches, st.warmup, st.warm_start = 40, 8, 2, 10, 20
    if args.model:
        from p2ptrain.train.model import ModelConfig

        st.model = ModelConfig.preset(args.model).to_dict()
        st.seq_len = st.model["max_seq_len"]
    for name in ("steps", "batch", "inner_lr", "outer_lr", "outer_momentum", "warm_start", "topk_fraction",
                 "ef_decay", "sparse_outer_lr", "sparse_outer_momentum", "overlap_land",
                 "overlap_outer_lr", "overlap_outer_momentum", "eager_scale", "overlap_extra", "overlap_shift",
                 "stream_fragments", "stream_scheme", "stream_flush"):
        if getattr(args, name) is not None:
            setattr(st, name, getattr(args, name))
    if args.no_nesterov:
        st.nesterov = False
    return st


def run(args) -> int:
    st = settings_from_args(args)
    if args.groups_of is not None:  # merge rounds against one group (issue 31): its own report
        return diloco_groups.run(args, st)
    if args.quick:
        args.H = [h for h in (10, 20, 40) if h <= st.steps]
        args.seeded_h, args.seeds = [20], 2
    bad = [h for h in args.H if h < 1 or st.steps % h]
    if bad:
        print(f"error: --steps {st.steps} must be a multiple of every H (not of {bad})", file=sys.stderr)
        return 2
    jobs = max(1, args.jobs)
    threads = args.threads or max(1, 2 // jobs)
    tasks = plan(args, st)
    if not tasks:
        print("error: --only selected no configuration", file=sys.stderr)
        return 2
    say = (lambda obj: print(json.dumps(obj), flush=True)) if args.json else (lambda obj: None)
    log = (lambda s: None) if args.json else (lambda s: print(s, flush=True))
    step_ms = _measure_step_ms(st, threads)
    total = _cost_steps(tasks, st)
    est = total * step_ms / 1000 / min(jobs, len(tasks))
    say({"event": "bench_diloco_plan", "tasks": len(tasks), "worker_steps": total, "step_ms": round(step_ms, 1),
         "jobs": jobs, "threads": threads, "estimate_s": round(est), "settings": asdict(st)})
    log(f"plan: {len(tasks)} runs, {total:,} worker-steps of batch {st.batch}x{st.seq_len} at ~{step_ms:.0f} ms "
        f"-> ~{est / 60:.1f} min on {jobs} job(s) x {threads} thread(s)\nsettings: {asdict(st)}")

    t0 = time.perf_counter()
    seeds = sorted({t[3] for t in tasks})
    results = []
    if jobs == 1:
        _init_worker(threads)
        warm = {s: warm_start_state(st, s) for s in seeds}
        for t in tasks:
            results.append(run_config(st, *t, warm[t[3]]))
            log(f"  {_name(*t[:3], st.workers)} seed {t[3]}: {results[-1]['val_loss']:.4f} ({results[-1]['seconds']} s)")
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                 initargs=(threads,)) as pool:
            warm = dict(zip(seeds, pool.map(warm_start_state, [st] * len(seeds), seeds)))
            futs = {pool.submit(run_config, st, *t, warm[t[3]]): t for t in tasks}
            for f in as_completed(futs):
                results.append(f.result())
                t = futs[f]
                log(f"  {_name(*t[:3], st.workers)} seed {t[3]}: {results[-1]['val_loss']:.4f} ({results[-1]['seconds']} s)")
    rows, summary = summarize(st, results)
    summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
    summary["settings"] = asdict(st)
    print_results(rows, summary, say, args.json, _table)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m p2ptrain.bench.diloco", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
