"""Reachability and NAT traversal: AutoNAT, relay reservations, DCUtR, connection kinds.

A node asks its bootstraps (AutoNAT v1) whether they can dial it back. A private node
reserves a slot on every bootstrap relay and advertises `<relay addr>/p2p-circuit`
addresses next to its own, so peers that cannot dial it directly reach it through a relay.
Both ends of a relayed connection run DCUtR; when the hole punch succeeds, new streams pick
the direct connection (py-libp2p's swarm prefers direct connections) and the relayed one
is closed after a grace period. The tracker below watches the swarm and reports, per
neighbour, whether the connection is direct, hole-punched or relayed, and emits
`connection_upgraded` when a relayed peer becomes direct.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import trio
from libp2p.connection_types import ConnectionType
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message as AutoNATMessage
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2 import CircuitV2Protocol
from libp2p.relay.circuit_v2.config import RelayConfig as Libp2pRelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from p2ptrain.events import EventSink
from p2ptrain.identity import peer_id_to_str
from p2ptrain.net.libp2p_compat import enable_circuit_dials

log = logging.getLogger("p2ptrain.net.nat")

DIRECT, HOLE_PUNCHED, RELAYED = "direct", "hole-punched", "relayed"
# host -> the set of peers (ID) a hole punch was started with; filled by _TrackingDCUtR.
_punched: "weakref.WeakKeyDictionary[object, set]" = weakref.WeakKeyDictionary()


@dataclass
class NatConfig:
    enabled: bool = True
    """Run AutoNAT, relay reservations and DCUtR. Off for bootstraps (they are the relays)."""
    reachability: str = "auto"
    """'auto' asks the bootstraps (AutoNAT); 'public' or 'private' skips the question."""
    autonat_timeout: float = 10.0
    """Seconds one AutoNAT dial-back question may take."""
    reservation_timeout: float = 15.0
    """Seconds to keep trying for a relay reservation at start (identify must finish first)."""
    renew_interval: float = 1200.0
    """Seconds between reservation renewals; must stay below the relay's reservation TTL."""
    circuit_dial_timeout: float = 15.0
    """Seconds one dial through a relay may take."""
    relay_race_delay: float = 2.0
    """Head start of a direct dial over a relayed one to the same peer (the relayed dial
    starts at once if the direct one fails). A direct dial that loses the race is cancelled
    and the peer stays relayed until DCUtR upgrades it. A TCP + Noise + Yamux handshake is
    ~4 round trips: 1 s lost to the relay on 300 ms paths and on this 2-core machine under
    load (a NATed peer dialing a public one came up relayed in CI)."""
    punch_dial_timeout: float = 4.0
    """Seconds one DCUtR dial may take. Its first step dials the peer's advertised (often
    private, unreachable) addresses, and the swarm retries those until this expires."""
    track_interval: float = 0.5
    """Seconds between looks at the connection table (connection kinds, upgrade events)."""

    def __post_init__(self) -> None:
        if self.reachability not in ("auto", "public", "private"):
            raise ValueError("nat.reachability must be auto, public or private")
        for name in ("autonat_timeout", "reservation_timeout", "renew_interval", "circuit_dial_timeout",
                     "relay_race_delay", "punch_dial_timeout", "track_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"nat.{name} must be > 0")


class _TrackingDCUtR(DCUtRProtocol):
    """DCUtR that remembers which peers it started a hole punch with, so an upgrade can be
    told apart from a plain direct dial (DCUtR's step 0, connection reversal)."""

    def __init__(self, host, dial_timeout: float) -> None:
        super().__init__(host, dial_timeout=dial_timeout)
        self.punching: set = set()

    async def initiate_hole_punch(self, peer_id) -> bool:
        # Both ends auto-drive DCUtR every 2 s; two concurrent sessions dial the same TCP
        # 4-tuple twice (EADDRNOTAVAIL) and mix up handshake roles, so punches took 18-70 s
        # in the NAT lab. One side drives (the smaller peer id); the other only answers.
        if self.host.get_id().to_bytes() > peer_id.to_bytes():
            return False
        return await super().initiate_hole_punch(peer_id)

    async def _perform_hole_punch(self, peer_id, addrs, as_responder: bool = False) -> bool:
        self.punching.add(peer_id)
        ok = await super()._perform_hole_punch(peer_id, addrs, as_responder=as_responder)
        if not ok:
            self.punching.discard(peer_id)
        return ok


def conn_is_relayed(conn) -> bool:
    try:
        if conn.get_connection_type() == ConnectionType.RELAYED:
            return True
    except Exception:  # noqa: BLE001 - older connection objects lack the type
        pass
    try:
        addrs = conn.get_transport_addresses()
    except Exception:  # noqa: BLE001
        return False
    return bool(addrs) and all("/p2p-circuit" in str(a) for a in addrs)


def connection_kinds(host) -> dict[str, str]:
    """peer id -> "direct" | "hole-punched" | "relayed" for every connected peer.

    This is the one place the dashboard, `status` and the events read connection kinds from."""
    out: dict[str, str] = {}
    punched = _punched.get(host, set())
    for pid, conns in dict(host.get_network().connections).items():
        conns = conns if isinstance(conns, list) else [conns]
        live = [c for c in conns if not getattr(c, "is_closed", False)]
        if not live:
            continue
        key = pid.to_base58()
        if any(not conn_is_relayed(c) for c in live):
            out[key] = HOLE_PUNCHED if pid in punched else DIRECT
        else:
            out[key] = RELAYED
    return out


class NatService:
    """Use `await nursery.start(nat.run)` after the bootstraps are connected.

    `bootstraps` are (peer id bytes, transport multiaddr) pairs; `extra_addrs` is the list the
    host's address factory appends to what it advertises (relay addresses go there)."""

    def __init__(self, host, events: EventSink, config: NatConfig, bootstraps: list[tuple[bytes, str]],
                 extra_addrs: list) -> None:
        self.host = host
        self.events = events
        self.config = config
        self.bootstraps = bootstraps
        self.extra_addrs = extra_addrs
        self.reachability = "unknown"
        self.relays: list[str] = []
        self.dcutr: _TrackingDCUtR | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        relay = CircuitV2Protocol(self.host, allow_hop=False)  # STOP side: accept relayed connections
        transport = CircuitV2Transport(self.host, relay, Libp2pRelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT))
        enable_circuit_dials(self.host, transport, self.config.circuit_dial_timeout, self.config.relay_race_delay)
        self.dcutr = _TrackingDCUtR(self.host, self.config.punch_dial_timeout)
        _punched[self.host] = self.dcutr.punching
        async with background_trio_service(relay), background_trio_service(self.dcutr):
            await self._learn_reachability()
            if self.reachability == "private":
                await self._reserve(transport.discovery)
            self.events.emit("reachability", status=self.reachability, relays=self.relays)
            task_status.started(self)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._track)
                if self.relays:
                    nursery.start_soon(self._renew, transport.discovery)

    async def _learn_reachability(self) -> None:
        if self.config.reachability != "auto":
            self.reachability = self.config.reachability
            return
        autonat = AutoNATService(self.host, serve=False, confirmations=1)
        own = [a for a in self.host.get_addrs() if "/p2p-circuit" not in str(a)]
        verdicts = []
        for pid, _ in self.bootstraps:
            try:
                with trio.fail_after(self.config.autonat_timeout):
                    status, _ = await autonat.query_server(ID(pid), [a.to_bytes() for a in own])
                verdicts.append(status == int(AutoNATMessage.OK))
            except (Exception, trio.TooSlowError) as exc:
                log.info("AutoNAT question to %s failed: %s", peer_id_to_str(pid), exc)
        # One server able to dial us back is proof enough; silence is not proof of privacy,
        # but a node nobody could dial must take a relay slot to be reachable at all.
        self.reachability = "public" if any(verdicts) else "private"
        log.info("reachability %s (verdicts %s)", self.reachability, verdicts)

    async def _reserve(self, discovery) -> None:
        """Reserve a slot on every bootstrap that offers relay service.

        Discovery only sees a relay after identify has told us its protocols, so retry for a
        bounded time rather than trusting the first scan."""
        wanted = {ID(pid): addr for pid, addr in self.bootstraps}
        deadline = trio.current_time() + self.config.reservation_timeout
        while trio.current_time() < deadline:
            await discovery.discover_relays()
            for pid, addr in wanted.items():
                info = discovery.get_relay_info(pid)
                circuit = f"{addr}/p2p/{pid.to_base58()}/p2p-circuit"
                if info is not None and info.has_reservation and circuit not in self.relays:
                    self.relays.append(circuit)
                elif info is not None and not info.has_reservation:
                    await discovery.make_reservation(pid)
            if len(self.relays) == len(wanted):
                break
            await trio.sleep(0.3)
        self.extra_addrs[:] = list(self.relays)
        if not self.relays:
            log.warning("no relay reservation within %.0fs: peers behind NATs cannot reach this node",
                        self.config.reservation_timeout)

    async def _renew(self, discovery) -> None:
        while True:
            await trio.sleep(self.config.renew_interval)
            for pid, _ in self.bootstraps:
                if discovery.get_relay_info(ID(pid)) is not None:
                    ok = await discovery.make_reservation(ID(pid))
                    if not ok:
                        log.warning("relay reservation renewal with %s failed", peer_id_to_str(pid))

    async def _track(self) -> None:
        """Turn connection-table changes into events: kinds per neighbour, upgrades."""
        seen: dict[str, str] = {}
        relayed_since: dict[str, float] = {}
        while True:
            kinds = connection_kinds(self.host)
            for peer, kind in kinds.items():
                prev = seen.get(peer)
                if kind == RELAYED:
                    relayed_since.setdefault(peer, trio.current_time())
                if prev == RELAYED and kind != RELAYED:
                    method = "hole-punch" if kind == HOLE_PUNCHED else "direct-dial"
                    self.events.emit("connection_upgraded", remote=peer, method=method,
                                     after_s=round(trio.current_time() - relayed_since.get(peer, trio.current_time()), 3))
                if kind != prev:
                    self.events.emit("peer_connection", remote=peer, kind=kind)
                seen[peer] = kind
            for peer in set(seen) - set(kinds):
                seen.pop(peer)
                self.dcutr.punching.discard(ID.from_base58(peer))
                relayed_since.pop(peer, None)
            await trio.sleep(self.config.track_interval)
