"""`python -m fakes.hostile_peer MODE join ...`: a real `p2ptrain join` process built with one
hostile part: the benches' modes (p2ptrain/bench/adversary.py) plus the test-only
`ckpt-pause:STEP:SECONDS` and `die-at-header:STEP` (tests/fakes/adversary.py). Run with tests/ on PYTHONPATH
(`fakes.env()` gives the environment)."""

from __future__ import annotations

import functools
import sys

import p2ptrain  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from p2ptrain.bench import adversary as bench_adversary


def parts_for(mode: str):
    from fakes import adversary
    from p2ptrain.run.runner import Parts, make_writer

    if mode.startswith("die-at-header:"):
        return Parts(contributor=functools.partial(adversary.DyingContributor, int(mode.split(":")[1])))
    if not mode.startswith("ckpt-pause:"):
        return bench_adversary.parts_for(mode)
    _, step, seconds = mode.split(":")

    def writer(workdir, run_id, events):
        cls = functools.partial(adversary.PausingWriter, events=events, pause_step=int(step), seconds=float(seconds))
        return make_writer(workdir, run_id, events, cls)

    return Parts(writer=writer)


if __name__ == "__main__":
    sys.exit(bench_adversary.main(sys.argv[1:], parts_for))
