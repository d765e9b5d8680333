"""The bootstrap node: a DHT server, a circuit relay v2 hop and an AutoNAT service.

A bootstrap is only an entry point. It publishes no presence (it is infrastructure, not a
trainer) and holds no state the network depends on: records are replicated on ordinary
peers, so the network keeps working when every bootstrap is gone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio
from libp2p.relay.circuit_v2 import CircuitV2Protocol, RelayLimits
from libp2p.tools.anyio_service import background_trio_service

from p2ptrain.events import EventSink
from p2ptrain.identity import Identity
from p2ptrain.net.libp2p_compat import fresh_dial_autonat
from p2ptrain.net.node import Node, NodeConfig

log = logging.getLogger("p2ptrain.bootstrap")


@dataclass
class RelayConfig:
    max_reservations: int = 128
    """Peers that may hold a relay slot at once."""
    max_circuits: int = 8
    """Concurrent relayed connections per peer."""
    max_circuit_seconds: int = 1800
    """Lifetime of one relayed connection. Peers that cannot hole-punch run whole all-reduce
    rounds over it, so a short cap (go-libp2p's 2 min) would cut rounds in half; when it
    expires, peers re-dial through the relay."""
    max_circuit_bytes: int = 128 * 1024 * 1024
    """Bytes one relayed connection may carry; bulk traffic belongs on direct links."""
    reservation_ttl: int = 3600
    """Seconds a reservation lasts before the peer must renew it."""
    report_interval: float = 1.0
    """Seconds between `relay_bytes` events (emitted only when the counts changed)."""

    def __post_init__(self) -> None:
        for name in ("max_reservations", "max_circuits", "max_circuit_seconds", "max_circuit_bytes",
                     "reservation_ttl"):
            if getattr(self, name) < 1:
                raise ValueError(f"relay.{name} must be >= 1")
        if self.report_interval <= 0:
            raise ValueError("relay.report_interval must be > 0")

    def limits(self) -> RelayLimits:
        return RelayLimits(duration=self.max_circuit_seconds, data=self.max_circuit_bytes,
                           max_circuit_conns=self.max_circuits, max_reservations=self.max_reservations,
                           reservation_ttl=self.reservation_ttl)


class _CountingStream:
    """The write side of one relay direction, counting what passes through it."""

    def __init__(self, stream, counts: dict, key: tuple[str, str]) -> None:
        self._stream, self._counts, self._key = stream, counts, key

    async def write(self, data: bytes) -> None:
        self._counts[self._key] = self._counts.get(self._key, 0) + len(data)
        await self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class CountingRelay(CircuitV2Protocol):
    """The relay hop, counting bytes per direction of every circuit: (from peer, to peer).

    The counts are how an operator (and the NAT tests) see what a relay actually carries;
    after a DCUtR upgrade a pair's counts must stop growing."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.relayed: dict[tuple[str, str], int] = {}

    async def _relay_data(self, src_stream, dst_stream, peer_id, *args, **kwargs):
        try:
            key = (src_stream.muxed_conn.peer_id.to_base58(), dst_stream.muxed_conn.peer_id.to_base58())
        except Exception:  # noqa: BLE001 - count under the reservation's peer if the conn is odd
            key = (str(peer_id), "?")
        self.relayed.setdefault(key, 0)
        return await super()._relay_data(src_stream, _CountingStream(dst_stream, self.relayed, key),
                                          peer_id, *args, **kwargs)

    def stats(self) -> dict:
        return {"total": sum(self.relayed.values()), "circuits": [
            {"src": a, "dst": b, "bytes": n} for (a, b), n in sorted(self.relayed.items())]}


async def _report_relay(hop: CountingRelay, events: EventSink, interval: float) -> None:
    """A `relay_bytes` event whenever the counts changed (at most once per interval)."""
    last = None
    while True:
        await trio.sleep(interval)
        stats = hop.stats()
        if stats != last:
            events.emit("relay_bytes", **stats)
            last = stats


class AddressFirstSink(EventSink):
    """Prints the node's full multiaddr as the very first stdout line (in both modes), so
    scripts can `head -1` it, then behaves as a normal event sink."""

    def emit(self, event: str, **fields):
        if event == "listening" and fields.get("addrs"):
            self.out.write(fields["addrs"][0] + "\n")
            self.out.flush()
        return super().emit(event, **fields)


async def run_bootstrap(identity: Identity, node_config: NodeConfig, relay: RelayConfig,
                        events: EventSink, limits=None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """`limits`: per-peer limits (p2ptrain.net.limits.LimitsConfig; None = its defaults)."""
    node = Node(identity, node_config, events, limits=limits)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        hop = CountingRelay(node.host, limits=relay.limits(), allow_hop=True)
        fresh_dial_autonat(node.host, node_config.dial_timeout)
        async with background_trio_service(hop):
            await hop.event_started.wait()
            events.emit("bootstrap_ready", relay=True, autonat=True,
                        max_reservations=relay.max_reservations)
            task_status.started(node)
            await _report_relay(hop, events, relay.report_interval)
