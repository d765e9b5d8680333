"""WORKAROUNDS for py-libp2p 0.8.1 bugs. Each one is listed in docs/UPSTREAM.md with the
test that shows the bug (tests/test_upstream_bugs.py); drop it when upstream fixes it.

1. `Swarm.listen` returns False when a port is taken and `BasicHost.run` ignores that, so a
   node starts without listening anywhere. Worse, the TCP transport sets SO_REUSEPORT, so
   two libp2p nodes on the same port both "succeed" and the kernel splits inbound
   connections between them. We probe each fixed port with a plain socket first (which
   fails against any holder, with or without SO_REUSEPORT) and check after start-up that
   a listener exists.

2. The ResourceManager's per-peer stream limits are never enforced (the swarm calls only
   its node-wide `acquire_stream`), so one peer can hold up to 10,000 streams. That
   workaround is a module of its own, `p2ptrain/peerguard.py` (per-peer limits from
   `p2ptrain/limits.py`), installed by `p2ptrain.node.Node`.
"""

from __future__ import annotations

import errno
import socket

import multiaddr


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


def check_listening(host) -> None:
    """Raise ListenError if the host ended up with no listener (listen failed silently)."""
    if not host.get_network().listeners:
        raise ListenError("libp2p started without any listener")
