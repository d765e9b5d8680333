"""`p2ptrain bench NAME`: benchmarks that print ratios against a baseline or a ceiling
measured in the same run (these shared 2-core machines are too noisy for absolute goals)."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "dht": "p2ptrain.bench.dht",
    "kernels": "p2ptrain.bench.kernels",
    "allreduce": "p2ptrain.bench.allreduce",
    "diloco": "p2ptrain.bench.diloco",
    "checkpoint": "p2ptrain.bench.checkpoint",
    "churn": "p2ptrain.bench.churn",
    "scale": "p2ptrain.bench.scale",
    "robust": "p2ptrain.bench.robust",
    "redteam": "p2ptrain.bench.redteam",
    "throughput": "p2ptrain.bench.throughput",
    "ranks": "p2ptrain.bench.ranks",
    "utilization": "p2ptrain.bench.utilization",
    "exchange": "p2ptrain.bench.exchange",
    "readpause": "p2ptrain.bench.readpause",
    "lossgate": "p2ptrain.bench.lossgate",
    "sim": "p2ptrain.bench.sim",
}


class _LazyParser(argparse.ArgumentParser):
    """A bench's parser, given its arguments only when it is the one being parsed: the bench
    modules import numpy, trio and libp2p, and `p2ptrain --help` (or `join`) must not wait
    for thirteen of them (issue 33)."""

    def __init__(self, *args, module: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._module = module

    def _parse_known_args(self, *args, **kwargs):  # every public parse path, in 3.11 to 3.13, comes here
        if self._module:
            module, self._module = self._module, ""
            try:
                importlib.import_module(module).add_arguments(self)
            except Exception:  # a broken bench fails when it is run, never the other commands
                pass
            # parse_known_args filled in defaults before it came here: do it for the arguments
            # just added, or an option left out is missing from the namespace
            ns = args[1] if len(args) > 1 else kwargs.get("namespace")
            for action in self._actions:
                if (action.dest is not argparse.SUPPRESS and action.default is not argparse.SUPPRESS
                        and ns is not None and not hasattr(ns, action.dest)):
                    setattr(ns, action.dest, action.default)
        return super()._parse_known_args(*args, **kwargs)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark (" + ", ".join(BENCHES) + ")")
    bsub = p.add_subparsers(dest="bench", metavar="NAME", parser_class=_LazyParser)
    bsub.required = True
    for name, module in BENCHES.items():
        bp = bsub.add_parser(name, help=f"{name} benchmark", module=module)
        bp.set_defaults(func=_runner(module))


def _runner(module: str):
    def run(args) -> int:
        try:
            bench = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name not in ("p2ptrain.bench", module):
                raise
            # the lab is left out of the installed package (issue 33): it runs from a checkout
            from p2ptrain.cli.common import CLIError

            raise CLIError("the benchmarks are not installed with the package",
                           "run `p2ptrain bench ...` in the root of a p2ptrain source checkout") from None
        return bench.run(args)

    return run
