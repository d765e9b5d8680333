"""`p2ptrain status`: the network as a short-lived DHT client sees it."""

from __future__ import annotations

import json
import sys

from p2ptrain.cli.common import CLIError, add_node_args, node_config, run_service


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="show the peers the network knows about")
    p.add_argument("--bootstrap", action="append", metavar="MADDR", help="entry point (repeatable)")
    p.add_argument("--namespace", default="lobby", help="presence namespace (a run id, or 'lobby')")
    add_node_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import trio

    from p2ptrain.events import EventSink
    from p2ptrain.identity import Identity
    from p2ptrain.node import Node
    from p2ptrain.presence import read_peers

    if not args.listen:
        args.listen = ["/ip4/127.0.0.1/tcp/0"]  # a client needs no reachable address
    cfg, _ = node_config(args)
    if not cfg.bootstrap:
        raise CLIError("no bootstrap given", "pass --bootstrap /ip4/.../tcp/.../p2p/<peer id>")
    identity = Identity.generate()  # a throwaway client identity: status publishes nothing
    events = EventSink(identity.peer_id_str, False)

    async def main() -> dict:
        node = Node(identity, cfg, events, dht_server=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            peers = await read_peers(node.dht, args.namespace)
            nursery.cancel_scope.cancel()
        return peers

    peers = run_service(main) or {}
    if args.json:
        print(json.dumps({"event": "status", "t": round(__import__("time").time(), 3),
                          "peer": identity.peer_id_str, "namespace": args.namespace,
                          "peers": [{"remote": p, **info} for p, info in sorted(peers.items())]}))
    else:
        print(f"{len(peers)} peer(s) in '{args.namespace}':")
        for p, info in sorted(peers.items()):
            print(f"  {p}  {info['role']:<6} {' '.join(info['addrs'])}")
    sys.stdout.flush()
    return 0
