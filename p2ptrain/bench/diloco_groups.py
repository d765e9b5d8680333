"""Merge rounds in `bench diloco`'s simulation (issue 31's quality must-show).

N peers, each holding its own committed outer state (params x_i, Nesterov momentum m_i,
work w_i; all start at the genesis: the same x, m = 0, w = 0). Each outer step t every peer
runs H AdamW steps from x_i on its own data (`train_batch` keyed by its id, as `bench diloco`'s
workers) and computes d_i = x_i - local_i. The peers are then dealt into ceil(N / G) groups,
redrawn every step (Moshpit SGD): sorted by sha256(f"{seed}|{t}|" + peer id), cut into
consecutive slices of G. Each group commits `merge_round` of its members' states with g =
the fp32 mean of its members' d_i: the product's merge (rule M1 of docs/PROTOCOL.md,
`p2ptrain.run.merge`: each member's base weighted by the members that trained the round that
made it, capped at G; float64 accumulation in base-hash order), then the Nesterov step as
`OuterOptimizer.step` takes it, and every member loads the result.

The baseline is one group of N, the same code with G = N: k == 1 always, so it is `bench
diloco`'s synchronous fp32 DiLoCo with N workers bit for bit (members averaged in peer order;
tests/test_diloco_groups.py). Same tokens, seeds, warm start and outer lr / momentum.

Reported per seed: the mean over peers of their final states' validation loss and its spread
(min, max), the loss of the peers' mean state, the one-group loss, and the percent difference;
and per outer step the number of distinct states and their spread (mean distance to the peers'
mean state, against how far that mean moved in the step).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

GOAL_PCT = 1.0


@dataclass(frozen=True)
class OuterState:
    """One peer's committed outer state: flat fp32 params and momentum (host), and its merge
    weight (the members that trained the round that produced it; 0 for the genesis)."""
    params: object  # torch.Tensor (torch is imported where it runs: the CLI starts fast)
    momentum: object
    weight: int = 0

    def params_sha256(self) -> str:
        from p2ptrain.run.merge import params_hash

        return params_hash(self.params.numpy())


def nesterov_update(params, momentum, g, lr: float, mu: float, nesterov: bool = True):
    """DiLoCo's outer step on copies, with exactly the operations of `OuterOptimizer.step`."""
    import torch

    x, buf = params.clone(), momentum.clone()
    if mu > 0:
        buf.mul_(mu).add_(g)                                # m' = mu * m + g
        d = torch.mul(buf, mu).add_(g) if nesterov else buf
    else:
        d = g
    x.sub_(torch.mul(d, lr))                                # x' = x - lr * d
    return x, buf


def merge_round(states, avg_pseudo_grad, trained: int, lr: float, mu: float, nesterov: bool = True,
                group_size: int | None = None) -> OuterState:
    """The state every member of a round commits: the members' bases merged as the product
    merges them (`p2ptrain.run.merge.plan` and `combine`; one base: nothing averaged), then
    the Nesterov step with the members' mean pseudo-gradient."""
    import torch

    from p2ptrain.run import merge

    g = avg_pseudo_grad.detach().to("cpu", torch.float32).reshape(-1)
    if not bool(torch.isfinite(g).all()):
        raise ValueError("pseudo-gradient holds inf or NaN; refusing to apply it")
    hashes = [s.params_sha256() for s in states]
    p = merge.plan({f"m{i:06d}": (h, s.weight) for i, (h, s) in enumerate(zip(hashes, states))},
                   group_size or len(states))
    if not p.needed:
        x_bar, m_bar = states[0].params, states[0].momentum
    else:
        by = {h: (s.params.numpy(), s.momentum.numpy()) for h, s in zip(hashes, states)}
        x, m = merge.combine(p, by)
        x_bar, m_bar = torch.from_numpy(x), torch.from_numpy(m)
    x, m = nesterov_update(x_bar, m_bar, g, lr, mu, nesterov)
    return OuterState(x, m, trained)


def add_arguments(p) -> None:
    p.add_argument("--groups-of", type=int, default=None, metavar="G",
                   help="merge rounds (issue 31): --peers N peers in groups of G redrawn every outer step, "
                        "against one group of N; one H (default 100)")
    p.add_argument("--peers", type=int, default=16, help="with --groups-of: peers N (default 16)")


def deal_groups(seed: int, t: int, peers: list[bytes], G: int) -> list[list[int]]:
    """Step t's groups: peer indices sorted by sha256(f"{seed}|{t}|" + id), cut into consecutive
    slices of G (the last one shorter when G does not divide N); each group in peer order."""
    if G < 1:
        raise ValueError(f"group size must be >= 1, got {G}")
    order = sorted(range(len(peers)), key=lambda i: hashlib.sha256(f"{seed}|{t}|".encode() + peers[i]).digest())
    return [sorted(order[k:k + G]) for k in range(0, len(order), G)]


def _spread(states, prev_mean):
    import torch

    xs = torch.stack([s.params for s in states])
    mean = xs.mean(0)
    dist = (xs - mean).norm(dim=1)
    moved = float((mean - prev_mean).norm())
    return mean, {"distinct": len({id(s) for s in states}), "spread_mean": float(dist.mean()),
                  "spread_max": float(dist.max()), "mean_moved": moved}


def simulate(st, G: int, H: int, seed: int, warm) -> dict:
    """One run of N = st.workers peers in groups of G; the final validation losses."""
    import copy

    import torch

    from p2ptrain.bench.diloco import _optimizer, _peer, _start, _step
    from p2ptrain.train.data import evaluate, load_dataset, train_batch
    from p2ptrain.train.outer import flatten, unflatten_into

    t0 = time.perf_counter()
    ds = load_dataset(st.data)
    N, S, W = st.workers, st.steps, st.warm_start
    if S % H:
        raise ValueError(f"steps {S} is not a multiple of H {H}")
    batch = lambda w, s: train_batch(ds, _peer(w), W + s, st.batch, st.seq_len, seed)  # noqa: E731
    model, opt_state = _start(st, seed, warm)
    models = [model] + [copy.deepcopy(model) for _ in range(N - 1)]
    opts = [_optimizer(m, st, S, opt_state) for m in models]
    x0 = flatten(model.parameters())
    states = [OuterState(x0, torch.zeros_like(x0), 0)] * N  # one object: one state
    ids = [_peer(w) for w in range(N)]
    prev, steps = x0, []
    for t in range(S // H):
        for w, (m, (opt, sched)) in enumerate(zip(models, opts)):
            for h in range(H):
                _step(m, opt, sched, [batch(w, t * H + h)])
        deltas = [states[w].params - flatten(models[w].parameters()) for w in range(N)]
        new = list(states)
        for grp in deal_groups(seed, t, ids, G):
            g = torch.stack([deltas[i] for i in grp]).mean(0)
            s = merge_round([states[i] for i in grp], g, len(grp), st.outer_lr, st.outer_momentum, st.nesterov, G)
            for i in grp:
                new[i] = s
                unflatten_into(s.params, list(models[i].parameters()))
        states = new
        prev, row = _spread(states, prev)
        steps.append({"t": t, **{k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}})
    losses, seen = [], {}
    for w, s in enumerate(states):  # every peer's model holds its state; evaluate each state once
        if id(s) not in seen:
            seen[id(s)] = evaluate(models[w], ds, batch=st.eval_batch, seq_len=st.seq_len, max_batches=st.eval_batches)
        losses.append(seen[id(s)])
    unflatten_into(prev, list(model.parameters()))  # the peers' mean state (not a committed one)
    mean_state = evaluate(model, ds, batch=st.eval_batch, seq_len=st.seq_len, max_batches=st.eval_batches)
    return {"G": G, "N": N, "H": H, "seed": seed, "val_loss": statistics.fmean(losses), "val_loss_min": min(losses),
            "val_loss_max": max(losses), "val_loss_of_mean_state": mean_state, "distinct_final": len(seen),
            "final_sha256": sorted({s.params_sha256()[:16] for s in states}), "steps": steps,
            "tokens": S * N * st.batch * st.seq_len, "seconds": round(time.perf_counter() - t0, 1)}


def summarize(results: list[dict], G: int, N: int) -> dict:
    by = {(r["G"], r["seed"]): r for r in results}
    seeds = sorted({r["seed"] for r in results})
    per_seed = []
    for s in seeds:
        g, one = by[(G, s)], by[(N, s)]
        per_seed.append({"seed": s, "groups_val_loss": round(g["val_loss"], 5),
                         "groups_peer_min": round(g["val_loss_min"], 5), "groups_peer_max": round(g["val_loss_max"], 5),
                         "groups_mean_state": round(g["val_loss_of_mean_state"], 5),
                         "one_group_val_loss": round(one["val_loss"], 5),
                         "pct": round(100 * (g["val_loss"] / one["val_loss"] - 1), 3)})
    gm = statistics.fmean(by[(G, s)]["val_loss"] for s in seeds)
    om = statistics.fmean(by[(N, s)]["val_loss"] for s in seeds)
    pct = 100 * (gm / om - 1)
    return {"event": "bench_diloco_groups_summary", "peers": N, "groups_of": G, "seeds": len(seeds),
            "groups_val_loss": round(gm, 5), "one_group_val_loss": round(om, 5),
            "val_loss_pct_vs_one_group": round(pct, 3), "per_seed": per_seed,
            "goal_within_1pct": abs(pct) <= GOAL_PCT,
            "every_seed_within_1pct": all(abs(p["pct"]) <= GOAL_PCT for p in per_seed)}


def run(args, st) -> int:
    """`bench diloco --groups-of G --peers N`: both modes for every seed, 2 processes by default."""
    import multiprocessing as mp

    from p2ptrain.bench.diloco import DEFAULT_H, _init_worker, warm_start_state

    G, N = args.groups_of, args.peers
    default_h = list(args.H) == list(DEFAULT_H)
    H = (10 if args.quick else 100) if default_h else args.H[0]
    if not (default_h or len(args.H) == 1) or not 1 <= G < N or st.steps % H:
        print(f"error: --groups-of needs 1 <= G < N, one --H, and --steps a multiple of it "
              f"(G {G}, N {N}, H {args.H}, steps {st.steps})", file=sys.stderr)
        return 2
    st.workers = N
    jobs = max(1, args.jobs)
    threads = args.threads or max(1, 2 // jobs)
    say = (lambda obj: print(json.dumps(obj), flush=True)) if args.json else (lambda obj: None)
    log = (lambda s: None) if args.json else (lambda s: print(s, flush=True))
    seeds = list(range(args.seeds))
    say({"event": "bench_diloco_groups_plan", "peers": N, "groups_of": G, "H": H, "seeds": len(seeds),
         "jobs": jobs, "threads": threads, "settings": asdict(st)})
    log(f"plan: {N} peers in groups of {G} vs one group of {N}, H {H}, {len(seeds)} seeds, "
        f"{st.steps} inner steps per peer\nsettings: {asdict(st)}")
    t0, results = time.perf_counter(), []
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                             initargs=(threads,)) as pool:
        warm = dict(zip(seeds, pool.map(warm_start_state, [st] * len(seeds), seeds)))
        futs = [pool.submit(simulate, st, g, H, s, warm[s]) for s in seeds for g in (G, N)]
        for f in futs:
            r = f.result()
            results.append(r)
            say({"event": "bench_diloco_groups_run", **r})
            log(f"  G={r['G']} seed {r['seed']}: {r['val_loss']:.4f} (peers {r['val_loss_min']:.4f}-"
                f"{r['val_loss_max']:.4f}, mean state {r['val_loss_of_mean_state']:.4f}, "
                f"{r['distinct_final']} distinct, {r['seconds']} s)")
            if r["G"] != N:
                for row in r["steps"]:
                    log(f"    t={row['t']:>3} distinct {row['distinct']:>2} spread mean {row['spread_mean']:.4f} "
                        f"max {row['spread_max']:.4f} mean moved {row['mean_moved']:.4f}")
    summary = summarize(results, G, N)
    summary["H"], summary["wall_seconds"] = H, round(time.perf_counter() - t0, 1)
    summary["settings"] = asdict(st)
    if not args.json:
        for p in summary["per_seed"]:
            log(f"seed {p['seed']}: groups {p['groups_val_loss']:.4f} (peers {p['groups_peer_min']:.4f}-"
                f"{p['groups_peer_max']:.4f}) one group {p['one_group_val_loss']:.4f} -> {p['pct']:+.2f} %")
    print(json.dumps(summary), flush=True)
    return 0
