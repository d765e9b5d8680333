"""The local record store: validated records by (key, subkey), with expiry, byte budgets and
the order replies are served in (pure logic).

Callers pass `now` (wall time from `p2ptrain.clock`), so tests drive expiry with trio's
autojump clock, and the peer that delivered each record (`sender`: the RPC source, which a
record's signature says nothing about), so budgets hold per connection as well as per writer.

What one party can hold here (issue 32: records and identities are free, bytes are not):
  - a writer (identity, the subkey): `max_per_writer` records and `max_bytes_per_writer`;
  - a sender (remote peer): records of at most `max_writers_per_sender` identities,
    `max_records_per_sender` and `max_bytes_per_sender` in all, so one connection cannot
    bring a crowd of identities;
  - a key: `max_subkeys_per_key` writers and `max_key_bytes`; the node: `max_records`, `max_bytes`.
Writer and sender budgets refuse (`writer-full`, `sender-full`). A full key or node does not
lock newcomers out: it makes room from whoever holds the largest share there -- in a key the
sender that delivered the most of its records, in the node the sender holding the most bytes
-- but only for a newcomer whose own share stays no larger (node: smaller), so a flooder can
displace no one holding less than it does, and honest writers (one record per key, a few KiB
in all) always get in.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from p2ptrain.dht.record import Record, RecordError

__all__ = ["RecordStore", "StoreLimits", "SMALL_RECORD"]

SMALL_RECORD = 4 * 1024
"""Records up to this size are served in one random tier: a writer gains nothing by being
smaller still, while bigger ones are served after every small one (by size class)."""


@dataclass(frozen=True)
class StoreLimits:
    max_records: int = 100_000
    max_bytes: int = 256 << 20
    max_subkeys_per_key: int = 4096
    max_key_bytes: int = 8 << 20
    max_per_writer: int = 1024
    max_bytes_per_writer: int = 1 << 20
    max_writers_per_sender: int = 16
    max_bytes_per_sender: int = 4 << 20
    max_records_per_sender: int = 2048

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"StoreLimits.{name} must be an int >= 1")


@dataclass
class _Entry:
    rec: Record
    size: int
    sender: bytes


@dataclass
class _Sender:
    bytes: int = 0
    writers: dict[bytes, int] | None = None  # writer -> records it holds via this sender
    entries: set[tuple[str, bytes]] | None = None


class RecordStore:
    def __init__(self, max_records: int = 100_000, max_subkeys_per_key: int = 4096,
                 max_per_writer: int = 1024, limits: StoreLimits | None = None,
                 rng: random.Random | None = None) -> None:
        if limits is None:
            limits = StoreLimits(max_records=max_records, max_subkeys_per_key=max_subkeys_per_key,
                                 max_per_writer=max_per_writer)
        self.limits = limits
        self._rng = rng or random.Random(0)  # ties among equal shares; not a secret
        self._data: dict[str, dict[bytes, _Entry]] = {}
        self._key_bytes: dict[str, int] = {}
        self._count = 0
        self.bytes = 0
        self._writer_count: dict[bytes, int] = {}
        self._writer_bytes: dict[bytes, int] = {}
        self._senders: dict[bytes, _Sender] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return self._count

    # -- bookkeeping -------------------------------------------------------------------
    def _add(self, entry: _Entry) -> None:
        rec = entry.rec
        self._data.setdefault(rec.key, {})[rec.subkey] = entry
        self._key_bytes[rec.key] = self._key_bytes.get(rec.key, 0) + entry.size
        self._count += 1
        self.bytes += entry.size
        self._writer_count[rec.subkey] = self._writer_count.get(rec.subkey, 0) + 1
        self._writer_bytes[rec.subkey] = self._writer_bytes.get(rec.subkey, 0) + entry.size
        s = self._senders.get(entry.sender)
        if s is None:
            s = self._senders[entry.sender] = _Sender(0, {}, set())
        s.bytes += entry.size
        s.writers[rec.subkey] = s.writers.get(rec.subkey, 0) + 1
        s.entries.add((rec.key, rec.subkey))

    def _remove(self, key: str, subkey: bytes) -> _Entry:
        entries = self._data[key]
        entry = entries.pop(subkey)
        if entries:
            self._key_bytes[key] -= entry.size
        else:
            del self._data[key]
            del self._key_bytes[key]
        self._count -= 1
        self.bytes -= entry.size
        _dec(self._writer_count, subkey, 1)
        _dec(self._writer_bytes, subkey, entry.size)
        s = self._senders[entry.sender]
        s.bytes -= entry.size
        _dec(s.writers, subkey, 1)
        s.entries.discard((key, subkey))
        if not s.entries:
            del self._senders[entry.sender]
        return entry

    # -- writes ------------------------------------------------------------------------
    def put(self, rec: Record, now: float, sender: bytes | None = None) -> bool:
        """Store an already-validated record delivered by `sender` (default: its writer).
        Returns False if an equal or newer one is held.

        Raises RecordError ('writer-full', 'sender-full', 'key-full', 'store-full') when a
        budget would be exceeded and no room can fairly be made."""
        sender = rec.subkey if sender is None else sender
        size = len(rec.encode())
        entries = self._data.get(rec.key)
        old = entries.get(rec.subkey) if entries is not None else None
        if old is not None and old.rec.expiry > now and not rec.newer_than(old.rec):
            return False
        try:
            self._check_budgets(rec, size, sender, old)
        except RecordError:
            if not self.expire(now):
                raise
            entries = self._data.get(rec.key)
            old = entries.get(rec.subkey) if entries is not None else None
            self._check_budgets(rec, size, sender, old)
        if old is not None:
            self._remove(rec.key, rec.subkey)
        try:
            self._make_room(rec, size, sender, now)
        except RecordError:
            if old is not None and old.rec.expiry > now:
                self._add(old)
            raise
        self._add(_Entry(rec, size, sender))
        return True

    def _check_budgets(self, rec: Record, size: int, sender: bytes, old: _Entry | None) -> None:
        lim = self.limits
        freed = old.size if old is not None else 0
        if (self._writer_count.get(rec.subkey, 0) + (old is None) > lim.max_per_writer
                or self._writer_bytes.get(rec.subkey, 0) - freed + size > lim.max_bytes_per_writer):
            raise RecordError("writer-full", f"writer holds {self._writer_count.get(rec.subkey, 0)} records, "
                              f"{self._writer_bytes.get(rec.subkey, 0)} bytes")
        s = self._senders.get(sender)
        if s is None:
            held, writers = 0, {}
        else:
            held = s.bytes - (freed if old is not None and old.sender == sender else 0)
            writers = s.writers
        if rec.subkey not in writers and len(writers) >= lim.max_writers_per_sender:
            raise RecordError("sender-full", f"sender already stores for {len(writers)} identities")
        if held + size > lim.max_bytes_per_sender:
            raise RecordError("sender-full", f"sender holds {held} bytes")
        count = len(s.entries) if s is not None else 0
        if count - (old is not None and old.sender == sender) + 1 > lim.max_records_per_sender:
            raise RecordError("sender-full", f"sender holds {count} records")

    def _make_room(self, rec: Record, size: int, sender: bytes, now: float) -> None:
        lim = self.limits
        expired = False
        while True:
            entries = self._data.get(rec.key, {})
            if len(entries) < lim.max_subkeys_per_key and self._key_bytes.get(rec.key, 0) + size <= lim.max_key_bytes:
                break
            if not expired:
                expired = True
                self.expire(now)
                continue
            self._evict_from_key(rec.key, sender)
        while self._count + 1 > lim.max_records or self.bytes + size > lim.max_bytes:
            if not expired:
                expired = True
                self.expire(now)
                continue
            self._evict_from_node(sender, size)

    def _evict_from_key(self, key: str, sender: bytes) -> None:
        if key not in self._data:
            raise RecordError("key-full", f"a record over the key's {self.limits.max_key_bytes} bytes")
        shares: dict[bytes, int] = {}
        for e in self._data[key].values():
            shares[e.sender] = shares.get(e.sender, 0) + 1
        top = max(shares.values())
        if shares.get(sender, 0) + 1 > top:
            raise RecordError("key-full", f"{len(self._data[key])} writers under {key}; "
                              f"this sender already delivered {shares.get(sender, 0)} of them")
        heavy = sorted(s for s, n in shares.items() if n == top)
        victim_sender = heavy[self._rng.randrange(len(heavy))]
        victims = [e for e in self._data[key].values() if e.sender == victim_sender]
        victim = max(victims, key=lambda e: (e.size, e.rec.subkey))
        self._remove(key, victim.rec.subkey)
        self.evicted += 1

    def _evict_from_node(self, sender: bytes, size: int) -> None:
        if not self._senders:
            raise RecordError("store-full", f"a record over the store's {self.limits.max_bytes} bytes")
        heavy, s = max(self._senders.items(), key=lambda kv: (kv[1].bytes, kv[0]))
        mine = self._senders[sender].bytes if sender in self._senders else 0
        if mine + size >= s.bytes:
            raise RecordError("store-full", f"{self._count} records, {self.bytes} bytes held")
        key, subkey = max(s.entries, key=lambda ks: (self._data[ks[0]][ks[1]].size, ks))
        self._remove(key, subkey)
        self.evicted += 1

    # -- reads -------------------------------------------------------------------------
    def get(self, key: str, now: float) -> list[Record]:
        entries = self._data.get(key)
        if not entries:
            return []
        return [e.rec for e in entries.values() if e.rec.expiry > now]

    def select(self, key: str, now: float, max_records: int, max_bytes: int, salt: bytes) -> list[Record]:
        """The live records of `key` a reply carries, at most `max_records` and `max_bytes`.

        Insertion order would let whoever writes first fill the reply. Instead: first the
        records whose sender delivered few of this key's records (a peer storing its own
        entry has a share of 1), then small records before big ones (by size class, all up
        to SMALL_RECORD alike), then an order keyed by the caller's per-request `salt`, which
        no writer can predict. A record that does not fit the byte budget is skipped, not a
        stopping point, so a few big records cannot hide the small ones behind them."""
        entries = self._data.get(key)
        if not entries:
            return []
        live = [e for e in entries.values() if e.rec.expiry > now]
        shares: dict[bytes, int] = {}
        for e in live:
            shares[e.sender] = shares.get(e.sender, 0) + 1

        def rank(e: _Entry) -> tuple:
            tier = 0 if e.size <= SMALL_RECORD else e.size.bit_length()
            return shares[e.sender], tier, hashlib.blake2b(e.rec.subkey, key=salt[:64], digest_size=8).digest()

        out: list[Record] = []
        budget = max_bytes
        for e in sorted(live, key=rank):
            if len(out) >= max_records:
                break
            if e.size <= budget:
                out.append(e.rec)
                budget -= e.size
        return out

    def expire(self, now: float) -> int:
        dropped = 0
        for key in list(self._data):
            for sub in [s for s, e in self._data[key].items() if e.rec.expiry <= now]:
                self._remove(key, sub)
                dropped += 1
        return dropped


def _dec(d: dict, k, n: int) -> None:
    left = d.get(k, n) - n
    if left > 0:
        d[k] = left
    else:
        d.pop(k, None)
