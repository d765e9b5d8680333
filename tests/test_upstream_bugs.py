"""Tests that SHOW the py-libp2p bugs we work around (p2ptrain/net/libp2p_compat.py,
docs/UPSTREAM.md). When one of these starts failing, upstream fixed the bug: drop the
matching workaround and this test."""

from __future__ import annotations

import socket

import multiaddr
import trio

from p2ptrain.identity import Identity
from p2ptrain.net.node import NodeConfig, build_host


def test_bug1_listen_on_taken_port_fails_silently():
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    port = plain.getsockname()[1]

    async def main() -> tuple[int, int]:
        cfg = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])
        h1 = build_host(Identity.generate(), cfg)
        h2 = build_host(Identity.generate(), cfg)
        h3 = build_host(Identity.generate(), cfg)
        taken = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")
        async with h1.run([taken]):  # no exception although the port is taken...
            n1 = len(h1.get_network().listeners)
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        port2 = free.getsockname()[1]
        free.close()
        shared = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port2}")
        async with h2.run([shared]), h3.run([shared]):  # ...and two nodes share one port
            n23 = len(h2.get_network().listeners) + len(h3.get_network().listeners)
        return n1, n23

    try:
        n1, n23 = trio.run(main)
    finally:
        plain.close()
    assert n1 == 0, "upstream now reports a taken port: drop probe_tcp_ports/check_listening"
    assert n23 == 2, "upstream no longer lets two nodes share a port via SO_REUSEPORT"


def test_bug2_swarm_never_dials_circuit_addresses():
    """A peer known only by a relay address: the swarm refuses to dial it at all."""
    from libp2p.network.exceptions import SwarmException
    from libp2p.peer.id import ID

    async def main() -> str:
        host = build_host(Identity.generate(), NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
        relay, target = Identity.generate().peer_id_str, Identity.generate()
        circuit = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/9/p2p/{relay}/p2p-circuit")
        async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            host.get_peerstore().add_addrs(ID(target.peer_id), [circuit], 60)
            try:
                await host.get_network().dial_peer(ID(target.peer_id))
            except SwarmException as exc:
                return str(exc)
        return "dialed"

    assert "relay-only" in trio.run(main)


def test_bug5_per_peer_stream_limits_are_never_enforced():
    """py-libp2p's ResourceManager accepts per-peer stream limits (per protocol or service),
    but the swarm only ever calls its node-wide `acquire_stream`; `acquire_scoped_stream`
    has no caller. So one peer can hold any number of streams up to the node-wide cap
    (10,000 by default), starving everyone. Workaround: p2ptrain/net/peerguard.py counts
    inbound streams per peer itself (p2ptrain/net/limits.py)."""
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import PeerInfo
    from libp2p.rcmgr import new_resource_manager

    proto = TProtocol("/p2ptrain/test-hold/1.0.0")
    rm = new_resource_manager()
    rm.set_protocol_peer_stream_limit(proto, 2)
    listen = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")

    async def main() -> int:
        server = new_host(key_pair=create_new_key_pair(b"\x03" * 32), muxer_preference="YAMUX",
                          resource_manager=rm)
        client = new_host(key_pair=create_new_key_pair(b"\x04" * 32), muxer_preference="YAMUX")
        held = 0
        release = trio.Event()

        async def hold(stream) -> None:
            nonlocal held
            held += 1
            await release.wait()

        server.set_stream_handler(proto, hold)
        async with server.run([listen]), client.run([listen]):
            await client.connect(PeerInfo(server.get_id(), server.get_addrs()))
            streams = []
            with trio.move_on_after(10):
                for _ in range(6):
                    streams.append(await client.new_stream(server.get_id(), [proto]))
                while held < 6:
                    await trio.sleep(0.05)
            release.set()
            return held

    held = trio.run(main)
    assert held == 6, "upstream now enforces per-peer stream limits: consider the ResourceManager"


def test_bug6_autonat_dial_back_reuses_the_askers_connection():
    """Asked to dial back a closed port, the stock AutoNAT server says OK: it 'dials' over
    the connection the question came on. The workaround's fresh dial says E_DIAL_ERROR."""
    from libp2p.host.autonat.autonat import AutoNATService
    from libp2p.host.autonat.pb.autonat_pb2 import Message
    from libp2p.peer.peerinfo import PeerInfo

    from p2ptrain.net.libp2p_compat import fresh_dial_autonat

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there

    async def verdict(make_server) -> int:
        cfg = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])
        server, client = build_host(Identity.generate(), cfg), build_host(Identity.generate(), cfg)
        loop = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
        async with server.run(loop), client.run(loop):
            make_server(server)
            await client.connect(PeerInfo(server.get_id(), server.get_addrs()))
            asker = AutoNATService(client, serve=False)
            with trio.fail_after(20):
                status, _ = await asker.query_server(
                    server.get_id(), [multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}").to_bytes()])
            return status

    assert trio.run(verdict, lambda h: AutoNATService(h, serve=True)) == Message.OK  # the bug
    assert trio.run(verdict, fresh_dial_autonat) == Message.E_DIAL_ERROR  # the workaround


def test_bug8_new_stream_fails_instead_of_dialing_when_every_listed_connection_is_closed():
    """A connection whose close is under way (or was cancelled: it then stays listed for
    good) makes `Swarm.new_stream` raise although the peer is right there; with the
    workaround (`prune_closed_connections`, installed by build_host) the swarm dials again."""
    from libp2p.custom_types import TProtocol
    from libp2p.network.exceptions import SwarmException
    from libp2p.peer.peerinfo import PeerInfo

    proto = TProtocol("/p2ptrain/test-bug8/1")

    async def main() -> tuple[str, bool]:
        cfg = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])
        a, b = build_host(Identity.generate(), cfg), build_host(Identity.generate(), cfg)
        listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]

        async def echo(stream):
            await stream.close()

        b.set_stream_handler(proto, echo)
        async with a.run(listen), b.run(listen):
            await a.connect(PeerInfo(b.get_id(), b.get_addrs()))
            swarm = a.get_network()

            def close_in_place() -> None:  # closed as far as the connection knows, still listed
                for conn in swarm.get_connections(b.get_id()):
                    conn.event_closed.set()

            close_in_place()
            try:
                await swarm.p2ptrain_unpruned_new_stream(b.get_id())
                bug = "opened"
            except SwarmException as exc:
                bug = str(exc)
            close_in_place()
            stream = await a.new_stream(b.get_id(), [proto])  # the workaround: pruned, dialed again
            await stream.close()
            return bug, True

    bug, fixed = trio.run(main)
    assert "No valid connections available" in bug, bug
    assert fixed
