"""The bootstrap node: a DHT server, a circuit relay v2 hop and an AutoNAT service.

A bootstrap is only an entry point. It publishes no presence (it is infrastructure, not a
trainer) and holds no state the network depends on: records are replicated on ordinary
peers, so the network keeps working when every bootstrap is gone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.relay.circuit_v2 import CircuitV2Protocol, RelayLimits
from libp2p.tools.anyio_service import background_trio_service

from p2ptrain.events import EventSink
from p2ptrain.identity import Identity
from p2ptrain.node import Node, NodeConfig

log = logging.getLogger("p2ptrain.bootstrap")


@dataclass
class RelayConfig:
    max_reservations: int = 128
    """Peers that may hold a relay slot at once."""
    max_circuits: int = 8
    """Concurrent relayed connections per peer."""
    max_circuit_seconds: int = 120
    """Lifetime of one relayed connection; long enough for DCUtR to upgrade it."""
    max_circuit_bytes: int = 128 * 1024 * 1024
    """Bytes one relayed connection may carry; bulk traffic belongs on direct links."""
    reservation_ttl: int = 3600
    """Seconds a reservation lasts before the peer must renew it."""

    def __post_init__(self) -> None:
        for name in ("max_reservations", "max_circuits", "max_circuit_seconds", "max_circuit_bytes",
                     "reservation_ttl"):
            if getattr(self, name) < 1:
                raise ValueError(f"relay.{name} must be >= 1")

    def limits(self) -> RelayLimits:
        return RelayLimits(duration=self.max_circuit_seconds, data=self.max_circuit_bytes,
                           max_circuit_conns=self.max_circuits, max_reservations=self.max_reservations,
                           reservation_ttl=self.reservation_ttl)


class AddressFirstSink(EventSink):
    """Prints the node's full multiaddr as the very first stdout line (in both modes), so
    scripts can `head -1` it, then behaves as a normal event sink."""

    def emit(self, event: str, **fields):
        if event == "listening" and fields.get("addrs"):
            self.out.write(fields["addrs"][0] + "\n")
            self.out.flush()
        return super().emit(event, **fields)


async def run_bootstrap(identity: Identity, node_config: NodeConfig, relay: RelayConfig,
                        events: EventSink, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    node = Node(identity, node_config, events)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        hop = CircuitV2Protocol(node.host, limits=relay.limits(), allow_hop=True)
        AutoNATService(node.host, serve=True)
        async with background_trio_service(hop):
            await hop.event_started.wait()
            events.emit("bootstrap_ready", relay=True, autonat=True,
                        max_reservations=relay.max_reservations)
            task_status.started(node)
            await trio.sleep_forever()
