"""The simulated network: who can reach whom, how long it takes, and who refuses.

One `SimNet` per simulated world. Everything it decides is drawn from the world's seed, so a
seed replays bit for bit:
  - one-way latency per pair of peers, lognormal around half the median RTT, clipped to
    [min_latency, max_latency] (5-300 ms by default), fixed for the pair;
  - bandwidth per peer (its access link), for bulk transfers;
  - loss: a fraction of DHT messages vanish (the caller's timeout fires);
  - partitions: directed blocks (`a` cannot reach `b`), so asymmetric ones too;
  - crashes: a crashed peer's address refuses connections (a dial is *refused*, which the
    protocol may act on), a partitioned one is silent (a dial times out);
  - adversary policies: a peer may refuse or ignore chosen others (`Policy`).
The DHT runs over `SimDHTNetwork` (the real `DHTNode`, framing and decoders); blobs (manifest,
checkpoint chunks) over `p2ptrain.sim.host`; rounds over `p2ptrain.sim.service`.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

import trio

from p2ptrain.dht.node import DHTConfig, DHTNode
from p2ptrain.dht.record import SignatureCache
from p2ptrain.dht.transport import MemoryNetwork, MemoryTransport, RpcError


@dataclass(frozen=True)
class LinkConfig:
    median_rtt: float = 0.1
    """Median round-trip time between two peers, seconds."""
    sigma: float = 0.6
    """Spread of the lognormal one-way latency."""
    min_latency: float = 0.005
    max_latency: float = 0.3
    """One-way latency bounds, seconds."""
    mbps: tuple[float, float] = (20.0, 1000.0)
    """Access-link bandwidth range (Mbit/s), drawn per peer (log-uniform)."""
    loss: float = 0.0
    """Fraction of DHT messages lost."""

    def __post_init__(self) -> None:
        if not (0 < self.min_latency <= self.max_latency and self.median_rtt > 0 and self.sigma >= 0
                and 0 < self.mbps[0] <= self.mbps[1] and 0 <= self.loss < 1):
            raise ValueError("LinkConfig needs 0 < min_latency <= max_latency, median_rtt > 0, sigma >= 0, "
                             "0 < mbps low <= high, 0 <= loss < 1")


@dataclass
class Policy:
    """How an adversary treats others in rounds (honest peers have the default: everyone).
    `answers`: the peers it exchanges round messages with (None: everyone); the rest see
    its dials refused and get no confirmation, header or vote from it: selective answering
    (issue 31, item 5). Its DHT traffic is normal (it wants to be elected)."""
    answers: set[bytes] | None = None
    withhold: bool = False
    """Confirms rosters and signs headers, then never sends its data (nor its vote): every
    round it is in fails, and nobody is blamed (leave-one-out must find it)."""
    inflate: tuple[str, ...] = ()
    """Peer ids it adds to every roster confirmation it sends: view inflation."""
    trickle: bool = False
    """Sends each data-plane frame as slowly as the real per-frame rules let it
    (`sim.attacks.slowest`): every round it is in stalls, and nobody is blamed."""

    def talks_to(self, other: bytes) -> bool:
        return self.answers is None or other in self.answers


@dataclass
class SimNet:
    seed: int
    links: LinkConfig = field(default_factory=LinkConfig)
    down: set[bytes] = field(default_factory=set)
    blocked: set[tuple[bytes, bytes]] = field(default_factory=set)
    policy: dict[bytes, Policy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lat: dict[tuple[bytes, bytes], float] = {}
        self._bw: dict[bytes, float] = {}
        self._loss = random.Random(self.seed ^ 0x1055)

    def _draw(self, *parts: bytes) -> random.Random:
        h = hashlib.sha256(b"%d" % self.seed + b"".join(parts)).digest()
        return random.Random(int.from_bytes(h[:8], "big"))

    def latency(self, a: bytes, b: bytes) -> float:
        key = (a, b) if a <= b else (b, a)
        lat = self._lat.get(key)
        if lat is None:
            L = self.links
            lat = self._draw(b"lat", *key).lognormvariate(math.log(L.median_rtt / 2), L.sigma)
            lat = self._lat[key] = min(max(lat, L.min_latency), L.max_latency)
        return lat

    def bandwidth(self, peer: bytes) -> float:
        """Bytes per second of `peer`'s access link."""
        bw = self._bw.get(peer)
        if bw is None:
            lo, hi = self.links.mbps
            bw = self._bw[peer] = math.exp(self._draw(b"bw", peer).uniform(math.log(lo), math.log(hi))) * 125_000
        return bw

    def transfer(self, a: bytes, b: bytes, nbytes: int) -> float:
        """Seconds for `nbytes` from a to b: latency plus the slower access link."""
        return self.latency(a, b) + nbytes / min(self.bandwidth(a), self.bandwidth(b))

    def alive(self, peer: bytes) -> bool:
        return peer not in self.down

    def reachable(self, a: bytes, b: bytes, rounds: bool = False) -> bool:
        """Whether a message from a gets to b (both up, no partition; for a round's messages,
        `rounds`, also both policies allow it)."""
        return (a not in self.down and b not in self.down and (a, b) not in self.blocked
                and (not rounds or self._talks(b, a) and self._talks(a, b)))

    def _talks(self, who: bytes, other: bytes) -> bool:
        p = self.policy.get(who)
        return p is None or p.talks_to(other)

    def refused(self, a: bytes, b: bytes, rounds: bool = False) -> bool:
        """Whether a's dial to b is refused: b's machine answers and nothing listens (b
        crashed), or (`rounds`) b's policy refuses a. A partition is silence, never a refusal."""
        if a in self.down or (a, b) in self.blocked:
            return False
        return b in self.down or rounds and not self._talks(b, a)

    def lost(self) -> bool:
        return self.links.loss > 0 and self._loss.random() < self.links.loss

    # -- faults --------------------------------------------------------------------------
    def partition(self, sides: list[set[bytes]], one_way: bool = False) -> None:
        """Block every message between different sides (from the first side to the others
        only, with `one_way`: an asymmetric partition)."""
        for i, a_side in enumerate(sides):
            for j, b_side in enumerate(sides):
                if i != j and (not one_way or i == 0):
                    self.blocked |= {(a, b) for a in a_side for b in b_side}

    def heal(self) -> None:
        self.blocked.clear()


class SimDHTNetwork(MemoryNetwork):
    """The in-memory DHT network (real framing and decoders) over `SimNet`'s links."""

    def __init__(self, net: SimNet) -> None:
        super().__init__(latency=0.0)
        self.net = net
        self.sigcache = SignatureCache(1 << 18)
        """Shared by every node of the world: an Ed25519 check is a pure function of the
        record's bytes, and the simulator runs every peer in one process, so a record that
        1,000 readers each verify once costs one check, not 1,000 (the per-node cache's
        semantics -- successes only, keyed by the whole wire form -- are unchanged; they were
        45 of 104 CPU s of a 256-peer world)."""

    def transport(self, peer: bytes) -> MemoryTransport:
        self.down.discard(peer)
        return super().transport(peer)

    def node(self, ident, config: DHTConfig | None = None, server: bool = True) -> DHTNode:
        """A real DHT node on this network, with the world's signature cache."""
        dht = DHTNode(ident, self.transport(ident.peer_id), config or DHTConfig(), server=server)
        dht.sigcache = self.sigcache
        return dht

    async def deliver(self, sender: bytes, peer: bytes, payload: bytes) -> bytes:
        net = self.net
        if not net.alive(sender):
            raise RpcError("local node is down")
        await trio.sleep(net.latency(sender, peer))
        target = self.nodes.get(peer)
        if target is None or net.refused(sender, peer):
            raise RpcError("connection refused")
        if not net.reachable(sender, peer) or net.lost():
            await trio.sleep_forever()  # silence: the caller's timeout decides
        reply = await target.receive(sender, payload)
        await trio.sleep(net.latency(peer, sender))
        if not net.reachable(peer, sender) or net.lost():
            await trio.sleep_forever()
        return reply
