"""What every command shares: CLIError, the one place config is resolved, and the
trio entry point that turns SIGINT/SIGTERM into a clean shutdown.

Every command module imports this one while the parser is built, so `--help` costs what
this module's imports cost: trio, libp2p and the config machinery load inside the functions
that use them (issue 33: torch, numba and libp2p made every `--help` take 2-5 s)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from p2ptrain.identity import Identity
    from p2ptrain.net.node import NodeConfig

DEFAULT_HOME = Path(os.environ.get("P2PTRAIN_HOME", "~/.p2ptrain")).expanduser()

# ("[section] field", value, source) of every config this command resolved, in order: what
# `-v` and `--show-config` print (`show_config`). Cleared by `main` at each command.
RESOLVED: list[tuple[str, Any, str]] = []


class CLIError(Exception):
    """A user-facing failure: printed as one line with advice, exit code 2."""

    def __init__(self, message: str, advice: str = "", code: int = 2) -> None:
        super().__init__(message)
        self.advice = advice
        self.code = code


def add_node_args(p, listen_default: str | None = None) -> None:
    p.add_argument("--listen", action="append", metavar="MADDR", help="multiaddr to listen on (repeatable)")
    p.add_argument("--announce", action="append", metavar="MADDR", help="address to advertise instead")
    p.add_argument("--key", metavar="FILE", help="Ed25519 key file (created on first use, mode 0600)")
    p.add_argument("--config", metavar="TOML", help="config file; flags > P2PTRAIN_* env > file > defaults")
    p.add_argument("--json", action="store_true", help="one JSON event per line on stdout")
    p.add_argument("--show-config", action="store_true",
                   help="print each resolved setting and where it came from (flag, P2PTRAIN_* env, file, default)")


def node_config(args, **extra: Any) -> tuple[NodeConfig, dict]:
    """NodeConfig from flags > env > TOML [node] > defaults; returns the TOML too."""
    from p2ptrain.config import ConfigError, load_toml
    from p2ptrain.net.node import NodeConfig, NodeError

    try:
        toml = load_toml(getattr(args, "config", None))
        flags = {"listen": args.listen, "announce": args.announce,
                 "bootstrap": getattr(args, "bootstrap", None), **extra}
        return _resolve(NodeConfig, flags, toml, "node"), toml
    except NodeError as exc:
        raise CLIError(str(exc), exc.advice) from None
    except ConfigError as exc:
        raise CLIError(str(exc), "fix the flag, the P2PTRAIN_* variable or the config file") from None


def run_id_arg(text: str) -> str:
    """A `--run` value, checked before any network work (a typo would otherwise be looked up
    in the DHT until the manifest wait gives up)."""
    from p2ptrain.run import manifest as mf

    try:
        return mf.parse_run_id(text)
    except mf.ManifestError as exc:
        raise CLIError(str(exc), "copy the whole run id, or pass --manifest RUN_TOML") from None


def section(cls, toml: dict, name: str, flags: dict | None = None):
    from p2ptrain.config import ConfigError

    try:
        return _resolve(cls, flags or {}, toml, name)
    except ConfigError as exc:
        raise CLIError(str(exc), "fix the flag, the P2PTRAIN_* variable or the config file") from None


def _resolve(cls, flags: dict, toml: dict, name: str):
    from p2ptrain.config import describe, resolve

    sources: dict[str, str] = {}
    obj = resolve(cls, flags, toml, name, sources=sources)
    RESOLVED.extend(describe(obj, sources, name))
    return obj


def show_config(args) -> None:
    """With -v or --show-config: every setting resolved so far, its value and its source, on
    stderr (stdout carries --json events)."""
    import sys

    if not (getattr(args, "verbose", False) or getattr(args, "show_config", False)):
        return
    rows = RESOLVED
    width = max((len(n) for n, _, _ in rows), default=0)
    lines = ["effective configuration (flag > P2PTRAIN_* env > --config file > default):"]
    lines += [f"  {n:<{width}} = {v!r}  ({src})" for n, v, src in rows]
    print("\n".join(lines), file=sys.stderr, flush=True)


def load_identity(args, default_name: str = "node.key") -> Identity:
    from p2ptrain.identity import IdentityError, load_or_create

    path = Path(args.key).expanduser() if getattr(args, "key", None) else DEFAULT_HOME / default_name
    try:
        return load_or_create(path)
    except IdentityError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot read or create key file {path}: {exc.strerror}",
                       "pass --key with a writable path") from None


def run_service(main: Callable[[], Awaitable[Any]]) -> Any:
    """Run `main` under trio; SIGINT/SIGTERM cancel it cleanly (exit code 0)."""
    import signal

    import trio

    from p2ptrain.net.node import NodeError

    async def wrapper() -> Any:
        result = None
        async with trio.open_nursery() as nursery:
            async def watch_signals() -> None:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        return

            async def body() -> None:
                nonlocal result
                result = await main()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_signals)
            nursery.start_soon(body)
        return result

    try:
        return trio.run(wrapper)
    except NodeError as exc:
        raise CLIError(str(exc), exc.advice) from None
    except BaseExceptionGroup as group:
        # Surface a lone user-facing error from inside the nursery as itself.
        leaves = _leaves(group)
        for leaf in leaves:
            if isinstance(leaf, NodeError):
                raise CLIError(str(leaf), leaf.advice) from None
            if isinstance(leaf, CLIError):
                raise leaf from None
        raise


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]
