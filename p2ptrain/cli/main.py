"""`p2ptrain` entry point: argument parsing, dispatch, and the error contract.

A user mistake ends with one line on stderr, `p2ptrain: error: <what> (<advice>)`, and exit
code 2. `P2PTRAIN_DEBUG=1` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from p2ptrain import __version__
from p2ptrain.cli import common
from p2ptrain.cli.common import CLIError

# command -> module in p2ptrain.cli; modules are imported lazily so `p2ptrain status`
# does not pay for torch.
COMMANDS = {
    "init": "init",
    "join": "join",
    "status": "status",
    "bootstrap": "bootstrap",
    "demo": "demo",
    "bench": "bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2ptrain", description="Permissionless DiLoCo training over libp2p.")
    parser.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"p2ptrain.cli.{module}")
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from p2ptrain.events import setup_logging

    setup_logging(args.verbose)
    common.RESOLVED.clear()
    try:
        code = args.func(args)
    except CLIError as exc:
        if os.environ.get("P2PTRAIN_DEBUG") == "1":
            traceback.print_exc()
        advice = f" ({exc.advice})" if exc.advice else ""
        print(f"p2ptrain: error: {exc}{advice}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if os.environ.get("P2PTRAIN_DEBUG") == "1":
            raise
        print(f"p2ptrain: error: unexpected {type(exc).__name__}: {exc} "
              "(run with P2PTRAIN_DEBUG=1 for the traceback and report it)", file=sys.stderr)
        return 1
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
