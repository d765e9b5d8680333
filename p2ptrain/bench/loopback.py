"""In-process clusters on 127.0.0.1 for benches and tests: real libp2p nodes, each with an
all-reduce service, started in the caller's nursery and knowing each other's addresses."""

from __future__ import annotations

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


async def service_cluster(nursery, classes, **cfg) -> tuple[list, list]:
    """One node and one service of each class in `classes` (an AllReduceService or a hostile
    subclass); `cfg`: AllReduceConfig fields. Returns (nodes, services)."""
    from p2ptrain.events import EventSink
    from p2ptrain.identity import Identity
    from p2ptrain.net.node import Node, NodeConfig
    from p2ptrain.reduce.service import AllReduceConfig

    nodes, svcs = [], []
    for cls in classes:
        ident = Identity.generate()
        node = Node(ident, NodeConfig(listen=[LOOPBACK]), EventSink(ident.peer_id_str, False))
        await nursery.start(node.run)
        svc = cls(node.host, ident, AllReduceConfig(**cfg))
        await nursery.start(svc.run)
        nodes.append(node)
        svcs.append(svc)
    for n in nodes:
        for m in nodes:
            if m is not n:
                n.rpc.learn_addrs(m.identity.peer_id, [a.split("/p2p/")[0] for a in m.full_addrs()])
    return nodes, svcs
