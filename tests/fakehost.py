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


# -- byte streams with flow control (serving blobs) -------------------------------------------
class _Pipe:
    """One direction of an in-memory stream: a writer waits while `cap` bytes are unread, as a
    libp2p stream's writer waits for its window."""

    def __init__(self, cap: int) -> None:
        self.buf, self.cap, self.eof, self.broken = bytearray(), cap, False, False
        self._changed = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def write(self, data: bytes) -> None:
        data = memoryview(bytes(data))
        while len(data):
            if self.broken:
                raise ConnectionResetError("stream reset")
            room = self.cap - len(self.buf)
            if room <= 0:
                await self._changed.wait()
                continue
            self.buf += data[:room]
            data = data[room:]
            self._notify()

    async def read(self, n: int) -> bytes:
        while not self.buf or self.broken:  # a reset drops what was not read yet
            if self.broken:
                raise ConnectionResetError("stream reset")
            if self.eof:
                return b""
            await self._changed.wait()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        self._notify()
        return out


class PipeStream:
    def __init__(self, peer: bytes, inbound: _Pipe, outbound: _Pipe) -> None:
        self.muxed_conn, self.inbound, self.outbound = _Conn(peer), inbound, outbound

    async def read(self, n: int) -> bytes:
        return await self.inbound.read(n)

    async def write(self, data: bytes) -> None:
        await self.outbound.write(data)

    async def close(self) -> None:
        self.outbound.eof = True
        self.outbound._notify()

    async def reset(self) -> None:
        for pipe in (self.inbound, self.outbound):
            pipe.broken = True
            pipe._notify()


class PipeNet:
    """Hosts whose streams are two-way byte pipes with flow control (`cap` unread bytes per
    direction, as a libp2p stream's window), for protocols that ask and answer on one stream
    (blob fetches): the serving code runs unchanged, only the sockets are in memory.
    `delay[peer]`: seconds before that peer's streams open (a slow peer)."""

    def __init__(self, nursery: trio.Nursery, cap: int = 64 << 10) -> None:
        self.nursery, self.cap, self.hosts = nursery, cap, {}
        self.delay: dict[bytes, float] = {}

    def host(self, peer_id: bytes) -> "PipeHost":
        h = self.hosts[peer_id] = PipeHost(self, peer_id)
        return h


class PipeHost:
    def __init__(self, net: PipeNet, peer_id: bytes) -> None:
        self.net, self.peer_id, self.handlers = net, peer_id, {}

    def set_stream_handler(self, proto, handler) -> None:
        self.handlers[proto] = handler

    async def new_stream(self, peer: ID, protos) -> PipeStream:
        dst = self.net.hosts.get(peer.to_bytes())
        if dst is None:
            raise ConnectionError("no route")
        await trio.sleep(self.net.delay.get(peer.to_bytes(), 0.0))
        if protos[0] not in dst.handlers:  # libp2p's negotiation fails the same way
            raise ConnectionError(f"protocol not supported: {protos[0]}")
        there, back = _Pipe(self.net.cap), _Pipe(self.net.cap)
        self.net.nursery.start_soon(dst.handlers[protos[0]], PipeStream(self.peer_id, there, back))
        return PipeStream(peer.to_bytes(), back, there)
