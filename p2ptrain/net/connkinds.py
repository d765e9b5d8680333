"""Connection kinds in the compact forms peers publish and the dashboard shows.

Which kind each open connection is (direct, hole-punched, relayed) is decided in one place,
`p2ptrain.net.nat.connection_kinds`, which knows which connections DCUtR upgraded; this module
only counts and checks them.
"""

from __future__ import annotations

from p2ptrain.net.nat import DIRECT, HOLE_PUNCHED, RELAYED, connection_kinds
# Decoding published counts is the state record's codec (no libp2p needed to read one).
from p2ptrain.records.codecs import parse_counts

__all__ = ["KINDS", "connection_kinds", "kind_counts", "parse_counts"]
KINDS = (DIRECT, HOLE_PUNCHED, RELAYED)


def kind_counts(host) -> dict[str, int]:
    """{kind: number of connected peers}, the compact form a peer publishes in its state."""
    counts: dict[str, int] = {}
    for kind in connection_kinds(host).values():
        counts[kind] = counts.get(kind, 0) + 1
    return counts
