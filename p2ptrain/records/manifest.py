"""The run manifest's wire form and identity (pure: no I/O): its canonical encoding, its run
id, its signature check, and the size- and depth-checked decoder of the `manifest` record.

The run id is the SHA-256 of the canonical encoding of the whole manifest (including the
initiator's signature), so a manifest fetched from anyone is checked against the id alone;
the signature additionally ties the run to the initiator's key. Canonical encoding: msgpack
of the manifest as nested maps with sorted keys; floats stay floats, so TOML round trips
keep the id. `ManifestError` is a `RecordError` (reason: its message), so a manifest record
is refused like any other record; the manifest on disk (TOML, signing) is `p2ptrain.run.manifest`.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from p2ptrain.dht.record import RecordError
from p2ptrain.identity import peer_id_bytes_from_public, peer_id_to_str, verify

MAX_MANIFEST_BYTES = 32 * 1024
MAX_DEPTH = 6
"""A manifest is sections of scalars and short lists: 3 levels; 6 leaves room to grow."""
_DOMAIN = b"p2ptrain-manifest-v1"


class ManifestError(RecordError):
    pass


def _sorted(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _sorted(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [_sorted(v) for v in obj]
    return obj


def canonical(obj: dict) -> bytes:
    return msgpack.packb(_sorted(obj), use_bin_type=True)


def body_bytes(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return _DOMAIN + canonical(body)


def run_id(manifest: dict) -> str:
    return hashlib.sha256(canonical(manifest)).hexdigest()


def verify_manifest(manifest: dict, expected_id: str | None = None) -> str:
    """Check the signature (and the id, if given); returns the run id."""
    try:
        pub = bytes.fromhex(manifest["initiator"]["public_key"])
        sig = bytes.fromhex(manifest["signature"])
        peer = manifest["initiator"]["peer"]
    except (KeyError, TypeError, ValueError):
        raise ManifestError("manifest has no valid initiator key or signature") from None
    if len(pub) != 32 or peer_id_to_str(peer_id_bytes_from_public(pub)) != peer:
        raise ManifestError("manifest initiator peer id does not match its public key")
    if not verify(pub, sig, body_bytes(manifest)):
        raise ManifestError("manifest signature does not verify: it was altered after signing")
    rid = run_id(manifest)
    if expected_id is not None and rid != expected_id:
        raise ManifestError(f"manifest hashes to {rid[:16]}..., not the run id {expected_id[:16]}...")
    return rid


def encode(manifest: dict) -> bytes:
    data = canonical(manifest)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes is over {MAX_MANIFEST_BYTES}")
    return data


def decode(data: bytes) -> dict:
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes is over {MAX_MANIFEST_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, max_str_len=MAX_MANIFEST_BYTES, max_array_len=256,
                              max_map_len=256, max_bin_len=0)
    except Exception:
        raise ManifestError("manifest is not valid msgpack") from None
    if not isinstance(obj, dict):
        raise ManifestError("manifest is not a map")
    if _depth(obj) > MAX_DEPTH:
        # msgpack nests ~1000 deep within the size limit, and hashing a manifest recurses
        # (`_sorted`): without this a signed, deeply nested manifest raised RecursionError.
        raise ManifestError(f"manifest nests deeper than {MAX_DEPTH} levels")
    return obj


def _depth(obj: Any) -> int:
    """Nesting depth, iteratively (a recursive walk is what the limit protects)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            break
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)
    return deepest
