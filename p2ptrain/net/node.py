"""The libp2p node: host construction, addresses, reaching bootstraps, and the DHT on top.

One process, one trio loop. `Node.run` is a structured service: it starts the host, the DHT
and (optionally) presence, reports readiness through `task_status`, and tears everything
down when cancelled. Blocking work never runs here; callers use `trio.to_thread`.
"""

from __future__ import annotations

import logging
import random
import socket
from dataclasses import dataclass, field

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.config import ConnectionConfig

from p2ptrain.dht.libp2p_rpc import Libp2pRpc
from p2ptrain.dht.node import DHTConfig, DHTNode
from p2ptrain.events import EventSink
from p2ptrain.identity import Identity, peer_id_from_str, peer_id_to_str
from p2ptrain.net.libp2p_compat import ListenError, check_listening, probe_tcp_ports, prune_closed_connections
from p2ptrain.net.limits import LimitsConfig
from p2ptrain.net.peerguard import PeerGuard

log = logging.getLogger("p2ptrain.net.node")
_PORT_ADVICE = "pick another port with --listen, or stop the process using it"


class NodeError(Exception):
    """A startup failure the CLI turns into a one-line error: (message, advice)."""

    def __init__(self, message: str, advice: str) -> None:
        super().__init__(message)
        self.advice = advice


@dataclass
class NodeConfig:
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    """Multiaddrs to listen on (TCP); port 0 picks a free port."""
    announce: list[str] = field(default_factory=list)
    """Addresses to advertise instead of the listen addresses (public IP, port forward)."""
    bootstrap: list[str] = field(default_factory=list)
    """Entry points, each /ip4/.../tcp/.../p2p/<peer id>, or /dns4, /dns6, /dns with a host name
    (resolved at every dial attempt)."""
    bootstrap_timeout: float = 30.0
    """Seconds to keep retrying unreachable bootstraps (with backoff) before giving up."""
    dial_timeout: float = 5.0
    """Seconds one connection attempt may take."""
    max_connections: int = 64
    """Connection cap. py-libp2p's default auto-connector aims at ~200; small swarms need far fewer."""

    def __post_init__(self) -> None:
        if not self.listen:
            raise ValueError("listen needs at least one multiaddr")
        for a in [*self.listen, *self.announce]:
            parse_maddr(a)
        for b in self.bootstrap:
            parse_peer_maddr(b)
        if self.bootstrap_timeout < 0 or self.dial_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_connections < 4:
            raise ValueError("max_connections must be >= 4")


def parse_maddr(text: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(text)
    except Exception:
        raise NodeError(f"cannot parse multiaddr {text!r}",
                        "use a form like /ip4/127.0.0.1/tcp/4001") from None


def parse_peer_maddr(text: str) -> tuple[bytes, str]:
    """Split /ip4/.../tcp/.../p2p/<id> into (peer id bytes, transport address)."""
    maddr = parse_maddr(text)
    if "/p2p/" not in str(maddr):
        raise NodeError(f"multiaddr {text!r} has no /p2p/<peer id>",
                        "copy the full address the bootstrap printed on its first line")
    base, _, pid = str(maddr).rpartition("/p2p/")
    if base.startswith("/dnsaddr/"):
        raise NodeError(f"{text!r}: /dnsaddr/ addresses are not supported (they need DNS TXT lookups)",
                        "use /dns4/HOST/tcp/PORT/p2p/<peer id> or /ip4/ADDRESS/tcp/PORT/p2p/<peer id>")
    try:
        return peer_id_from_str(pid), base
    except ValueError:
        raise NodeError(f"{pid!r} in {text!r} is not an Ed25519 peer id",
                        "copy the full address the bootstrap printed on its first line") from None


_DNS_FAMILIES = {"dns4": socket.AF_INET, "dns6": socket.AF_INET6, "dns": socket.AF_UNSPEC}


class ResolveError(OSError):
    """A /dns4, /dns6 or /dns host name that did not resolve."""


async def resolve_addr(addr: str, timeout: float) -> list[str]:
    """A /dns4, /dns6 or /dns address as the /ip4 and /ip6 addresses its host has now (in the
    resolver's order); any other address as it is.

    py-libp2p 0.8.1's resolver hands a /dns4/HOST address back unresolved, and its TCP dial
    of that fails: such a bootstrap was never dialled, and the error blamed the bootstrap
    (issue 33). The system resolver answers instead, /etc/hosts included."""
    proto, _, rest = addr.lstrip("/").partition("/")
    if proto not in _DNS_FAMILIES:
        return [addr]
    host, _, tail = rest.partition("/")
    try:
        with trio.fail_after(timeout):
            infos = await trio.socket.getaddrinfo(host, None, family=_DNS_FAMILIES[proto], type=socket.SOCK_STREAM)
    except trio.TooSlowError:
        raise ResolveError(f"cannot resolve {host!r}: no answer within {timeout:.0f}s") from None
    except OSError as exc:
        raise ResolveError(f"cannot resolve {host!r}: {exc.strerror or exc}") from None
    out: list[str] = []
    for family, *_, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        ip = f"/{'ip4' if family == socket.AF_INET else 'ip6'}/{sockaddr[0]}" + (f"/{tail}" if tail else "")
        if ip not in out:
            out.append(ip)
    if not out:
        raise ResolveError(f"cannot resolve {host!r}: no {proto} address")
    return out


def _expand_unspecified(addrs: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
    """Replace 0.0.0.0 with this host's interface addresses: advertising 0.0.0.0 makes
    remote dials (and DCUtR's first direct dial) hit the dialer's own listener."""
    import ifaddr

    out: list[multiaddr.Multiaddr] = []
    for a in addrs:
        text = str(a)
        if not text.startswith("/ip4/0.0.0.0/"):
            out.append(a)
            continue
        rest = text[len("/ip4/0.0.0.0"):]
        ips = [ip.ip for ad in ifaddr.get_adapters() for ip in ad.ips
               if isinstance(ip.ip, str) and not ip.ip.startswith("127.")]
        for ip in ips or ["127.0.0.1"]:
            out.append(multiaddr.Multiaddr(f"/ip4/{ip}{rest}"))
    return out


def build_host(identity: Identity, config: NodeConfig):
    key_pair = create_new_key_pair(identity.seed)
    announce = [parse_maddr(a) for a in config.announce]

    def addrs_factory(addrs: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        return announce or _expand_unspecified(list(addrs))

    conn = ConnectionConfig(
        max_connections=config.max_connections, min_connections=4, low_watermark=8,
        high_watermark=max(9, config.max_connections * 3 // 4), max_connections_per_peer=2,
        dial_timeout=config.dial_timeout,
    )
    host = new_host(key_pair=key_pair, muxer_preference="YAMUX", connection_config=conn,
                    addrs_factory=addrs_factory)
    prune_closed_connections(host)
    return host


class Node:
    """A running libp2p host with our DHT. Use `await nursery.start(node.run)`."""

    def __init__(self, identity: Identity, config: NodeConfig, events: EventSink,
                 dht_config: DHTConfig | None = None, dht_server: bool = True, nat=None,
                 limits: LimitsConfig | None = None) -> None:
        self.identity = identity
        self.guard = PeerGuard(limits, events)
        self.config = config
        self.events = events
        self.dht_config = dht_config or DHTConfig()
        self.dht_server = dht_server
        self.host = None
        self.rpc: Libp2pRpc | None = None
        self.dht: DHTNode | None = None
        self.nat_config = nat  # p2ptrain.net.nat.NatConfig; None: no NAT traversal (bootstraps, clients)
        self.nat = None
        self.extra_addrs: list[str] = []
        self._dialled: dict[str, list[str]] = {}  # bootstrap as given -> the addresses it resolved to
        # Awaited, in order, when the node stops, before its host closes: what a clean exit
        # still has to say to the network (withdrawing presence: Presence.withdraw).
        self.on_leave: list = []

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id_str

    def conn_counts(self) -> dict[str, int]:
        """{connection kind: peers}, what our state record publishes (`status` shows it)."""
        from p2ptrain.net.connkinds import kind_counts

        return kind_counts(self.host)

    def full_addrs(self) -> list[str]:
        return [f"{a}/p2p/{self.peer_id}" for a in self.rpc.local_addrs()]

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. The host runs shielded from our caller's cancellation, so
        that when it comes (Ctrl-C, a finished run) the `on_leave` hooks still reach the
        network; then the host is stopped. Cancelled together with it, py-libp2p's services
        stop at once and nothing more can be sent (seen: "cannot schedule task after service
        has stopped" on a withdrawal)."""
        host_scope = trio.CancelScope()

        async def serve(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with host_scope:
                await self._serve(task_status=task_status)

        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(serve)
                # Only once started: a Ctrl-C while the bootstraps are still being dialled
                # must stop the node at once, and there is nothing to withdraw yet.
                host_scope.shield = True
                task_status.started(self)
                try:
                    await trio.sleep_forever()
                finally:
                    await self._leave()
                    host_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:  # the node's own error (NodeError ...), as before this nursery
                raise group.exceptions[0] from None
            raise

    async def _serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.host = build_host(self.identity, self.config)
        listen = [parse_maddr(a) for a in self.config.listen]
        try:
            probe_tcp_ports(listen)
        except ListenError as exc:
            raise NodeError(f"cannot listen on {exc}", _PORT_ADVICE) from None
        entered = False
        try:
            async with self.host.run(listen):
                entered = True
                try:
                    check_listening(self.host)
                except ListenError as exc:
                    raise NodeError(f"cannot listen on {', '.join(self.config.listen)}: {exc}",
                                    _PORT_ADVICE) from None
                self.rpc = Libp2pRpc(self.host, extra_addrs=self.extra_addrs, guard=self.guard)
                self.dht = DHTNode(self.identity, self.rpc, self.dht_config, server=self.dht_server,
                                   store_gate=self.guard.admit_store)
                self.events.emit("listening", addrs=self.full_addrs())
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.guard.run, self.host)
                    await self._meet_bootstraps()
                    if self.nat_config is not None and self.nat_config.enabled and self.config.bootstrap:
                        from p2ptrain.net.nat import NatService

                        # Relay addresses as dialled: others dial them, and cannot dial a /dns4 one.
                        relays = [(pid, self._dialled.get(b, [addr])[0]) for b, (pid, addr)
                                  in zip(self.config.bootstrap, map(parse_peer_maddr, self.config.bootstrap))]
                        self.nat = NatService(self.host, self.events, self.nat_config, relays, self.extra_addrs)
                        await nursery.start(self.nat.run)
                    if self.dht_server:
                        await nursery.start(self.dht.run)
                    self.events.emit("dht_ready", routing_table=len(self.dht.routing))
                    task_status.started(self)
                    await trio.sleep_forever()
        except Exception as exc:
            if not entered and _is_addr_in_use(exc):
                raise NodeError(f"cannot listen on {', '.join(self.config.listen)}: address already in use",
                                _PORT_ADVICE) from None
            raise

    async def _leave(self) -> None:
        """Run the `on_leave` hooks while the host still runs (shielded: we are being
        cancelled). Each hook bounds its own time (e.g. PresenceConfig.withdraw_timeout)."""
        with trio.CancelScope(shield=True):
            for hook in self.on_leave:
                try:
                    await hook()
                except Exception:  # one hook's failure must not skip the others or the close
                    log.exception("leave hook failed")

    async def _meet_bootstraps(self) -> None:
        """Connect to every bootstrap, retrying with backoff for a bounded time.

        At least one must answer; the others are logged and skipped."""
        if not self.config.bootstrap:
            return
        targets = [parse_peer_maddr(b) for b in self.config.bootstrap]
        deadline = trio.current_time() + self.config.bootstrap_timeout
        delay, attempt, met = 0.5, 0, []
        pending = list(zip(self.config.bootstrap, targets))
        unresolved: dict[str, str] = {}  # bootstrap -> why its name did not resolve (last attempt)
        while pending:
            attempt += 1
            for text, (pid, addr) in list(pending):
                try:
                    addrs = await resolve_addr(addr, self.config.dial_timeout)
                    unresolved.pop(text, None)
                    await self.rpc.connect(pid, addrs, self.config.dial_timeout)
                except ResolveError as exc:
                    unresolved[text] = str(exc)
                    log.warning("bootstrap %s unreachable (attempt %d): %s", text, attempt, exc)
                    continue
                except (Exception, trio.TooSlowError) as exc:
                    log.warning("bootstrap %s unreachable (attempt %d): %s", text, attempt,
                                type(exc).__name__ if not str(exc) else str(exc)[:200])
                    continue
                pending.remove((text, (pid, addr)))
                met.append((pid, addrs))
                self._dialled[text] = addrs
                self.events.emit("bootstrap_connected", remote=peer_id_to_str(pid), addr=text)
            if not pending or (met and attempt >= 2):
                break
            if trio.current_time() + delay > deadline:
                break
            await trio.sleep(delay * (1 + 0.1 * random.random()))
            delay = min(delay * 2, 8.0)
        if not met and len(unresolved) == len(pending):
            raise NodeError(f"no bootstrap reachable: {'; '.join(sorted(set(unresolved.values())))}",
                            "check the host name, or give the bootstrap as /ip4/ADDRESS/tcp/PORT/p2p/<peer id>")
        if not met:
            raise NodeError(
                f"no bootstrap reachable after {attempt} attempts in {self.config.bootstrap_timeout:.0f}s",
                "check the address and that the bootstrap is running (p2ptrain bootstrap prints its address)")
        answered = await self.dht.bootstrap(met)
        if not answered:
            raise NodeError("bootstraps accepted the connection but did not answer DHT requests",
                            "is it a p2ptrain bootstrap of the same version?")


def _is_addr_in_use(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return any(_is_addr_in_use(e) for e in exc.exceptions)
    text = f"{exc} {exc.__cause__ or ''}".lower()
    return (isinstance(exc, OSError) and exc.errno == 98) or "address already in use" in text \
        or "errno 98" in text or (exc.__cause__ is not None and _is_addr_in_use(exc.__cause__))
