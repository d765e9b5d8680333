"""Kademlia routing table: XOR distance over SHA-256 ids, k-buckets (pure logic).

Ids are SHA-256 of a peer id or of a DHT key, so keys and peers share one 256-bit space.
Buckets prefer long-lived peers (Kademlia's observation that a peer up for an hour is likely
to stay up): a full bucket keeps its members and parks newcomers in a small replacement
cache, promoted only when a member fails.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

ID_BITS = 256


@functools.lru_cache(maxsize=1 << 16)
def dht_id(data: bytes | str) -> int:
    # Memoized: a lookup ranks its candidates by distance on every step (a pure function
    # of the id; 18 M hashes in a 30-simulated-second 1,000-peer world, issue 30).
    if isinstance(data, str):
        data = data.encode()
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


def distance(a: int, b: int) -> int:
    return a ^ b


@dataclass
class _Bucket:
    members: "OrderedDict[bytes, float]" = field(default_factory=OrderedDict)  # least recent first
    replacements: "OrderedDict[bytes, float]" = field(default_factory=OrderedDict)


class RoutingTable:
    """Peers by bucket index = bit length of (own id XOR peer id) - 1."""

    def __init__(self, local_peer: bytes, bucket_size: int = 20, replacement_size: int = 8) -> None:
        if bucket_size < 1:
            raise ValueError("bucket_size must be >= 1")
        self.local_peer = local_peer
        self.local_id = dht_id(local_peer)
        self.bucket_size = bucket_size
        self.replacement_size = replacement_size
        self._buckets: dict[int, _Bucket] = {}
        self._ids: dict[bytes, int] = {}

    def _index(self, peer: bytes) -> int:
        return self.bucket_of(dht_id(peer))

    def bucket_of(self, ident: int) -> int:
        """The bucket an id falls in (-1: our own id)."""
        return distance(self.local_id, ident).bit_length() - 1

    def __contains__(self, peer: bytes) -> bool:
        return peer in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def peers(self) -> list[bytes]:
        return list(self._ids)

    def seen(self, peer: bytes, now: float) -> bool:
        """Record that `peer` answered or spoke to us. Returns True if it is (now) a member."""
        if peer == self.local_peer:
            return False
        idx = self._index(peer)
        bucket = self._buckets.setdefault(idx, _Bucket())
        if peer in bucket.members:
            bucket.members.move_to_end(peer)
            bucket.members[peer] = now
            return True
        if len(bucket.members) < self.bucket_size:
            bucket.members[peer] = now
            self._ids[peer] = dht_id(peer)
            return True
        bucket.replacements[peer] = now
        bucket.replacements.move_to_end(peer)
        while len(bucket.replacements) > self.replacement_size:
            bucket.replacements.popitem(last=False)
        return False

    def failed(self, peer: bytes) -> None:
        """Drop a peer that did not answer; promote the freshest replacement, if any."""
        if peer not in self._ids:
            return
        bucket = self._buckets[self._index(peer)]
        del bucket.members[peer]
        del self._ids[peer]
        if bucket.replacements:
            repl, seen_at = bucket.replacements.popitem(last=True)
            bucket.members[repl] = seen_at
            self._ids[repl] = dht_id(repl)

    def closest(self, target: int, count: int, exclude: frozenset[bytes] = frozenset()) -> list[bytes]:
        return [p for _, p in heapq.nsmallest(count, ((i ^ target, p) for p, i in self._ids.items()
                                                       if p not in exclude))]

    def stale_bucket_targets(self, now: float, max_age: float, rng) -> list[int]:
        """Random ids inside the buckets nobody refreshed for `max_age` (for refresh
        lookups), farthest first: every bucket above our nearest neighbour's, empty ones
        included. An empty bucket there is a range of the id space we know nobody in, not
        one that is empty: peers that joined at once each met the entry point and their
        own neighbourhood, and whole quarters of the space were unknown to them, so
        lookups into those quarters stopped at the ~40th closest node (issue 30, 128
        simulated peers). Kademlia's join refreshes exactly these buckets."""
        targets = []
        for idx in self._far_buckets():
            bucket = self._buckets.get(idx)
            if bucket is not None and bucket.members and now - max(bucket.members.values()) < max_age:
                continue
            targets.append(self.random_id_in_bucket(idx, rng))
        return targets

    def bucket_targets(self, rng) -> list[int]:
        """A random id in every bucket above our nearest neighbour's, farthest first (the
        lookups that fill a new node's table: `DHTNode.bootstrap`)."""
        return [self.random_id_in_bucket(idx, rng) for idx in self._far_buckets()]

    def _far_buckets(self) -> range:
        """Bucket indices above our nearest neighbour's, farthest first (none: empty table)."""
        if not self._ids:
            return range(0)
        return range(ID_BITS - 1, min(idx for idx, b in self._buckets.items() if b.members), -1)

    def random_id_in_bucket(self, idx: int, rng) -> int:
        """A random id at exactly bucket `idx`'s distance from us."""
        offset = (1 << idx) | rng.getrandbits(idx) if idx > 0 else 1
        return self.local_id ^ offset
