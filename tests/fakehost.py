"""A libp2p host stand-in for the fast tier: control messages between services in one process
(what `AllReduceService` uses for votes and exchanges: one-message streams, and persistent
control streams, each write a message), with optional per-message delay and a drop rule. Bulk sessions are not served: tests on it run rounds of one member or
drive `p2ptrain.reduce.commit` directly. The real-libp2p tier is test_allreduce_integration.py."""

from __future__ import annotations

import trio
import trio.testing
from libp2p.peer.id import ID

from p2ptrain.reduce.control import check_control_length, decode_control


class FakeNet:
    def __init__(self, nursery: trio.Nursery, delay: float = 0.01) -> None:
        self.nursery = nursery
        self.delay = delay
        self.hosts: dict[bytes, FakeHost] = {}
        self.drop = lambda src, dst, msg: False  # tests replace it to withhold messages

    def host(self, peer_id: bytes) -> "FakeHost":
        h = self.hosts[peer_id] = FakeHost(self, peer_id)
        return h

    def deliver(self, src: bytes, dst: bytes, proto, data: bytes) -> None:
        if self.drop(src, dst, data):
            return
        handler = self.hosts[dst].handlers.get(proto) if dst in self.hosts else None
        if handler is not None:
            self.nursery.start_soon(self._later, handler, _InStream(src, data))

    async def _later(self, handler, stream) -> None:
        await trio.sleep(self.delay)
        await handler(stream)


class FakeHost:
    def __init__(self, net: FakeNet, peer_id: bytes) -> None:
        self.net, self.peer_id, self.handlers = net, peer_id, {}

    def set_stream_handler(self, proto, handler) -> None:
        self.handlers[proto] = handler

    async def new_stream(self, peer: ID, protos) -> "_OutStream":
        dst = self.net.hosts.get(peer.to_bytes())
        if dst is None:
            raise ConnectionError("no route")
        if protos[0] not in dst.handlers:  # libp2p's negotiation fails the same way
            raise ConnectionError(f"protocol not supported: {protos[0]}")
        return _OutStream(self, peer.to_bytes(), protos[0])


class _OutStream:
    """Each write arrives as a stream of its own holding that message: a control stream
    (one message per write, read until EOF) and a one-message stream read the same."""

    def __init__(self, host: FakeHost, dst: bytes, proto) -> None:
        self.host, self.dst, self.proto = host, dst, proto

    async def write(self, data: bytes) -> None:
        self.host.net.deliver(self.host.peer_id, self.dst, self.proto, bytes(data))

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass


class _Conn:
    def __init__(self, peer: bytes) -> None:
        self.peer_id = ID(peer)


class _InStream:
    def __init__(self, src: bytes, data: bytes) -> None:
        self.muxed_conn, self.data = _Conn(src), data

    async def read(self, n: int) -> bytes:
        out, self.data = self.data[:n], self.data[n:]
        return out

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass


def decode(msg: bytes) -> dict:
    """A packed control message back to its map (as the service's reader does)."""
    n = check_control_length(msg[:4])
    return decode_control(msg[4:4 + n])


class PipeNet:
    """Hosts whose streams are real two-way byte pipes (`trio.testing.memory_stream_pair`),
    for protocols that ask and answer on one stream (blob fetches): the serving code runs
    unchanged, only the sockets are in memory. `delay[peer]`: seconds before that peer's
    streams open (a slow peer)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.hosts: dict[bytes, PipeHost] = {}
        self.delay: dict[bytes, float] = {}

    def host(self, peer_id: bytes) -> "PipeHost":
        h = self.hosts[peer_id] = PipeHost(self, peer_id)
        return h


class PipeHost:
    def __init__(self, net: PipeNet, peer_id: bytes) -> None:
        self.net, self.peer_id, self.handlers = net, peer_id, {}

    def set_stream_handler(self, proto, handler) -> None:
        self.handlers[proto] = handler

    async def new_stream(self, peer: ID, protos) -> "_Pipe":
        dst = self.net.hosts.get(peer.to_bytes())
        if dst is None:
            raise ConnectionError("no route")
        await trio.sleep(self.net.delay.get(peer.to_bytes(), 0.0))
        if protos[0] not in dst.handlers:
            raise ConnectionError(f"protocol not supported: {protos[0]}")
        mine, theirs = trio.testing.memory_stream_pair()
        self.net.nursery.start_soon(dst.handlers[protos[0]], _Pipe(theirs, self.peer_id))
        return _Pipe(mine, dst.peer_id)


class _Pipe:
    def __init__(self, stream, remote: bytes) -> None:
        self._s, self.muxed_conn = stream, _Conn(remote)

    async def read(self, n: int) -> bytes:
        try:
            return await self._s.receive_some(n)
        except trio.ClosedResourceError:
            return b""

    async def write(self, data: bytes) -> None:
        await self._s.send_all(bytes(data))

    async def close(self) -> None:
        with trio.move_on_after(1):
            await self._s.send_eof()

    async def reset(self) -> None:
        await self._s.aclose()
