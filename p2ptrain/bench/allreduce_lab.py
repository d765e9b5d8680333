"""`p2ptrain bench allreduce --lab-mbit R [--lab-mbit R2 ...]`: the all-reduce in the emulated
internet (`p2ptrain.bench.inetlab`) against the bandwidth bound.

For each rate R, one lab of `--peers` namespaces, every access link shaped to R both ways, and
in the same lab:
  - the baseline: one plain TCP transfer between two lab peers (what the link really carries);
  - p2ptrain verified int8, the path training uses (signed headers, own=/check=, every frame
    held to them; `bench.signed_round`), then the unverified data plane as a second row, and
    with --lab-fp32 verified fp32 (4x the bytes).
Each row's round time (barrier to last commit, median of --rounds) is set against the ring's
bound 2(W-1)/W x payload / R, payload = the encoded tensor as it goes on the wire (int8 values
plus the codec's per-block scales, or fp32), so ratio = bound / round time (1.0 = the link is
the only cost; TCP/IP headers alone hold a saturated link to ~0.96; "vs TCP" sets the same
bound at the baseline's measured goodput instead of the nominal rate). Where a row misses, the
"cpu floor" says whether this machine's CPU could have kept up: all members' CPU seconds per
round / the cores they share (a round cannot be shorter than that here).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def payload_bytes(mb: int, peers: int, mode: str) -> int:
    """Encoded tensor bytes (values + scales) as the ring puts them on the wire."""
    from p2ptrain.reduce.schedule import RingConfig, layout, wire_bytes

    cfg = RingConfig(mode)
    n = mb * (1 << 20) // 4
    return sum(wire_bytes(hi - lo, cfg) for subs in layout(n, peers, cfg) for lo, hi in subs)


def _row(label: str, r: dict, mbit: float, peers: int, tcp: dict | None = None) -> dict:
    from p2ptrain.bench.inetlab import bandwidth_bound_s

    mode = r["mode"]
    payload = payload_bytes(r["mb"], peers, mode)
    bound = bandwidth_bound_s(payload, peers, mbit)
    round_s = r["round_s"]["median"]
    cpu_floor = r["cpu_s_per_member"] * peers / (os.cpu_count() or 1)
    return {"event": "bench_allreduce_lab_row", "label": label, "link_mbit": mbit, "mode": mode,
            "verified": r["verified"], "payload_bytes": payload, "round_s": round_s, "bound_s": round(bound, 4),
            "vs_bound": round(bound / round_s, 3), "cpu_floor_s": round(cpu_floor, 4),
            "identical": r["identical"], "rel_err": r["rel_err"], "phases_s_max": r["phases_s_max"],
            "round_s_all": r["round_s"]["all"], "cpu_s_per_member": r["cpu_s_per_member"],
            # Rounds 10 % or more over the row's fastest: a stall (on the 16-core machine, one
            # link's tail-loss probe after the shaper's queue filled cost 20-50 ms a round)
            # shows here instead of only moving the median.
            "slow_rounds": sum(x >= 1.1 * min(r["round_s"]["all"]) for x in r["round_s"]["all"]),
            # The lab's TCP retransmissions during the row (warm-up round included), summed over
            # its namespaces (`inetlab.tcp_counters`): what a slow round's stall was.
            "tcp": tcp or {},
            **{k: r[k] for k in ("timeline_ms", "timeline_slowest_ms") if k in r}}


def measure_rate(args, mbit: float, work: Path) -> dict:
    from p2ptrain.bench.allreduce import measure_ours
    from p2ptrain.bench.inetlab import internet_lab, tcp_counters, tcp_goodput

    rows = []
    with internet_lab([mbit] * args.peers, boot=False) as lab:
        # ~1.5 s of the link's rate: long enough that the shaper's burst is ~1 % of it.
        nbytes = int(min(mbit * 1e6 / 8 * 1.5, 300e6))
        tcp = tcp_goodput(lab, 0, 1, nbytes)
        plan = [("p2ptrain int8 verified", "int8", True), ("p2ptrain int8 unverified", "int8", False)]
        if args.lab_fp32:
            plan.append(("p2ptrain fp32 verified", "fp32", True))
        for label, mode, verified in plan:
            before = tcp_counters(lab)
            r = measure_ours(args.peers, args.mb, args.rounds, mode, True, work / f"lab{mbit:g}", verified, lab=lab,
                             trace=args.trace)
            after = tcp_counters(lab)
            rows.append(_row(label, r, mbit, args.peers, {k.split(":")[1]: after[k] - before[k] for k in after}))
    for r in rows:  # the same bound at what one TCP stream really carried over this link
        r["vs_tcp_bound"] = round(r["vs_bound"] * mbit / tcp["mbit"], 3)
    return {"link_mbit": mbit, "tcp_goodput_mbit": tcp["mbit"], "tcp_vs_rate": round(tcp["mbit"] / mbit, 3),
            "rows": rows}


def run_lab(args) -> int:
    from p2ptrain.bench.inetlab import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(json.dumps({"event": "bench_allreduce_lab_unavailable", "reason": reason}) if args.json
              else f"emulated internet unavailable: {reason}")
        return 2
    work = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-allreduce-lab-"))
    results = [measure_rate(args, mbit, work) for mbit in args.lab_mbit]
    ratios = {f"{res['link_mbit']:g}": {r["label"]: r["vs_bound"] for r in res["rows"]} for res in results}
    summary = {"event": "bench_allreduce_lab_summary", "peers": args.peers, "mb": args.mb, "rounds": args.rounds,
               "results": results, "vs_bound": ratios,
               "goals": {"p2ptrain int8 verified vs bound": ">= 0.9 at 100 and 1000 Mbit/s"}}
    if args.json:
        for res in results:
            for r in res["rows"]:
                print(json.dumps(r))
        print(json.dumps(summary))
        return 0
    print(f"All-reduce in the emulated internet: {args.peers} peers, {args.mb} MiB fp32 tensor, "
          f"median of {args.rounds} rounds; bound = 2(W-1)/W x wire payload / link rate")
    for res in results:
        print(f"\nlinks {res['link_mbit']:g} Mbit/s both ways; plain TCP between two lab peers: "
              f"{res['tcp_goodput_mbit']} Mbit/s ({res['tcp_vs_rate']}x the rate)")
        print(f"{'row':<28}{'payload MiB':>12}{'round s':>9}{'bound s':>9}{'vs bound':>10}{'vs TCP':>8}"
              f"{'cpu floor s':>13}{'identical':>10}{'slow':>6}")
        for r in res["rows"]:
            print(f"{r['label']:<28}{r['payload_bytes'] / (1 << 20):>12.2f}{r['round_s']:>9.3f}{r['bound_s']:>9.3f}"
                  f"{r['vs_bound']:>10.3f}{r['vs_tcp_bound']:>8.3f}{r['cpu_floor_s']:>13.3f}{str(r['identical']):>10}"
                  f"{r['slow_rounds']:>6}")
            for i, tl in enumerate(r.get("timeline_ms", [])):
                print(f"    member {i}: " + " ".join(f"{k}={v:g}" for k, v in tl.items()))
    print(f"\ngoal: int8 verified >= 0.9x the bound; vs bound by link rate: {json.dumps(ratios)}")
    return 0
