"""`p2ptrain join`: join the network, publish presence, keep running until interrupted."""

from __future__ import annotations

from pathlib import Path

from p2ptrain.cli.common import DEFAULT_HOME, CLIError, add_node_args, load_identity, node_config, run_service, section


def add_parser(sub) -> None:
    p = sub.add_parser("join", help="join the network (and later a training run)")
    p.add_argument("--bootstrap", action="append", metavar="MADDR", required=False,
                   help="entry point /ip4/.../tcp/.../p2p/<id> (repeatable)")
    p.add_argument("--workdir", metavar="DIR", help=f"state directory (default {DEFAULT_HOME})")
    add_node_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from p2ptrain.events import EventSink
    from p2ptrain.node import Node
    from p2ptrain.presence import Presence, PresenceConfig

    cfg, toml = node_config(args)
    if not cfg.bootstrap:
        raise CLIError("no bootstrap given", "pass --bootstrap /ip4/.../tcp/.../p2p/<peer id>")
    presence_cfg = section(PresenceConfig, toml, "presence")
    if args.workdir and not args.key:
        workdir = Path(args.workdir).expanduser()
        workdir.mkdir(parents=True, exist_ok=True)
        args.key = str(workdir / "node.key")
    identity = load_identity(args)
    events = EventSink(identity.peer_id_str, args.json)

    async def main() -> None:
        import trio

        node = Node(identity, cfg, events)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                presence = Presence(node.dht, node.rpc.local_addrs(), events, presence_cfg)
                await nursery.start(presence.run)
                await trio.sleep_forever()
        finally:
            events.emit("left")

    run_service(main)
    return 0
