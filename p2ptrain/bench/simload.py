"""Where a simulated world's DHT traffic goes (issue 30's 1,000-peer goal): operations and
the RPCs they cost, by record key and method.

    python -m p2ptrain.bench.simload --peers 64 --seed 1 --duration 60 [--faults]

Every peer's `DHTNode.get` and `store_record` are counted by key class (`/p2ptrain/<run>/
ready/<t>/<l>.<c>` becomes `ready/N/N.N`), and each RPC they send is charged to the operation
that sent it (a context variable follows the operation into its lookup's tasks); RPCs sent
outside an operation (bootstrap, bucket refresh) are `other`. The last line is JSON. A
diagnostic, not a goal: it has no baseline, and its wrappers are installed in this process
only, for the world it runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import contextvars
import json
import re
import time

from p2ptrain.dht import node as dhtnode

_op: contextvars.ContextVar[str] = contextvars.ContextVar("dht_op", default="other")


def key_class(key: str) -> str:
    """`/p2ptrain/<run>/state/12/1.3` -> `state/N/N.N`: one class per record kind and level."""
    parts = key.strip("/").split("/")[2:]  # drop "p2ptrain" and the run id
    return "/".join(re.sub(r"\d+", "N", p) if not re.fullmatch(r"[0-9a-f]{16,}", p) else "H" for p in parts)


@contextlib.contextmanager
def counting():
    """Count DHT operations and their RPCs while the block runs: yields (ops, rpcs) Counters."""
    ops, rpcs = collections.Counter(), collections.Counter()
    get, store, call = dhtnode.DHTNode.get, dhtnode.DHTNode.store_record, dhtnode.DHTNode._call

    async def counted_get(self, key, quorum=None):
        name = f"get {key_class(key)}"
        ops[name] += 1
        token = _op.set(name)
        try:
            return await get(self, key, quorum)
        finally:
            _op.reset(token)

    async def counted_store(self, rec):
        name = f"store {key_class(rec.key)}"
        ops[name] += 1
        token = _op.set(name)
        try:
            return await store(self, rec)
        finally:
            _op.reset(token)

    async def counted_call(self, peer, method, body):
        rpcs[f"{_op.get()} ({method})"] += 1
        return await call(self, peer, method, body)

    dhtnode.DHTNode.get, dhtnode.DHTNode.store_record, dhtnode.DHTNode._call = counted_get, counted_store, counted_call
    try:
        yield ops, rpcs
    finally:
        dhtnode.DHTNode.get, dhtnode.DHTNode.store_record, dhtnode.DHTNode._call = get, store, call


def measure(peers: int, seed: int, duration: float, faults: bool = False) -> dict:
    from p2ptrain.sim import scenarios, world

    t0 = time.perf_counter()
    with counting() as (ops, rpcs):
        rep = world.run(scenarios.random_world(seed, peers, faults=faults, duration=duration), seed)
    n_ops, n_rpcs = sum(ops.values()), sum(rpcs.values())
    peer_s = peers * duration
    return {"event": "sim_dht_load", "peers": peers, "seed": seed, "duration": duration, "faults": faults,
            "violations": len(rep.violations), "events": rep.events, "wall_seconds": round(time.perf_counter() - t0, 1),
            "ops": n_ops, "rpcs": n_rpcs, "ops_per_peer_second": round(n_ops / peer_s, 3),
            "rpcs_per_peer_second": round(n_rpcs / peer_s, 2),
            "store_rpc_share": round(sum(v for k, v in rpcs.items() if k.startswith("store")) / max(1, n_rpcs), 3),
            "ops_by_key": dict(ops.most_common()), "rpcs_by_op": dict(rpcs.most_common())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--faults", action="store_true", help="a random world with faults (default: fault-free)")
    args = p.parse_args(argv)
    out = measure(args.peers, args.seed, args.duration, args.faults)
    for name, n in list(out["rpcs_by_op"].items())[:15]:
        print(f"{n:>8}  {name}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
