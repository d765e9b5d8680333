"""The DHT node's settings (`DHTConfig`: routing, timeouts, record and store limits) and
counters (`DHTStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2ptrain.dht import protocol
from p2ptrain.dht.record import KEY_CLASSES, MAX_RECORD_BYTES, KeyClass, key_class
from p2ptrain.dht.storage import StoreLimits


@dataclass
class DHTConfig:
    bucket_size: int = 20
    """Kademlia k: peers per bucket and peers returned per lookup step."""
    replication: int = 5
    """How many of the closest nodes hold each record."""
    alpha: int = 3
    """Lookup parallelism."""
    rpc_timeout: float = 3.0
    """Seconds one DHT request may take before the peer counts as failed."""
    lookup_timeout: float = 10.0
    """Seconds a whole store/get/lookup may take."""
    max_ttl: float = 2 * 3600.0
    """Longest lifetime a record may claim under a key with no class in `key_classes`;
    later expiries are 'far-future'."""
    key_classes: dict[str, KeyClass] = field(default_factory=lambda: dict(KEY_CLASSES))
    """Per kind of key (`record.key_class`): its expiry horizon and record size cap."""
    max_clock_skew: float = 60.0
    """Tolerance for writers whose clocks run ahead of ours."""
    refresh_interval: float = 60.0
    """Seconds between routing refreshes and republishing our own records."""
    max_records: int = 100_000
    max_bytes: int = 256 << 20
    """Bytes of records our store holds in all (a full store evicts from the heaviest sender)."""
    max_subkeys_per_key: int = 4096
    max_key_bytes: int = 8 << 20
    max_records_per_get: int = 256
    """Records per reply; keeps replies below the frame limit."""
    max_reply_bytes: int = 256 * 1024
    """Record bytes per reply (half a frame); which records fit: `RecordStore.select`."""
    max_records_per_writer: int = 1024
    """Live records one writer may hold in our store, over all keys (flood bound)."""
    max_bytes_per_writer: int = 1 << 20
    max_writers_per_sender: int = 16
    """Identities one remote peer may store records for (honest peers store only their own)."""
    max_bytes_per_sender: int = 4 << 20
    max_records_per_sender: int = 2048
    signature_cache: int = 16384
    """Records whose verified signature we remember (`record.SignatureCache`)."""

    def __post_init__(self) -> None:
        for name in ("bucket_size", "replication", "alpha", "max_records", "max_records_per_get",
                     "max_records_per_writer", "max_bytes", "max_subkeys_per_key", "max_key_bytes",
                     "max_reply_bytes", "max_bytes_per_writer", "max_writers_per_sender",
                     "max_bytes_per_sender", "max_records_per_sender", "signature_cache"):
            if getattr(self, name) < 1:
                raise ValueError(f"DHTConfig.{name} must be >= 1")
        if self.max_reply_bytes > protocol.DEFAULT_MAX_FRAME // 2:
            raise ValueError(f"DHTConfig.max_reply_bytes must be <= {protocol.DEFAULT_MAX_FRAME // 2}")
        if not all(isinstance(c, KeyClass) for c in self.key_classes.values()):
            raise ValueError("DHTConfig.key_classes maps key kinds to record.KeyClass")
        for name in ("rpc_timeout", "lookup_timeout", "max_ttl", "refresh_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DHTConfig.{name} must be > 0")

    def store_limits(self) -> StoreLimits:
        return StoreLimits(
            max_records=self.max_records, max_bytes=self.max_bytes, max_subkeys_per_key=self.max_subkeys_per_key,
            max_key_bytes=self.max_key_bytes, max_per_writer=self.max_records_per_writer,
            max_bytes_per_writer=self.max_bytes_per_writer, max_writers_per_sender=self.max_writers_per_sender,
            max_bytes_per_sender=self.max_bytes_per_sender, max_records_per_sender=self.max_records_per_sender)

    def limits_for(self, key: str) -> tuple[float, int]:
        """(expiry horizon, record byte cap) of `key`'s class."""
        c = self.key_classes.get(key_class(key))
        return (c.max_ttl, c.max_record_bytes) if c is not None else (self.max_ttl, MAX_RECORD_BYTES)


@dataclass
class DHTStats:
    rejected: dict[str, int] = field(default_factory=dict)
    rpcs: int = 0
    """Requests this node sent (benches report RPCs per operation)."""

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
