"""`python -m fakes.hostile_peer MODE join ...`: a real `p2ptrain join` process (node, DHT,
all-reduce service, trainer) built with one hostile part from tests/fakes/adversary.py.

It runs the product's own CLI; the only difference is the `Parts` the runner builds the
trainer from (`p2ptrain.run.runner.run_training(parts=...)`). Run with tests/ on PYTHONPATH
(`fakes.env()` gives the environment)."""

from __future__ import annotations

import functools
import sys

import p2ptrain  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)


def parts_for(mode: str):
    from fakes import adversary
    from p2ptrain.run.runner import Parts, make_writer

    if mode == "chunk":
        return Parts(blob_server=adversary.CorruptBlobServer)
    if mode.startswith("ckpt-pause:"):
        _, step, seconds = mode.split(":")

        def writer(workdir, run_id, events):
            cls = functools.partial(adversary.PausingWriter, events=events, pause_step=int(step),
                                    seconds=float(seconds))
            return make_writer(workdir, run_id, events, cls)

        return Parts(writer=writer)
    adversary.HostileContributor(mode)  # validates the mode
    return Parts(contributor=functools.partial(adversary.HostileContributor, mode))


def main(argv: list[str]) -> int:
    from p2ptrain.cli.main import main as cli_main
    from p2ptrain.run import runner

    mode, rest = argv[0], argv[1:]
    runner.run_training = functools.partial(runner.run_training, parts=parts_for(mode))
    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
