"""Signed DHT records: encoding, signing and validation (pure: no I/O, no trio, no libp2p).

A record is one writer's entry under a key: `(key, subkey, value, expiry)` signed with the
writer's Ed25519 key. Keys are multi-writer: the subkey is always the writer's peer id, so a
peer can write only its own entry and nobody can overwrite or delete someone else's. Every
node runs `validate` on what it stores, what it returns and what it receives, so a record
that fails here never reaches application code, whichever node it came through.

Wire form (msgpack array): [version, key, subkey, value, expiry, signer_public, signature].
The signer's key is carried explicitly (not only inside the subkey) so that "valid signature,
but over someone else's subkey" is told apart from a forged signature in the logs.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

import msgpack

from p2ptrain.identity import Identity, peer_id_bytes_from_public, verify

VERSION = 1
NAMESPACE = "/p2ptrain/"
"""Every key starts here; the names under it are built in one place, `p2ptrain.records.keys`."""
MAX_ADDRS = 16
"""Most addresses one peer advertises in any record or reply (DHT contacts, presence, ready,
state, providers): enough for every interface and relay, small enough to bound a record."""
MAX_RECORD_BYTES = 64 * 1024
MAX_KEY_CHARS = 256
_SIGN_DOMAIN = b"p2ptrain-dht-record-v1"


@dataclass(frozen=True)
class KeyClass:
    """What one kind of key may hold: how far ahead a record may expire, how big it may be."""

    max_ttl: float
    max_record_bytes: int = MAX_RECORD_BYTES

    def __post_init__(self) -> None:
        if not (self.max_ttl > 0 and 0 < self.max_record_bytes <= MAX_RECORD_BYTES):
            raise ValueError(f"KeyClass needs max_ttl > 0 and 0 < max_record_bytes <= {MAX_RECORD_BYTES}")


KEY_CLASSES: dict[str, KeyClass] = {
    # The names are the `<what>` of `p2ptrain.records.keys` (a test checks every key it builds
    # has a class). Horizons are a few times the writers' own TTLs (presence 90 s, ready
    # `election.ready_ttl`: 600 s at the default 30 s window, state and providers 600 s,
    # the rest 3,600 s); byte caps are the value limit of the key's decoder plus 2-4 KiB
    # (key, ids and signature take ~420 bytes). A record past either is refused everywhere.
    "peers": KeyClass(600.0, 8 * 1024),
    "ready": KeyClass(6 * 3600.0, 20 * 1024),  # windows up to 18 min (ttl = 20 * window)
    "state": KeyClass(1800.0, 20 * 1024),
    "providers": KeyClass(1800.0, 12 * 1024),
    "reputation": KeyClass(2 * 3600.0, 12 * 1024),
    "data": KeyClass(2 * 3600.0, 4 * 1024),
    "manifest": KeyClass(2 * 3600.0, MAX_RECORD_BYTES),
}


def key_class(key: str) -> str:
    """`/p2ptrain/<scope>/<what>[/...]` -> `<what>` ('' for keys without one)."""
    parts = key[len(NAMESPACE):].split("/", 2)
    return parts[1] if len(parts) > 1 else ""


class RecordError(ValueError):
    """A record failed validation; `reason` is a short stable token for logs and tests."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Record:
    key: str
    subkey: bytes
    value: bytes
    expiry: float
    signer: bytes
    signature: bytes

    def encode(self) -> bytes:
        # Memoized (the fields are frozen): every reply and every size check re-encoded each
        # record, a million times in a 64-peer simulated minute (issue 30).
        wire = self.__dict__.get("_wire")
        if wire is None:
            wire = msgpack.packb(
                [VERSION, self.key, self.subkey, self.value, self.expiry, self.signer, self.signature],
                use_bin_type=True,
            )
            object.__setattr__(self, "_wire", wire)
        return wire

    def newer_than(self, other: "Record") -> bool:
        """Versioning within one (key, subkey): the later expiry wins; ties break on the
        signature bytes so every node picks the same record."""
        return (self.expiry, self.signature) > (other.expiry, other.signature)


def signing_payload(key: str, subkey: bytes, value: bytes, expiry: float) -> bytes:
    return msgpack.packb([_SIGN_DOMAIN, key, subkey, value, float(expiry)], use_bin_type=True)


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key.startswith(NAMESPACE) or len(key) > MAX_KEY_CHARS:
        raise RecordError("bad-key", f"keys are strings under {NAMESPACE!r}, <= {MAX_KEY_CHARS} chars")
    return key


def make_record(identity: Identity, key: str, value: bytes, expiry: float) -> Record:
    check_key(key)
    subkey = identity.peer_id
    sig = identity.sign(signing_payload(key, subkey, value, expiry))
    rec = Record(key, subkey, bytes(value), float(expiry), identity.public, sig)
    if len(rec.encode()) > MAX_RECORD_BYTES:
        raise RecordError("oversize", f"record is over {MAX_RECORD_BYTES} bytes")
    return rec


def decode(data: bytes) -> Record:
    """Parse a record's wire form, enforcing the size limit before touching msgpack."""
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError("oversize", f"{len(data)} bytes > {MAX_RECORD_BYTES}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=MAX_RECORD_BYTES,
            max_str_len=MAX_KEY_CHARS * 4, max_array_len=16, max_map_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise RecordError("malformed", f"{type(exc).__name__}") from None
    if not (isinstance(obj, list) and len(obj) == 7 and type(obj[0]) is int and obj[0] == VERSION):  # True == 1
        raise RecordError("malformed", "expected [version, key, subkey, value, expiry, signer, sig]")
    _, key, subkey, value, expiry, signer, sig = obj
    if not (isinstance(subkey, bytes) and isinstance(value, bytes) and isinstance(signer, bytes)
            and isinstance(sig, bytes) and isinstance(expiry, float)):
        raise RecordError("malformed", "wrong field types")
    return Record(check_key(key), subkey, value, expiry, signer, sig)


class SignatureCache:
    """Records whose signature already verified, by the SHA-256 of their wire form (which
    holds the key, subkey, value, expiry, signer and signature): a read that gets the same
    record from five replicas, or polls a key every 0.2 s, verifies it once. Bounded (least
    recently used out); only successes are kept, so nothing an attacker sends can make a
    later check pass."""

    def __init__(self, size: int = 16384) -> None:
        self.size = size
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._wire: OrderedDict[bytes, Record] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def check(self, rec: Record) -> bool:
        tag = hashlib.sha256(rec.encode()).digest()
        if tag in self._seen:
            self._seen.move_to_end(tag)
            self.hits += 1
            return True
        self.misses += 1
        if not verify(rec.signer, rec.signature, signing_payload(rec.key, rec.subkey, rec.value, rec.expiry)):
            return False
        self._seen[tag] = None
        if len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return True

    def decoded(self, wire: bytes) -> "Record | None":
        """The record these exact wire bytes decoded to when they last passed every check
        but the time-dependent ones (`check_live`, which the caller still runs): an
        election polls the same records every 0.2 s, and decoding and checking them again
        was most of a reader's time (a 64-peer simulated run, issue 30)."""
        rec = self._wire.get(wire)
        if rec is not None:
            self._wire.move_to_end(wire)
        return rec

    def remember(self, wire: bytes, rec: "Record") -> None:
        self._wire[wire] = rec
        if len(self._wire) > self.size:
            self._wire.popitem(last=False)


def check_live(rec: Record, now: float, max_ttl: float, max_skew: float,
               max_bytes: int = MAX_RECORD_BYTES) -> Record:
    """The checks that change with time or key class (no signature): live at `now`, expiring
    no later than `max_ttl` (+ skew) ahead, and at most `max_bytes` on the wire."""
    if not math.isfinite(rec.expiry) or rec.expiry <= now:
        raise RecordError("expired", f"expiry {rec.expiry:.3f} <= now {now:.3f}")
    if rec.expiry > now + max_ttl + max_skew:
        raise RecordError("far-future", f"expiry {rec.expiry - now:.0f}s ahead > {max_ttl + max_skew:.0f}s")
    if max_bytes < MAX_RECORD_BYTES:
        size = len(rec.encode())
        if size > max_bytes:
            raise RecordError("oversize-for-key", f"{size} bytes > {max_bytes} for {key_class(rec.key)!r} keys")
    return rec


def validate(rec: Record, now: float, max_ttl: float, max_skew: float, max_bytes: int = MAX_RECORD_BYTES,
             cache: SignatureCache | None = None) -> Record:
    """Raise RecordError unless `rec` is signed by the owner of its subkey and live at `now`
    (`check_live`). `cache`: skip the signature check of a record already verified."""
    check_key(rec.key)
    if len(rec.signer) != 32 or len(rec.signature) != 64:
        raise RecordError("bad-signature", "wrong key or signature length")
    ok = (cache.check(rec) if cache is not None else
          verify(rec.signer, rec.signature, signing_payload(rec.key, rec.subkey, rec.value, rec.expiry)))
    if not ok:
        raise RecordError("bad-signature", "signature does not verify")
    if rec.subkey != peer_id_bytes_from_public(rec.signer):
        raise RecordError("foreign-subkey", "the signer does not own this subkey")
    return check_live(rec, now, max_ttl, max_skew, max_bytes)


def decode_and_validate(data: bytes, now: float, max_ttl: float, max_skew: float,
                        max_bytes: int = MAX_RECORD_BYTES, cache: SignatureCache | None = None) -> Record:
    return validate(decode(data), now, max_ttl, max_skew, max_bytes, cache)
