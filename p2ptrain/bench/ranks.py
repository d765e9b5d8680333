"""`p2ptrain bench ranks`: memory per rank of a multi-rank node against a single-process peer.

Same model, same run settings, measured in the same run (issue 19). The baseline is a
single-process peer's model side (`LocalModel`) in one child process; the node is N ranks
started by torchrun (`python -m torch.distributed.run --nproc-per-node N`), rank 0 a
`LeaderModel`, the others on the command loop of `p2ptrain.train.ranks`, exactly as
`torchrun -m p2ptrain join` builds them. Each side runs two inner steps, one pseudo-gradient
and one outer step, so every buffer exists; then each process reports:

  params, optimizer: exact bytes of its parameter tensors and AdamW state, counted from the
      tensors' LOCAL shards (DTensor.to_local()): the goal is about 1/N of the baseline's;
  outer state: the fp32 outer parameters, momentum and staging vector on the host (3 x 4
      bytes per parameter; rank 0 and the baseline only: the node keeps one copy, as prime);
  peak RSS: ru_maxrss of the process (everything: torch itself, the tokens, the process
      group's buffers, activations; on rank 0 also the genesis state this bench builds whole;
      preset models are built on the meta device, so no rank holds a whole model otherwise);
  outer s: rank 0's (the baseline's) seconds for the pseudo-gradient and the outer step --
      on the node that includes gathering the shards and scattering the new parameters
      (the price of "rank 0 speaks for the node"; the network round it feeds is not run).

Usage: p2ptrain bench ranks [--nproc 2] [--preset small] [--batch 8] [--seq-len 128] [--threads 1]
Noisy on shared machines only in time, not in bytes; the RSS figures vary by a few MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MIB = 1 << 20


def add_arguments(p) -> None:
    p.add_argument("--nproc", type=int, default=2, help="ranks of the node (torchrun --nproc-per-node)")
    p.add_argument("--preset", default="small", choices=["tiny", "small", "base"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    p.add_argument("--genesis", default="", help=argparse.SUPPRESS)  # workers: the state file


def run(args) -> int:
    import tempfile

    common = ["--preset", args.preset, "--batch", str(args.batch), "--seq-len", str(args.seq_len),
              "--threads", str(args.threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    # the genesis state is built here, once: a worker reads it as a joining peer reads its
    # state (building it would add a whole model and outer state to the worker's peak RSS)
    tmp = tempfile.TemporaryDirectory(prefix="p2ptrain-bench-ranks-")
    genesis = os.path.join(tmp.name, "genesis.p2ck")
    with open(genesis, "wb") as f:
        f.write(_genesis(args))
    common += ["--genesis", genesis]
    base = _collect([sys.executable, "-m", "p2ptrain.bench.ranks", "--worker", *common], env)
    node = _collect([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                     "-m", "p2ptrain.bench.ranks", "--worker", *common], env)
    rows = base + sorted(node, key=lambda r: r["rank"])
    ref = base[0]["params"] + base[0]["optimizer"]
    if args.json:
        for r in rows:
            print(json.dumps({**r, "ratio": (r["params"] + r["optimizer"]) / ref}))
        return 0
    print(f"preset {args.preset}: {rows[0]['n_params']:,} parameters, batch {args.batch} x {args.seq_len}, "
          f"node of {args.nproc} ranks (gloo, CPU)")
    print(f"{'process':<16}{'params MiB':>12}{'AdamW MiB':>12}{'p+opt ratio':>13}{'outer MiB':>11}{'peak RSS MiB':>14}{'outer s':>9}")
    for r in rows:
        name = "single-process" if r["world"] == 1 else f"rank {r['rank']}/{r['world']}"
        print(f"{name:<16}{r['params'] / MIB:>12.2f}{r['optimizer'] / MIB:>12.2f}"
              f"{(r['params'] + r['optimizer']) / ref:>12.3f}x{r['outer_state'] / MIB:>11.2f}{r['rss'] / MIB:>14.1f}"
              f"{r['outer_s']:>9.3f}")
    return 0


def _collect(cmd: list[str], env: dict) -> list[dict]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        raise SystemExit(f"bench worker failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _genesis(a) -> bytes:
    from p2ptrain.train.local import genesis_state

    return genesis_state(_spec(a))


def _spec(a):
    from p2ptrain.run.spec import RunSpec
    from p2ptrain.train.model import ModelConfig

    section = ModelConfig.preset(a.preset).to_dict()
    tr = {"seed": 0, "inner_steps": 2, "inner_lr": 3e-4, "warmup": 1, "weight_decay": 0.1, "batch_size": a.batch,
          "seq_len": a.seq_len, "schedule": "cosine", "planned_outer_steps": 100, "outer_lr": 0.7,
          "outer_momentum": 0.9, "group_size": 1}
    return RunSpec.from_dict({"version": 1, "name": "bench", "created": 0, "model": section,
                              "data": {"spec": "bench", "content_hash": ""}, "train": tr,
                              "timeouts": {}, "genesis": {"sha256": "", "bytes": 0}})


def _setup(a):
    """(spec, dataset, genesis state) of a synthetic run with the bench's settings."""
    import numpy as np

    from p2ptrain.train.data import Dataset, _hash

    spec = _spec(a)
    section = spec.model.config
    tokens = np.random.default_rng(0).integers(0, section["vocab_size"], 1 << 18).astype(np.uint16)
    train, val = tokens[:-8192], tokens[-8192:]
    if getattr(a, "genesis", ""):
        with open(a.genesis, "rb") as f:
            state = f.read()
    else:
        state = _genesis(a)
    return spec, Dataset("bench", train, val, _hash("bench", train, val), 1, 0), state


def _rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _row(rank: int, world: int, n_params: int, mem: dict, outer_s: float = 0.0) -> str:
    return json.dumps({"rank": rank, "world": world, "n_params": n_params, "params": mem["params"],
                       "optimizer": mem["optimizer"], "outer_state": mem.get("outer_state", 0), "rss": _rss(),
                       "outer_s": round(outer_s, 4)})


def _outer(local) -> float:
    """Seconds for one pseudo-gradient and one (zero) outer step, as the trainer runs them."""
    import time

    import numpy as np

    t0 = time.perf_counter()
    local.outer_step(local.pseudo_gradient() * np.float32(0))
    return time.perf_counter() - t0


def _single(a) -> None:
    import torch

    from p2ptrain.train.local import LocalModel

    spec, ds, state = _setup(a)
    local = LocalModel(spec, ds, b"bench-peer", state, a.threads, "cpu", "fp32")
    local.inner()
    sec = _outer(local)
    opt = sum(v.numel() * v.element_size() for st in local.inner_opt.state.values() for v in st.values()
              if torch.is_tensor(v) and v.dim() > 0)
    outer = sum(t.numel() * t.element_size() for t in (local.outer.outer, local.outer.momentum, local.outer._staging))
    par = sum(p.numel() * p.element_size() for p in local.model.parameters())
    print(_row(0, 1, local.n_params, {"params": par, "optimizer": opt, "outer_state": outer}, sec), flush=True)


def _rank(a, env) -> None:
    import torch

    from p2ptrain.train import leader, ranks

    cfg = ranks.RanksConfig(timeout=600)
    device = torch.device("cpu")
    ranks.init(env, device, cfg)
    try:
        if not env.leader:
            ranks.follow(env, device, on_stop=lambda m: print(_row(env.rank, env.world, m.n_params, m.param_bytes()),
                                                              flush=True))
            return
        spec, ds, state = _setup(a)
        lead = leader.LeaderModel(spec, ds, b"bench-peer", state, a.threads, device, "fp32", env, cfg)
        lead.inner()
        sec = _outer(lead)
        print(_row(0, env.world, lead.n_params, lead.memory(), sec), flush=True)
        lead.stop()
    finally:
        ranks.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m p2ptrain.bench.ranks")
    p.add_argument("--worker", action="store_true", required=True)
    add_arguments(p)
    a = p.parse_args(argv)
    from p2ptrain.train import ranks

    env = ranks.detect()
    if env is None:
        _single(a)
    else:
        _rank(a, env)


if __name__ == "__main__":
    main()
