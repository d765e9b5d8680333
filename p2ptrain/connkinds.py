"""How this node is connected to each peer: direct, hole-punched or relayed.

Read from the open libp2p connections' transport multiaddrs: a circuit-relay address
(`/p2p-circuit`) means relayed, anything else direct. Hole-punched connections are direct
connections that DCUtR opened; telling them apart needs the NAT traversal code's own record
of which connections it upgraded, so this module answers only direct or relayed until that
record is wired in here.
"""

from __future__ import annotations

import logging

log = logging.getLogger("p2ptrain.connkinds")
KINDS = ("direct", "hole-punched", "relayed")


def connection_kind(addrs: list[str]) -> str:
    if any("/p2p-circuit" in a for a in addrs):
        return "relayed"
    return "direct"


def connection_kinds(host) -> dict[str, str]:
    """peer id -> kind, for every peer with an open connection (a direct one wins)."""
    out: dict[str, str] = {}
    try:
        conns = host.get_network().get_connections_map()
    except Exception as exc:  # the host is not up yet, or is closing
        log.debug("no connections to read: %s", exc)
        return out
    for pid, lst in conns.items():
        kinds = []
        for conn in lst:
            try:
                kinds.append(connection_kind([str(a) for a in conn.get_transport_addresses()]))
            except Exception:
                continue
        if kinds:
            out[str(pid)] = "direct" if "direct" in kinds else kinds[0]
    return out


def kind_counts(host) -> dict[str, int]:
    """{kind: number of connected peers}, the compact form a peer publishes in its state."""
    counts: dict[str, int] = {}
    for kind in connection_kinds(host).values():
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def parse_counts(value) -> dict[str, int]:
    """A peer's published counts, checked: known kinds only, small non-negative ints."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items()
            if k in KINDS and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 20}
