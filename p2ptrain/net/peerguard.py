"""Applying per-peer limits (`p2ptrain.net.limits`) to a libp2p host.

Every inbound stream passes through `PeerGuard` before protocol negotiation: it is counted
against its peer's stream limit and reset at once when the peer is over it or banned. The
DHT reports its request frames (pending bytes) and store requests (records) through the
same guard. A DISCONNECT verdict queues the peer for `run`, which closes its connections
from its own task: closing a connection from inside one of its stream handlers would cancel
the handler mid-close.
"""

from __future__ import annotations

import logging

import trio
from libp2p.peer.id import ID

from p2ptrain.net.limits import LimitsConfig, PeerLimits, Verdict

log = logging.getLogger("p2ptrain.net.limits")


class PeerGuard:
    """Start with `await nursery.start(guard.run, host)` before the host accepts streams."""

    def __init__(self, config: LimitsConfig | None = None, events=None) -> None:
        self.limits = PeerLimits(config)
        self.events = events
        self._send, self._recv = trio.open_memory_channel(256)
        self._warned: set[tuple[bytes, Verdict]] = set()

    async def run(self, host, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        network = host.get_network()
        inner = network.common_stream_handler

        async def guarded(net_stream) -> None:
            peer = net_stream.muxed_conn.peer_id.to_bytes()
            verdict = self.limits.open_stream(peer, trio.current_time())
            if verdict is not Verdict.OK:
                self.verdict(peer, verdict, "streams")
                with trio.move_on_after(1):
                    try:
                        await net_stream.reset()
                    except Exception:
                        pass
                return
            try:
                await inner(net_stream)
            finally:
                self.limits.close_stream(peer)

        network.set_stream_handler(guarded)
        task_status.started()
        try:
            async for peer in self._recv:
                with trio.move_on_after(5):
                    try:
                        await host.disconnect(ID(peer))
                    except Exception as exc:
                        log.info("disconnecting %s failed: %r", ID(peer), exc)
        finally:
            network.set_stream_handler(inner)

    def verdict(self, peer: bytes, verdict: Verdict, what: str) -> bool:
        """Act on a verdict (log, queue a disconnect); True when the request may go ahead."""
        if verdict is Verdict.OK:
            return True
        if verdict is Verdict.DISCONNECT:
            try:
                self._send.send_nowait(peer)
            except trio.WouldBlock:
                pass  # the queue is full of disconnects already; the ban still holds
            if (peer, verdict) not in self._warned:  # one line per peer and verdict: floods stay quiet
                log.warning("peer disconnected: reason=over-limit limit=%s peer=%s usage=%s",
                            what, ID(peer), self.limits.usage(peer))
                if self.events is not None:
                    self.events.emit("peer_disconnected", remote=ID(peer).to_base58(), reason=f"over {what} limit")
        elif (peer, verdict) not in self._warned:
            log.warning("peer throttled: limit=%s peer=%s usage=%s", what, ID(peer), self.limits.usage(peer))
        if len(self._warned) > 4096:
            self._warned.clear()
        self._warned.add((peer, verdict))
        return False

    # -- hooks for the DHT -------------------------------------------------------------
    def reserve_bytes(self, peer: bytes, n: int) -> bool:
        return self.verdict(peer, self.limits.reserve_bytes(peer, n, trio.current_time()), "pending bytes")

    def release_bytes(self, peer: bytes, n: int) -> None:
        self.limits.release_bytes(peer, n)

    def admit_store(self, peer: bytes, records: int) -> bool:
        return self.verdict(peer, self.limits.dht_store(peer, records, trio.current_time()), "dht records")
