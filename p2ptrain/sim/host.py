"""Byte streams between simulated peers: what blobs (manifests, checkpoint chunks) travel on.

`SimHost` has the two methods of a libp2p host that `p2ptrain.ckpt.fetch` uses
(`set_stream_handler`, `new_stream`), so the real `BlobServer`, chunk download, donor
choice and hash checks run unchanged. Each direction of a stream delivers its writes in
order, each after the link's latency plus its bytes over the slower access link; a
partition holds them back (the reader's own timeout decides), a crash resets the stream.
"""

from __future__ import annotations

import math

import trio
from libp2p.peer.id import ID

from p2ptrain.sim.net import SimNet


class StreamReset(Exception):
    pass


class _Pipe:
    def __init__(self, net: SimNet, src: bytes, dst: bytes) -> None:
        self.net, self.src, self.dst = net, src, dst
        self.queue: list[tuple[float, bytes]] = []
        self.buf = bytearray()
        self.last = 0.0
        self.closed = self.reset = False
        self.changed = trio.Event()

    def _poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def write(self, data: bytes) -> None:
        if self.reset or not self.net.alive(self.src):
            raise StreamReset("stream reset")
        if not self.net.reachable(self.src, self.dst):
            arrival = math.inf  # held back for good: a partition outlasts the reader's patience
        else:
            arrival = max(self.last, trio.current_time() + self.net.latency(self.src, self.dst))
            arrival += len(data) / min(self.net.bandwidth(self.src), self.net.bandwidth(self.dst))
            self.last = arrival
        self.queue.append((arrival, bytes(data)))
        self._poke()
        # the writer's own link is busy while the bytes leave
        await trio.sleep(len(data) / self.net.bandwidth(self.src))

    async def read(self, n: int) -> bytes:
        while True:
            now = trio.current_time()
            while self.queue and self.queue[0][0] <= now:
                self.buf += self.queue.pop(0)[1]
            if self.buf:
                out = bytes(self.buf[:n])
                del self.buf[:n]
                return out
            if self.reset:
                raise StreamReset("stream reset")
            if self.closed and not self.queue:
                return b""
            with trio.move_on_at(self.queue[0][0] if self.queue else math.inf):
                await self.changed.wait()


class _Conn:
    def __init__(self, peer: bytes) -> None:
        self.peer_id = ID(peer)


class SimStream:
    def __init__(self, inbound: _Pipe, outbound: _Pipe, remote: bytes) -> None:
        self._in, self._out = inbound, outbound
        self.muxed_conn = _Conn(remote)

    async def read(self, n: int = 1 << 16) -> bytes:
        return await self._in.read(n)

    async def write(self, data: bytes) -> None:
        await self._out.write(data)

    async def close(self) -> None:
        self._out.closed = True
        self._out._poke()

    async def reset(self) -> None:
        for p in (self._in, self._out):
            p.reset = True
            p._poke()


class SimHost:
    """One peer's stream endpoint. Handlers run in `nursery` (the peer's own: a crash ends
    them with the peer)."""

    def __init__(self, net: SimNet, hosts: dict[bytes, "SimHost"], peer: bytes, nursery: trio.Nursery) -> None:
        self.net, self.hosts, self.peer, self.nursery = net, hosts, peer, nursery
        self.handlers: dict[str, object] = {}
        self.pipes: list[_Pipe] = []
        hosts[peer] = self

    def set_stream_handler(self, proto, handler) -> None:
        self.handlers[str(proto)] = handler

    async def new_stream(self, peer: ID, protos) -> SimStream:
        dst = peer.to_bytes()
        await trio.sleep(self.net.latency(self.peer, dst))
        if self.net.refused(self.peer, dst):
            raise ConnectionRefusedError("connection refused")
        if not self.net.reachable(self.peer, dst) or not self.net.reachable(dst, self.peer):
            await trio.sleep_forever()  # a dial into a partition: the caller's timeout decides
        other = self.hosts.get(dst)
        handler = other.handlers.get(str(protos[0])) if other is not None else None
        if handler is None:
            raise ConnectionError(f"protocol not supported: {protos[0]}")
        up, down = _Pipe(self.net, self.peer, dst), _Pipe(self.net, dst, self.peer)
        self.pipes += [up, down]
        other.pipes += [up, down]
        other.nursery.start_soon(handler, SimStream(up, down, self.peer))
        return SimStream(down, up, dst)

    def crash(self) -> None:
        """Every stream this peer had is reset (its process is gone)."""
        for p in self.pipes:
            p.reset = True
            p._poke()
        self.pipes.clear()
        self.hosts.pop(self.peer, None)
