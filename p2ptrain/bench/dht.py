"""`p2ptrain bench dht`: DHT latency on a loopback swarm, beside hivemind's in the same run.

The swarm is a bootstrap process, NODES-3 `p2ptrain join` processes, and two full DHT
nodes A and B inside this process. For each of OPS fresh keys: A stores its entry (time
until the replicas acked), B reads it (a node that may hold no replica: our get always asks
the replicas, like hivemind's latest=True, because keys are multi-writer), A reads it, and
B looks up a key nobody stored. hivemind's figures come from `python -m
p2ptrain.bench.hivemind_dht` in its own processes (it cannot share a process with libp2p).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--nodes", type=int, default=10, help="swarm size (>= 4)")
    p.add_argument("--ops", type=int, default=50, help="measured operations per metric")
    p.add_argument("--no-hivemind", action="store_true", help="skip the hivemind baseline")
    p.add_argument("--json", action="store_true", help="JSON lines; the last is the summary")


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"median": None, "p90": None, "n": 0}
    return {"median": round(statistics.median(xs), 3), "p90": round(xs[int(0.9 * (len(xs) - 1))], 3), "n": len(xs)}


async def _measure(bootstrap: str, ops: int) -> dict:
    import trio

    from p2ptrain.events import EventSink
    from p2ptrain.identity import Identity
    from p2ptrain.net.node import Node, NodeConfig

    cfg = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[bootstrap])
    out: dict = {}
    async with trio.open_nursery() as nursery:
        a = await nursery.start(Node(Identity.generate(), cfg, EventSink("a", False)).run)
        b = await nursery.start(Node(Identity.generate(), cfg, EventSink("b", False)).run)
        for n in (a, b):  # both learn the whole swarm before timing
            await n.dht.refresh()
        times: dict[str, list[float]] = {k: [] for k in ("store", "get_remote", "get_remote_q1", "get_local",
                                                         "get_missing")}
        failures = {k: 0 for k in times}
        rpcs = {k: 0 for k in times}
        for i in range(ops + 3):
            key = f"/p2ptrain/bench/{secrets.token_hex(8)}"
            for name, node, fn in (("store", a, lambda: a.dht.store(key, b"v" * 64, 60)),
                                   ("get_remote", b, lambda: b.dht.get(key)),
                                   ("get_remote_q1", b, lambda: b.dht.get(key, quorum=1)),
                                   ("get_local", a, lambda: a.dht.get(key)),
                                   ("get_missing", b, lambda: b.dht.get(key + "-missing"))):
                before = node.dht.stats.rpcs
                t = time.perf_counter()
                result = await fn()
                dt = (time.perf_counter() - t) * 1000
                ok = {"store": lambda r: r >= 1, "get_missing": lambda r: r == {}}.get(
                    name, lambda r: a.identity.peer_id in r)(result)
                if i >= 3:
                    rpcs[name] += node.dht.stats.rpcs - before
                    if ok:
                        times[name].append(dt)
                    else:
                        failures[name] += 1
        out = {f"{k}_ms": _stats(v) for k, v in times.items()}
        out["failures"] = failures
        out["rpcs_per_op"] = {k: round(v / ops, 2) for k, v in rpcs.items()}
        out["routing_table"] = [len(a.dht.routing), len(b.dht.routing)]
        nursery.cancel_scope.cancel()
    return out


def run(args) -> int:
    import trio

    from p2ptrain.procs import ProcessGroup

    if args.nodes < 4:
        print("p2ptrain: error: --nodes must be >= 4", file=sys.stderr)
        return 2
    logging.getLogger("p2ptrain").setLevel(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-dht-"))
    with ProcessGroup(work) as group:
        boot = group.start(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(work / "b.key"), "--json"], "bootstrap")
        baddr = boot.first_line(60)
        peers = [group.start(["join", "--bootstrap", baddr, "--listen", "/ip4/127.0.0.1/tcp/0",
                              "--workdir", str(work / f"n{i}"), "--json"], f"n{i}") for i in range(args.nodes - 3)]
        for p in peers:
            p.wait_event(lambda e: e["event"] == "dht_ready", 120)
        ours = trio.run(_measure, baddr, args.ops)
    ours.update(event="bench_dht_p2ptrain", nodes=args.nodes, ops=args.ops)
    hm = None
    if not args.no_hivemind:
        r = subprocess.run([sys.executable, "-m", "p2ptrain.bench.hivemind_dht", "--nodes", str(args.nodes),
                            "--ops", str(args.ops), "--json"], capture_output=True, text=True, timeout=600,
                           cwd=str(work), env=dict(os.environ))
        if r.returncode == 0:
            hm = json.loads(r.stdout.strip().splitlines()[-1])
        else:
            print(f"hivemind baseline unavailable: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}",
                  file=sys.stderr)

    def ratio(ours_key: str, hm_key: str):
        if not hm or not hm.get(hm_key, {}).get("median") or not ours[ours_key]["median"]:
            return None
        return round(ours[ours_key]["median"] / hm[hm_key]["median"], 2)

    ratios = {
        "store": ratio("store_ms", "store_ms"),
        "get_remote_vs_hivemind_latest_false": ratio("get_remote_ms", "get_remote_ms"),
        "get_remote_vs_hivemind_latest_true": ratio("get_remote_ms", "get_remote_latest_ms"),
        "get_remote_quorum1_vs_hivemind_latest_false": ratio("get_remote_q1_ms", "get_remote_ms"),
        "get_missing": ratio("get_missing_ms", "get_missing_ms"),
    }
    summary = {"event": "bench_dht_summary", "nodes": args.nodes, "ops": args.ops, "p2ptrain": ours,
               "hivemind": hm, "ratio_ours_over_hivemind": ratios, "goal": "<= 2.0"}
    if args.json:
        print(json.dumps(ours))
        if hm:
            print(json.dumps(hm))
        print(json.dumps(summary))
        return 0
    print(f"DHT latency, {args.nodes} nodes on loopback, {args.ops} ops each (median / p90 ms)")
    print(f"{'operation':<28}{'p2ptrain':>18}{'hivemind':>18}{'ratio':>8}  rpcs/op")
    rows = [("store", "store_ms", "store_ms", "store"),
            ("get from other node", "get_remote_ms", "get_remote_ms", "get_remote_vs_hivemind_latest_false"),
            ("  vs hivemind latest=True", "get_remote_ms", "get_remote_latest_ms", "get_remote_vs_hivemind_latest_true"),
            ("get other node, quorum=1", "get_remote_q1_ms", "get_remote_ms", "get_remote_quorum1_vs_hivemind_latest_false"),
            ("get from storing node", "get_local_ms", "get_local_ms", None),
            ("get missing key", "get_missing_ms", "get_missing_ms", "get_missing")]
    for label, ok, hk, rk in rows:
        o = ours[ok]
        h = (hm or {}).get(hk) or {}
        fmt = lambda s: f"{s['median']:.1f} / {s['p90']:.1f}" if s.get("median") is not None else "-"
        r = ratios.get(rk) if rk else None
        print(f"{label:<28}{fmt(o):>18}{fmt(h):>18}{(f'{r:.2f}x' if r else '-'):>8}  "
              f"{ours['rpcs_per_op'].get(ok[:-3], '')}")
    print(f"failures: p2ptrain {ours['failures']}" + (f", hivemind {hm['failures']}" if hm else ""))
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m p2ptrain.bench.dht")
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
