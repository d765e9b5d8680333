"""The local record store: validated records by (key, subkey), with expiry (pure logic).

Callers pass `now` (wall time from `p2ptrain.clock`), so tests drive expiry with trio's
autojump clock. Capacity limits bound memory against floods: a full store rejects new
records rather than evicting live ones, so a flooder cannot push out honest entries.
"""

from __future__ import annotations

from p2ptrain.dht.record import Record, RecordError

__all__ = ["RecordStore"]


class RecordStore:
    def __init__(self, max_records: int = 100_000, max_subkeys_per_key: int = 4096,
                 max_per_writer: int = 1024) -> None:
        self.max_records = max_records
        self.max_subkeys_per_key = max_subkeys_per_key
        self.max_per_writer = max_per_writer
        self._data: dict[str, dict[bytes, Record]] = {}
        self._count = 0
        # Live records per writer (subkey): one identity cannot fill the store by itself.
        self._per_writer: dict[bytes, int] = {}

    def __len__(self) -> int:
        return self._count

    def put(self, rec: Record, now: float) -> bool:
        """Store an already-validated record. Returns False if an equal or newer one is held.

        Raises RecordError('store-full') when a limit would be exceeded.
        """
        entries = self._data.get(rec.key)
        if entries is not None:
            old = entries.get(rec.subkey)
            if old is not None:
                if old.expiry > now and not rec.newer_than(old):
                    return False
                entries[rec.subkey] = rec
                return True
        if self._count >= self.max_records:
            self.expire(now)
        if self._count >= self.max_records:
            raise RecordError("store-full", f"{self._count} records held")
        if self._per_writer.get(rec.subkey, 0) >= self.max_per_writer:
            self.expire(now)
            if self._per_writer.get(rec.subkey, 0) >= self.max_per_writer:
                raise RecordError("writer-full", f"writer holds {self.max_per_writer} live records")
        entries = self._data.setdefault(rec.key, {})
        if len(entries) >= self.max_subkeys_per_key:
            raise RecordError("store-full", f"{len(entries)} subkeys under {rec.key}")
        entries[rec.subkey] = rec
        self._count += 1
        self._per_writer[rec.subkey] = self._per_writer.get(rec.subkey, 0) + 1
        return True

    def get(self, key: str, now: float) -> list[Record]:
        entries = self._data.get(key)
        if not entries:
            return []
        return [r for r in entries.values() if r.expiry > now]

    def expire(self, now: float) -> int:
        dropped = 0
        for key in list(self._data):
            entries = self._data[key]
            for sub in [s for s, r in entries.items() if r.expiry <= now]:
                del entries[sub]
                dropped += 1
                left = self._per_writer.get(sub, 1) - 1
                if left > 0:
                    self._per_writer[sub] = left
                else:
                    self._per_writer.pop(sub, None)
            if not entries:
                del self._data[key]
        self._count -= dropped
        return dropped
