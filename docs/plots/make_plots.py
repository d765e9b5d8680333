"""Draw the plots of BENCHMARKS.md from figures recorded in docs/BENCHMARKS-HISTORY.md (no
new measurement): `PYTHONPATH=. python docs/plots/make_plots.py` in the checkout's root."""

from __future__ import annotations

import math
from pathlib import Path

from p2ptrain.plot import line_chart

HERE = Path(__file__).resolve().parent


def quality_vs_bytes() -> Path:
    # "DiLoCo quality" and "Compressed pseudo-gradients": val loss (mean of the seeds run) and
    # wire bytes per worker over 1000 inner steps, 4 workers, the bench's 123k-parameter model
    log = math.log10
    return line_chart({
        "diloco int8": [(log(19_779_600), 1.3888), (log(3_955_920), 1.4528), (log(1_977_960), 1.4887)],
        "diloco fp32": [(log(73_920_000), 1.3888), (log(14_784_000), 1.4528), (log(7_392_000), 1.4887)],
        "data parallel": [(log(739_200_000), 1.4460)],
        "sparse, k 3.69%": [(log(368_940), 1.5030)],
    }, HERE / "quality-vs-bytes.png", title="val loss vs log10(wire bytes per worker); diloco at h = 10, 50, 100")


def overlap_cost() -> Path:
    # "Overlapped outer steps": val loss vs synchronous DiLoCo in %, 3 seeds, H = 50, by where
    # the round's average lands in the next phase (0: bit-identical to synchronous, by test)
    return line_chart({
        "delayed, 0.7/0.9": [(0, 0.0), (25, 1.26), (100, 6.0)],
        "eager, 0.7/0.9": [(0, 0.0), (25, 1.06), (100, 8.5)],
        "eager, best lr": [(25, 0.68), (75, 1.92), (100, 2.33)],
        "streaming, p=5": [(100, -1.35)],
    }, HERE / "overlap-cost.png", title="val loss vs synchronous, %; x: where the average lands, % of the next phase")


if __name__ == "__main__":
    for p in (quality_vs_bytes(), overlap_cost()):
        print(p)
