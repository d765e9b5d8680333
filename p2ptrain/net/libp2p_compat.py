"""WORKAROUNDS for py-libp2p 0.8.1 bugs. Each one is listed in docs/UPSTREAM.md with the
test that shows the bug (tests/test_upstream_bugs.py); drop it when upstream fixes it.

1. `Swarm.listen` returns False when a port is taken and `BasicHost.run` ignores that, so a
   node starts without listening anywhere. Worse, the TCP transport sets SO_REUSEPORT, so
   two libp2p nodes on the same port both "succeed" and the kernel splits inbound
   connections between them. We probe each fixed port with a plain socket first (which
   fails against any holder, with or without SO_REUSEPORT) and check after start-up that
   a listener exists.

2. The swarm never dials `/p2p-circuit` addresses ("this node has no relay transport"), even
   when a CircuitV2Transport exists, so `new_stream`/`connect` to a peer that is reachable
   only through a relay fails. `enable_circuit_dials` wraps the swarm's `dial_peer`: when
   every direct address fails, it dials the peer's relay addresses with the circuit transport.

5. The ResourceManager's per-peer stream limits are never enforced (the swarm calls only
   its node-wide `acquire_stream`), so one peer can hold up to 10,000 streams. That
   workaround is a module of its own, `p2ptrain/net/peerguard.py` (per-peer limits from
   `p2ptrain/net/limits.py`), installed by `p2ptrain.net.node.Node`.

8. `Swarm.new_stream` filters the closed connections out of those listed for a peer and
   raises "No valid connections available" when none is left, without dialing. A closing
   connection stays listed until its close finishes, and one whose close was cancelled
   stays listed for good, so a live peer could not be reached (seen in CI: an honest
   member's confirmations and checkpoint fetches failed). `prune_closed_connections`
   removes a peer's connections when every one is closed, so `new_stream` dials afresh.

6. The AutoNAT server's dial-back uses `host.connect`, which returns at once when the
   asking peer is already connected (it always is: it asked over that connection), so
   every peer whose advertised IP matches its observed IP is told "public", even with its
   port firewalled. `FreshDialAutoNAT` dials back over a new connection (`dial_addr`).
"""

from __future__ import annotations

import errno
import socket

import multiaddr
import trio


class ListenError(Exception):
    pass


def probe_tcp_ports(addrs: list[multiaddr.Multiaddr]) -> None:
    """Raise ListenError if a fixed TCP port in `addrs` is already bound by anyone."""
    for a in addrs:
        protos = {p.name for p in a.protocols()}
        if "tcp" not in protos:
            continue
        port = int(a.value_for_protocol("tcp"))
        if port == 0:
            continue
        family, host = (socket.AF_INET6, a.value_for_protocol("ip6")) if "ip6" in protos \
            else (socket.AF_INET, a.value_for_protocol("ip4") if "ip4" in protos else "0.0.0.0")
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ListenError(f"{a}: address already in use") from None
            raise ListenError(f"{a}: {exc.strerror}") from None
        finally:
            sock.close()


def prune_closed_connections(host) -> None:
    """Workaround 8: before each outbound stream, forget a peer's connections when every one
    is closed (`Swarm.remove_conn`), so the swarm dials instead of failing. The unpatched
    method stays reachable as `swarm.p2ptrain_unpruned_new_stream` (the bug's test)."""
    swarm = host.get_network()
    if hasattr(swarm, "p2ptrain_unpruned_new_stream"):
        return
    inner = swarm.new_stream

    async def new_stream(peer_id):
        conns = swarm.get_connections(peer_id)
        if conns and all(getattr(c, "is_closed", False) for c in conns):
            for conn in conns:
                swarm.remove_conn(conn)
        return await inner(peer_id)

    swarm.p2ptrain_unpruned_new_stream = inner
    swarm.new_stream = new_stream


def check_listening(host) -> None:
    """Raise ListenError if the host ended up with no listener (listen failed silently)."""
    if not host.get_network().listeners:
        raise ListenError("libp2p started without any listener")


def enable_circuit_dials(host, transport, timeout: float, relay_delay: float = 1.0) -> None:
    """Let the swarm reach peers through their /p2p-circuit addresses (workaround 2).

    A direct dial to an address behind a NAT can take ~30 s to fail (the swarm retries with
    backoff), so the relayed dial starts `relay_delay` seconds after the direct one, or as soon
    as it fails; whichever connects first wins (DCUtR upgrades a relayed connection later)."""
    from libp2p.network.exceptions import SwarmException

    swarm = host.get_network()
    if getattr(swarm, "_p2ptrain_circuit_dials", False):
        return
    direct_dial = swarm.dial_peer

    def circuit_addrs(peer_id) -> list:
        try:
            known = list(swarm.peerstore.addrs(peer_id))
        except Exception:  # noqa: BLE001 - unknown peer: nothing to relay through
            return []
        out = []
        for addr in known:
            text = str(addr)
            if "/p2p-circuit" in text and "/ip4/" in text.split("/p2p-circuit")[0]:
                out.append(addr if text.endswith(f"/p2p/{peer_id}") else multiaddr.Multiaddr(f"{text}/p2p/{peer_id}"))
        return out

    async def dial_peer(peer_id):
        circuits = circuit_addrs(peer_id)
        if not circuits or swarm.get_connections(peer_id):
            return await direct_dial(peer_id)
        won: list = []
        errors: list[str] = []
        direct_failed = trio.Event()

        async def direct(scope) -> None:
            try:
                won.append(await direct_dial(peer_id))
                scope.cancel()
            except (Exception, trio.TooSlowError) as exc:  # noqa: BLE001 - the relay may still work
                errors.append(f"direct: {type(exc).__name__} {str(exc)[:120]}")
                direct_failed.set()

        async def relayed(scope) -> None:
            with trio.move_on_after(relay_delay):
                await direct_failed.wait()
            for target in circuits:
                try:
                    with trio.fail_after(timeout):
                        won.append([await transport.dial(target)])
                    scope.cancel()
                    return
                except (Exception, trio.TooSlowError) as exc:  # noqa: BLE001 - try the next relay
                    errors.append(f"{target}: {type(exc).__name__} {str(exc)[:120]}")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(direct, nursery.cancel_scope)
            nursery.start_soon(relayed, nursery.cancel_scope)
        if won:
            return won[0]
        raise SwarmException(f"direct and relayed dials to {peer_id} failed: {'; '.join(errors)}")

    swarm.dial_peer = dial_peer
    swarm._p2ptrain_circuit_dials = True


def fresh_dial_autonat(host, dial_timeout: float = 5.0):
    """An AutoNAT server whose dial-back opens a new connection (workaround 3)."""
    from libp2p.host.autonat.autonat import AutoNATService

    class FreshDialAutoNAT(AutoNATService):
        async def _try_dial(self, peer_id, addrs: list[bytes]) -> bytes | None:
            network = self.host.get_network()
            for raw in addrs:
                try:
                    with trio.fail_after(dial_timeout):
                        conn = await network.dial_addr(multiaddr.Multiaddr(raw), peer_id)
                except (Exception, trio.TooSlowError):  # noqa: BLE001 - unreachable: try the next one
                    continue
                try:
                    await conn.close()  # the proof is made; the peer keeps its own connection
                except Exception:  # noqa: BLE001
                    pass
                return bytes(raw)
            return None

    return FreshDialAutoNAT(host, serve=True)
