"""How DHT nodes reach each other: the RPC interface and an in-memory implementation.

`DHTNode` talks only to `RpcTransport`. Production uses `Libp2pRpc` (dht/libp2p_rpc.py),
persistent streams over authenticated libp2p connections. Fast deterministic tests use
`MemoryNetwork`, which still runs every message through the real framing and size-limited
decoder, so only the sockets are fake, and runs under trio's autojump clock.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Protocol

import trio

from p2ptrain.dht import protocol

log = logging.getLogger("p2ptrain.dht")

# handler(sender peer id, method, body) -> reply body; raise RpcReject to answer an error.
Handler = Callable[[bytes, str, dict], Awaitable[dict]]


class RpcError(Exception):
    """A call that did not get a valid reply (unreachable, timeout, malformed, rejected)."""


class RpcReject(Exception):
    """Raised by a handler to answer with an error reason instead of a body."""


class RpcTransport(Protocol):
    local_peer: bytes

    def serve(self, handler: Handler) -> None: ...

    async def call(self, peer: bytes, method: str, body: dict, timeout: float) -> dict: ...

    def learn_addrs(self, peer: bytes, addrs: list[str]) -> None: ...

    def addrs_of(self, peer: bytes) -> list[str]: ...

    def local_addrs(self) -> list[str]: ...


class MemoryNetwork:
    """A set of in-process transports with a fixed one-way latency and killable peers."""

    def __init__(self, latency: float = 0.001, max_frame: int = protocol.DEFAULT_MAX_FRAME) -> None:
        self.latency = latency
        self.max_frame = max_frame
        self.nodes: dict[bytes, "MemoryTransport"] = {}
        self.down: set[bytes] = set()

    def transport(self, peer: bytes) -> "MemoryTransport":
        t = MemoryTransport(self, peer)
        self.nodes[peer] = t
        return t

    async def deliver(self, sender: bytes, peer: bytes, payload: bytes) -> bytes:
        await trio.sleep(self.latency)
        target = self.nodes.get(peer)
        if target is None or peer in self.down or sender in self.down:
            raise RpcError("unreachable")
        reply = await target.receive(sender, payload)
        await trio.sleep(self.latency)
        return reply


class MemoryTransport:
    def __init__(self, net: MemoryNetwork, peer: bytes) -> None:
        self.net = net
        self.local_peer = peer
        self._handler: Handler | None = None
        self._next_id = 0

    def serve(self, handler: Handler) -> None:
        self._handler = handler

    def learn_addrs(self, peer: bytes, addrs: list[str]) -> None:
        pass

    def addrs_of(self, peer: bytes) -> list[str]:
        return [f"/memory/{peer.hex()[-8:]}"] if peer in self.net.nodes else []

    def local_addrs(self) -> list[str]:
        return self.addrs_of(self.local_peer)

    async def receive(self, sender: bytes, payload: bytes) -> bytes:
        try:
            return await serve_frame(self._handler, sender, payload, self.net.max_frame)
        except protocol.FrameError as exc:
            log.warning("frame dropped: reason=%s from=%s", exc, sender.hex()[-8:])
            raise RpcError("dropped") from None

    async def call(self, peer: bytes, method: str, body: dict, timeout: float) -> dict:
        self._next_id += 1
        req_id = self._next_id
        payload = protocol.frame([req_id, method, body])
        with trio.move_on_after(timeout) as scope:
            reply = await self.net.deliver(self.local_peer, peer, payload)
        if scope.cancelled_caught:
            raise RpcError("timeout")
        return parse_reply(reply, req_id, self.net.max_frame)


async def serve_frame(handler: Handler | None, sender: bytes, payload: bytes, max_frame: int) -> bytes:
    """Decode one request frame, run the handler, encode its reply (shared by transports)."""
    n = protocol.check_length(payload[: protocol.HEADER.size], max_frame)
    req_id, method, body = protocol.decode_request(payload[protocol.HEADER.size:][:n], max_frame)
    if handler is None:
        return protocol.frame([req_id, False, "not-serving"])
    try:
        result = await handler(sender, method, body)
    except RpcReject as exc:
        return protocol.frame([req_id, False, str(exc)])
    return protocol.frame([req_id, True, result])


def parse_reply(payload: bytes, req_id: int, max_frame: int) -> dict:
    try:
        n = protocol.check_length(payload[: protocol.HEADER.size], max_frame)
        rid, ok, body = protocol.decode_reply(payload[protocol.HEADER.size:][:n], max_frame)
    except protocol.FrameError as exc:
        raise RpcError(f"bad reply: {exc}") from None
    if rid != req_id:
        raise RpcError("reply for another request")
    if not ok:
        raise RpcError(f"rejected: {body}")
    if not isinstance(body, dict):
        raise RpcError("bad reply: body is not a map")
    return body
