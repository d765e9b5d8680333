"""Per-peer resource limits: accounting and the throttle-then-disconnect policy (pure logic).

What one remote peer may hold on this node at once, and how fast it may write to our DHT:
  - inbound streams open at once (each costs a handler task and up to a Yamux window of
    buffered bytes: 1,000 held-open streams would otherwise pin 1,000 tasks and ~256 MB);
  - pending bytes: request frames read from it and not yet answered;
  - DHT records it asks us to store, as a token bucket (records per second, with a burst).
A request over a limit is refused (throttled) and counts as a strike. Strikes decay; a
peer that keeps hitting limits -- `strikes_to_disconnect` strikes within `strike_window`
seconds -- is disconnected and banned for `ban_seconds`: every stream it opens meanwhile is
reset at once. Honest peers stay far below every limit (BENCHMARKS.md, hardening section).

py-libp2p 0.8.1's ResourceManager only has node-wide stream and connection caps (10,000
streams by default), so one peer can take them all; this module keys everything by peer.
Callers pass `now` (trio.current_time()), so tests drive it with a fake clock. No I/O here:
`p2ptrain/net/peerguard.py` applies the verdicts to libp2p.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class Verdict(enum.Enum):
    OK = "ok"
    THROTTLE = "throttle"
    """Refuse this request; the peer stays connected."""
    DISCONNECT = "disconnect"
    """Refuse it and drop the peer: it is banned for `ban_seconds`."""


@dataclass
class LimitsConfig:
    max_streams_per_peer: int = 64
    """Inbound streams one peer may hold open at once (the DHT keeps one per peer)."""
    max_pending_bytes_per_peer: int = 4 << 20
    """Bytes of a peer's request frames read and not yet answered."""
    dht_records_per_second: float = 50.0
    """Sustained rate of records one peer may ask us to store (honest peers: a few per step)."""
    dht_records_burst: int = 500
    """Records a peer may store at once before the rate applies (a restart republishes all)."""
    max_records_per_writer: int = 1024
    """Live records one writer (subkey) may hold in our DHT store, over all keys."""
    strikes_to_disconnect: int = 50
    """Refused requests within `strike_window` seconds before the peer is disconnected."""
    strike_window: float = 10.0
    ban_seconds: float = 120.0
    """How long a disconnected peer's new streams are reset on arrival."""

    def __post_init__(self) -> None:
        for name in ("max_streams_per_peer", "max_pending_bytes_per_peer", "dht_records_burst",
                     "max_records_per_writer", "strikes_to_disconnect"):
            if getattr(self, name) < 1:
                raise ValueError(f"LimitsConfig.{name} must be >= 1")
        for name in ("dht_records_per_second", "strike_window", "ban_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LimitsConfig.{name} must be > 0")


@dataclass
class _Peer:
    streams: int = 0
    pending: int = 0
    tokens: float = 0.0
    refilled: float = 0.0
    strikes: deque = field(default_factory=deque)


@dataclass
class LimitStats:
    throttled: dict[str, int] = field(default_factory=dict)
    """Refusals by resource ('streams', 'pending', 'dht')."""
    disconnected: int = 0
    banned_streams: int = 0


class PeerLimits:
    def __init__(self, config: LimitsConfig | None = None) -> None:
        self.config = config or LimitsConfig()
        self.stats = LimitStats()
        self._peers: dict[bytes, _Peer] = {}
        self._banned: dict[bytes, float] = {}  # peer -> ban expiry

    def _peer(self, peer: bytes, now: float) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            p = self._peers[peer] = _Peer(tokens=float(self.config.dht_records_burst), refilled=now)
        return p

    def banned(self, peer: bytes, now: float) -> bool:
        until = self._banned.get(peer)
        if until is None:
            return False
        if until <= now:
            del self._banned[peer]
            return False
        return True

    def _refuse(self, peer: bytes, p: _Peer, what: str, now: float) -> Verdict:
        self.stats.throttled[what] = self.stats.throttled.get(what, 0) + 1
        cfg = self.config
        p.strikes.append(now)
        while p.strikes and p.strikes[0] <= now - cfg.strike_window:
            p.strikes.popleft()
        if len(p.strikes) >= cfg.strikes_to_disconnect:
            p.strikes.clear()
            self._banned[peer] = now + cfg.ban_seconds
            self.stats.disconnected += 1
            return Verdict.DISCONNECT
        return Verdict.THROTTLE

    def _gate(self, peer: bytes, now: float) -> Verdict | None:
        if self.banned(peer, now):
            self.stats.banned_streams += 1
            return Verdict.DISCONNECT
        return None

    # -- streams ---------------------------------------------------------------------
    def open_stream(self, peer: bytes, now: float) -> Verdict:
        """An inbound stream arrived; on OK the caller must `close_stream` when it ends."""
        gated = self._gate(peer, now)
        if gated is not None:
            return gated
        p = self._peer(peer, now)
        if p.streams >= self.config.max_streams_per_peer:
            return self._refuse(peer, p, "streams", now)
        p.streams += 1
        return Verdict.OK

    def close_stream(self, peer: bytes) -> None:
        p = self._peers.get(peer)
        if p is not None:
            p.streams = max(0, p.streams - 1)
            self._forget_idle(peer, p)

    # -- pending bytes ---------------------------------------------------------------
    def reserve_bytes(self, peer: bytes, n: int, now: float) -> Verdict:
        """Before reading an n-byte frame from `peer`; on OK `release_bytes(n)` when done."""
        gated = self._gate(peer, now)
        if gated is not None:
            return gated
        p = self._peer(peer, now)
        if p.pending + n > self.config.max_pending_bytes_per_peer:
            return self._refuse(peer, p, "pending", now)
        p.pending += n
        return Verdict.OK

    def release_bytes(self, peer: bytes, n: int) -> None:
        p = self._peers.get(peer)
        if p is not None:
            p.pending = max(0, p.pending - n)
            self._forget_idle(peer, p)

    # -- DHT writes ------------------------------------------------------------------
    def dht_store(self, peer: bytes, records: int, now: float) -> Verdict:
        """A store request with `records` records from `peer` (token bucket)."""
        gated = self._gate(peer, now)
        if gated is not None:
            return gated
        cfg = self.config
        p = self._peer(peer, now)
        p.tokens = min(float(cfg.dht_records_burst), p.tokens + (now - p.refilled) * cfg.dht_records_per_second)
        p.refilled = now
        if records > p.tokens:
            return self._refuse(peer, p, "dht", now)
        p.tokens -= records
        return Verdict.OK

    def _forget_idle(self, peer: bytes, p: _Peer) -> None:
        # Bounded memory: a peer with nothing open and a full bucket carries no state.
        if (p.streams == 0 and p.pending == 0 and not p.strikes
                and p.tokens >= self.config.dht_records_burst):
            self._peers.pop(peer, None)

    def usage(self, peer: bytes) -> dict:
        p = self._peers.get(peer)
        return {"streams": p.streams if p else 0, "pending": p.pending if p else 0,
                "tokens": round(p.tokens, 1) if p else float(self.config.dht_records_burst)}
