"""`p2ptrain bench exchange`: a round's small all-to-all exchange (roster confirmation,
contribution headers), a libp2p stream per message against persistent control streams
(`p2ptrain.reduce.ctlstreams`), in the same run.

W real libp2p nodes with their all-reduce services run in this process on 127.0.0.1, so one
trio loop carries all of them: an exchange's wall time is the CPU every member spends on it
together (py-libp2p's cost per message, which on a round's critical path competes with the
data plane for the cores). Rounds alternate between the two paths, so load drifts hit both.
The messages are header-sized (600 bytes) and every payload is checked on arrival.
"""

from __future__ import annotations

import json
import os
import statistics
import time


def add_arguments(p) -> None:
    p.add_argument("--peers", type=int, default=4, help="members per exchange (>= 2)")
    p.add_argument("--rounds", type=int, default=30, help="measured exchanges per path")
    p.add_argument("--json", action="store_true", help="JSON lines; the last is the summary")


async def _measure(w: int, rounds: int) -> dict[str, list[float]]:
    import dataclasses

    import trio

    from p2ptrain.bench.loopback import service_cluster
    from p2ptrain.reduce.service import AllReduceService

    times: dict[str, list[float]] = {"per_message": [], "persistent": []}
    async with trio.open_nursery() as nursery:
        nodes, svcs = await service_cluster(nursery, [AllReduceService] * w)
        ids = [n.identity.peer_id_str for n in nodes]
        for r in range(2 * (rounds + 2)):  # two warm-up exchanges per path (connections, streams)
            path = "persistent" if r % 2 else "per_message"
            for s in svcs:
                s.config = dataclasses.replace(s.config, control_streams=path == "persistent")
            got: list = [None] * w
            t0 = time.perf_counter()
            async with trio.open_nursery() as nn:
                for i, s in enumerate(svcs):
                    async def one(i=i, s=s) -> None:
                        got[i] = await s.exchange("bench", f"x{r}", ids, b"%d" % i * 300, 10.0)
                    nn.start_soon(one)
            took = time.perf_counter() - t0
            for i in range(w):
                if any(got[i][p] != b"%d" % j * 300 for j, p in enumerate(ids)):
                    raise RuntimeError(f"exchange {r}: member {i} is missing a payload")
            if r >= 4:
                times[path].append(took)
        nursery.cancel_scope.cancel()
    return times


def run(args) -> int:
    import trio

    if args.peers < 2 or args.rounds < 1:
        print("error: --peers must be >= 2 and --rounds >= 1")
        return 2
    load = os.getloadavg()[0]
    times = trio.run(_measure, args.peers, args.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [{"event": "bench_exchange_row", "path": k, "median_ms": round(1e3 * m, 3),
             "p90_ms": round(1e3 * sorted(times[k])[int(0.9 * (len(times[k]) - 1))], 3), "n": len(times[k])}
            for k, m in med.items()]
    summary = {"event": "bench_exchange_summary", "peers": args.peers, "rounds": args.rounds,
               "messages_per_exchange": args.peers * (args.peers - 1),
               "speedup_persistent": round(med["per_message"] / med["persistent"], 2),
               "loadavg_1min": [load, os.getloadavg()[0]], "cpus": os.cpu_count()}
    for r in (*rows, summary):
        if args.json:
            print(json.dumps(r))
        else:
            print(" ".join(f"{k}={v}" for k, v in r.items() if k != "event"))
    return 0
