"""Result rows, summary and table of `p2ptrain bench diloco` (split from diloco.py)."""

from __future__ import annotations

import json
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.bench.diloco import Settings


def _name(kind: str, H: int, avg: str, M: int) -> str:
    if kind == "diloco":
        return f"diloco_H{H}_{avg}"
    return f"single_{M}x" if kind == "single_Mx" else kind


def _agg(results: list[dict]) -> dict:
    vals = [r["val_loss"] for r in results]
    return {"val_loss_mean": statistics.fmean(vals), "val_loss_std": statistics.stdev(vals) if len(vals) > 1 else None,
            "val_losses": [round(v, 5) for v in vals], "seeds": [r["seed"] for r in results]}


def summarize(st: Settings, results: list[dict]) -> tuple[list[dict], dict]:
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(_name(r["kind"], r["H"], r["avg"], st.workers), []).append(r)
    dp = groups.get("dp")
    dp_bytes = dp[0]["wire_bytes"] if dp else None
    rows = []
    for name, rs in groups.items():
        rs.sort(key=lambda r: r["seed"])
        row = {"event": "bench_diloco_config", "name": name, "kind": rs[0]["kind"], "H": rs[0]["H"] or None,
               "avg": rs[0]["avg"] if rs[0]["kind"] == "diloco" else None, **_agg(rs),
               "wire_bytes_per_worker": rs[0]["wire_bytes"], "tokens": rs[0]["tokens"],
               "inner_steps": rs[0]["inner_steps"], "seconds_per_run": round(statistics.fmean(r["seconds"] for r in rs), 1)}
        if dp_bytes and rs[0]["wire_bytes"]:
            row["bytes_reduction_vs_dp"] = round(dp_bytes / rs[0]["wire_bytes"], 1)
        for key in ("int8_rel_err", "sparse_rel_err"):
            if key in rs[0]:
                row[key] = round(statistics.fmean(r[key] for r in rs), 5)
        rows.append(row)
    order = {"single": 0, "single_Mx": 1, "dp": 2, "diloco": 3}
    rows.sort(key=lambda r: (order[r["kind"]], r["H"] or 0, r["avg"] or ""))
    by = {r["name"]: r for r in rows}
    summary: dict = {"event": "bench_diloco_summary"}
    dil = [r for r in rows if r["kind"] == "diloco"]
    if dil:
        best = min(dil, key=lambda r: r["val_loss_mean"])
        summary["best_diloco"] = best["name"]
        summary["best_diloco_val_loss"] = round(best["val_loss_mean"], 4)
        if "dp" in by:
            dpv = by["dp"]["val_loss_mean"]
            summary["dp_val_loss"] = round(dpv, 4)
            summary["diloco_vs_dp_pct"] = {r["name"]: round(100 * (r["val_loss_mean"] / dpv - 1), 2) for r in dil}
            summary["goal_within_2pct_of_dp"] = best["val_loss_mean"] <= 1.02 * dpv
        if "single" in by:
            summary["single_val_loss"] = round(by["single"]["val_loss_mean"], 4)
            summary["goal_better_than_single"] = best["val_loss_mean"] < by["single"]["val_loss_mean"]
        if "single_Mx" in by:
            summary["single_Mx_val_loss"] = round(by["single_Mx"]["val_loss_mean"], 4)
        pairs = {}
        for H in sorted({r["H"] for r in dil}):
            a, b = groups.get(f"diloco_H{H}_fp32"), groups.get(f"diloco_H{H}_int8")
            if not a or not b:
                continue
            fa, fb = by[f"diloco_H{H}_fp32"], by[f"diloco_H{H}_int8"]
            diffs = [y["val_loss"] - x["val_loss"] for x, y in zip(a, b) if x["seed"] == y["seed"]]
            pairs[H] = {"int8_minus_fp32": round(fb["val_loss_mean"] - fa["val_loss_mean"], 5),
                        "paired_diffs": [round(d, 5) for d in diffs], "fp32_seed_std": fa["val_loss_std"],
                        "within_one_std": (abs(fb["val_loss_mean"] - fa["val_loss_mean"]) <= fa["val_loss_std"])
                        if fa["val_loss_std"] is not None else None}
        summary["int8_vs_fp32"] = pairs
        i8 = by.get("diloco_H100_int8")
        if i8 and "bytes_reduction_vs_dp" in i8:
            summary["bytes_reduction_H100_int8"] = i8["bytes_reduction_vs_dp"]
            summary["goal_bytes_360x"] = i8["bytes_reduction_vs_dp"] >= 360
        summary["sparse"] = _sparse_goals(by, groups)
    return rows, summary


def _sparse_goals(by: dict, groups: dict) -> dict:
    """Issue 18's goals per sparse row: >= 2000x fewer bytes than dp, and validation loss
    within 1 % of int8 DiLoCo at the same H (and of the int8 row at H=100, the 374x point)."""
    out = {}
    for name, r in by.items():
        if r["avg"] != "sparse":
            continue
        g = {"bytes_reduction_vs_dp": r.get("bytes_reduction_vs_dp"),
             "goal_2000x": (r.get("bytes_reduction_vs_dp") or 0) >= 2000}
        for ref in dict.fromkeys([f"diloco_H{r['H']}_int8", "diloco_H100_int8"]):
            if ref in by:
                i8 = by[ref]["val_loss_mean"]
                g[f"vs_{ref}_pct"] = round(100 * (r["val_loss_mean"] / i8 - 1), 2)
                g[f"goal_within_1pct_of_{ref}"] = r["val_loss_mean"] <= 1.01 * i8
                paired = {x["seed"]: x["val_loss"] for x in groups[ref]}
                g[f"paired_pct_{ref}"] = [round(100 * (x["val_loss"] / paired[x["seed"]] - 1), 2)
                                          for x in groups[name] if x["seed"] in paired]
        out[name] = g
    return out


def _table(rows: list[dict]) -> str:
    lines = [f"{'config':<20} {'seeds':>5} {'val loss':>9} {'std':>7} {'vs dp':>7} {'bytes/worker':>13} {'x fewer':>8} {'s/run':>6}"]
    dpv = next((r["val_loss_mean"] for r in rows if r["name"] == "dp"), None)
    for r in rows:
        std = f"{r['val_loss_std']:.4f}" if r["val_loss_std"] is not None else "-"
        vs = f"{100 * (r['val_loss_mean'] / dpv - 1):+.1f}%" if dpv else "-"
        red = f"{r['bytes_reduction_vs_dp']:.0f}" if "bytes_reduction_vs_dp" in r else "-"
        lines.append(f"{r['name']:<20} {len(r['seeds']):>5} {r['val_loss_mean']:>9.4f} {std:>7} {vs:>7} "
                     f"{r['wire_bytes_per_worker']:>13,} {red:>8} {r['seconds_per_run']:>6}")
    return "\n".join(lines)


def print_results(rows: list[dict], summary: dict, say, json_mode: bool, table) -> None:
    """The rows and the summary as event lines (`say`, --json), or as a table and the
    summary's figures on one line; shared by the quality benches (diloco, robust)."""
    for r in rows:
        say(r)
    say(summary)
    if not json_mode:
        print(table(rows))
        print(json.dumps({k: v for k, v in summary.items() if k not in ("event", "settings")}))


