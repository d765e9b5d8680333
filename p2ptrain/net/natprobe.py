"""`python -m p2ptrain.net.natprobe`: a node that proves NAT traversal with a bulk transfer.

It joins like `p2ptrain join` (NAT traversal on, presence in a namespace) and serves a sink
protocol. Commands arrive as JSON lines on stdin, so one set of processes can run several
checks in turn:

    {"send_to": "<peer id>", "bytes": 67108864, "wait_direct": 30}

finds the peer through its DHT presence record, connects (directly, else through its relay),
waits up to `wait_direct` seconds for a direct connection (DCUtR), pushes the bytes and
emits `probe_sent` with the connection kind the stream used and the sink's SHA-256 echo.
Used by tests/test_nat.py and by operators checking a NAT by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import struct
import sys
import time

import trio

PROTOCOL = "/p2ptrain/nat-probe/1"
MAX_PROBE_BYTES = 1 << 30
CHUNK = 1 << 16
log = logging.getLogger("p2ptrain.net.natprobe")


async def _read_exactly(stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = await stream.read(min(CHUNK, n - len(buf)))
        if not part:
            raise EOFError("stream closed early")
        buf += part
    return bytes(buf)


def _stream_kind(host, stream) -> str:
    from p2ptrain.net.nat import conn_is_relayed

    muxed = stream.muxed_conn
    conns = host.get_network().connections.get(muxed.peer_id, [])
    for c in conns if isinstance(conns, list) else [conns]:
        if getattr(c, "muxed_conn", None) is muxed:
            return "relayed" if conn_is_relayed(c) else "direct"
    return "unknown"


def _serve(host, events) -> None:
    async def handle(stream) -> None:
        remote = stream.muxed_conn.peer_id.to_base58()
        try:
            with trio.fail_after(600):
                (n,) = struct.unpack(">Q", await _read_exactly(stream, 8))
                if n > MAX_PROBE_BYTES:
                    log.warning("probe from %s dropped: reason=too-large (%d bytes)", remote, n)
                    await stream.reset()
                    return
                digest, left, t0 = hashlib.sha256(), n, time.monotonic()
                while left:
                    part = await stream.read(min(CHUNK, left))
                    if not part:
                        raise EOFError("stream closed early")
                    digest.update(part)
                    left -= len(part)
                await stream.write(digest.digest())
                events.emit("probe_received", remote=remote, bytes=n, kind=_stream_kind(host, stream),
                            seconds=round(time.monotonic() - t0, 3))
                await stream.close()
        except (Exception, trio.TooSlowError) as exc:  # noqa: BLE001 - a bad probe never kills the node
            log.warning("probe from %s dropped: %s", remote, exc)
            try:
                await stream.reset()
            except Exception:  # noqa: BLE001
                pass

    host.set_stream_handler(PROTOCOL, handle)


async def _send(node, events, cmd: dict) -> None:
    from libp2p.peer.id import ID

    from p2ptrain.identity import peer_id_from_str
    from p2ptrain.net.nat import connection_kinds
    from p2ptrain.records import RunRecords

    target, size = str(cmd["send_to"]), int(cmd.get("bytes", 1 << 20))
    namespace = cmd.get("namespace", "lobby")
    t0 = trio.current_time()
    with trio.fail_after(float(cmd.get("find_timeout", 60))):
        while True:
            peers = await RunRecords(node.dht, namespace).read_presence()
            if target in peers:
                break
            await trio.sleep(0.5)
    addrs = peers[target]["addrs"]
    events.emit("probe_found", remote=target, addrs=addrs, seconds=round(trio.current_time() - t0, 3))
    pid = peer_id_from_str(target)
    node.rpc.learn_addrs(pid, addrs)
    # A connection the other side already opened (a public peer reaches a NATed one through
    # its relay, e.g. for the DHT) is reused by connect: then "first" says nothing about our dial.
    existing = connection_kinds(node.host).get(target)
    await node.rpc.connect(pid, addrs, float(cmd.get("connect_timeout", 30)))
    first = connection_kinds(node.host).get(target)
    events.emit("probe_connected", remote=target, kind=first, existing=existing,
                seconds=round(trio.current_time() - t0, 3))
    with trio.move_on_after(float(cmd.get("wait_direct", 0))):
        while connection_kinds(node.host).get(target) == "relayed":
            await trio.sleep(0.1)
    kind_before = connection_kinds(node.host).get(target)
    payload = os.urandom(CHUNK)
    digest = hashlib.sha256()
    t1 = time.monotonic()
    stream = await node.host.new_stream(ID(pid), [PROTOCOL])
    used = _stream_kind(node.host, stream)
    with trio.fail_after(float(cmd.get("transfer_timeout", 300))):
        await stream.write(struct.pack(">Q", size))
        left = size
        while left:
            part = payload[:min(CHUNK, left)]
            digest.update(part)
            await stream.write(part)
            left -= len(part)
        echo = await _read_exactly(stream, 32)
    seconds = time.monotonic() - t1
    await stream.close()
    events.emit("probe_sent", remote=target, bytes=size, kind=used, peer_kind=kind_before,
                first_kind=first, existing=existing, seconds=round(seconds, 3), mb_per_s=round(size / seconds / 1e6, 2),
                sha_ok=echo == digest.digest())


async def _commands(node, events) -> None:
    while True:
        line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        if not line:
            return
        try:
            cmd = json.loads(line)
            await _send(node, events, cmd)
        except (Exception, trio.TooSlowError) as exc:  # noqa: BLE001 - report and take the next command
            events.emit("probe_failed", error=f"{type(exc).__name__}: {str(exc)[:300]}")


def main(argv: list[str] | None = None) -> int:
    from p2ptrain.events import EventSink
    from p2ptrain.identity import load_or_create
    from p2ptrain.net.nat import NatConfig, connection_kinds
    from p2ptrain.net.node import Node, NodeConfig
    from p2ptrain.net.presence import Presence, PresenceConfig

    p = argparse.ArgumentParser(prog="python -m p2ptrain.net.natprobe")
    p.add_argument("--bootstrap", action="append", required=True)
    p.add_argument("--listen", action="append", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--namespace", default="lobby")
    p.add_argument("--reachability", default="auto", choices=["auto", "public", "private"])
    p.add_argument("--dht-client", action="store_true",
                   help="do not serve the DHT, so no peer dials this node before it dials them")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if os.environ.get("P2PTRAIN_DEBUG"):
        for name in ("p2ptrain", "libp2p.relay", "libp2p.network.swarm"):
            logging.getLogger(name).setLevel(logging.DEBUG)
    identity = load_or_create(args.key)
    events = EventSink(identity.peer_id_str, args.json)
    node = Node(identity, NodeConfig(listen=args.listen, bootstrap=args.bootstrap), events,
                dht_server=not args.dht_client, nat=NatConfig(reachability=args.reachability))

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            _serve(node.host, events)
            presence = Presence(node.dht, node.rpc.local_addrs(), events, PresenceConfig(namespace=args.namespace),
                                role="probe", conns=lambda: connection_kinds(node.host))
            await nursery.start(presence.run)
            events.emit("probe_ready", addrs=node.rpc.local_addrs(), reachability=node.nat.reachability)
            await _commands(node, events)
            nursery.cancel_scope.cancel()

    try:
        trio.run(run)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
