"""The run manifest: everything a peer needs to take part in a run, signed by its initiator.

The run id is the SHA-256 of the canonical encoding of the whole manifest (including the
initiator's signature), so a manifest fetched from anyone is checked against the id alone;
the signature additionally ties the run to the initiator's key. Canonical encoding: msgpack
of the manifest as nested maps with sorted keys; floats stay floats, so TOML round trips
keep the id.

On disk it is DIR/run.toml (readable, editable only by making a new run).
"""

from __future__ import annotations

import hashlib
import math
import tomllib
from pathlib import Path
from typing import Any

import msgpack

from p2ptrain.identity import Identity, peer_id_bytes_from_public, peer_id_to_str, verify

MAX_MANIFEST_BYTES = 32 * 1024
MAX_DEPTH = 6
"""A manifest is sections of scalars and short lists: 3 levels; 6 leaves room to grow."""
_DOMAIN = b"p2ptrain-manifest-v1"


class ManifestError(ValueError):
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


def parse_run_id(text: str) -> str:
    """A run id as typed by a user, checked before any network work: a malformed one would
    otherwise be looked up in the DHT until the manifest wait times out (issue 33)."""
    rid = text.strip().lower()
    wrong = (f"it has {len(rid)} characters" if len(rid) != 64 else
             "it has characters other than 0-9 and a-f" if set(rid) - set("0123456789abcdef") else "")
    if wrong:
        shown = text if len(text) <= 20 else text[:16] + "..."
        raise ManifestError(f"{shown!r} is not a run id ({wrong}): a run id is the 64 hex characters "
                            "`p2ptrain init` printed")
    return rid


def sign(manifest: dict, identity: Identity) -> dict:
    m = dict(manifest)
    m["initiator"] = {"peer": identity.peer_id_str, "public_key": identity.public.hex()}
    m["signature"] = identity.sign(body_bytes(m)).hex()
    return m


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


# -- TOML -------------------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ManifestError("manifest values must be finite")
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ManifestError(f"cannot write {type(v).__name__} to TOML")


def to_toml(manifest: dict, rid: str) -> str:
    lines = [f"# p2ptrain run manifest. Run id: {rid}", "# Any edit changes the run id and breaks the signature.", ""]
    scalars = {k: v for k, v in manifest.items() if not isinstance(v, dict)}
    for k in sorted(scalars):
        lines.append(f"{k} = {_toml_value(scalars[k])}")
    for k in sorted(manifest):
        if isinstance(manifest[k], dict):
            lines += ["", f"[{k}]"]
            for kk in sorted(manifest[k]):
                lines.append(f"{kk} = {_toml_value(manifest[k][kk])}")
    return "\n".join(lines) + "\n"


def write(manifest: dict, directory: Path) -> str:
    rid = verify_manifest(manifest)
    text = to_toml(manifest, rid)
    if tomllib.loads(text) != manifest:  # the file must reproduce the exact manifest
        raise ManifestError("manifest does not round-trip through TOML")
    path = Path(directory) / "run.toml"
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return rid


def read(path: Path) -> tuple[dict, str]:
    try:
        with open(path, "rb") as f:
            manifest = tomllib.load(f)
    except FileNotFoundError:
        raise ManifestError(f"no manifest at {path}: create one with `p2ptrain init --out DIR`") from None
    except IsADirectoryError:
        inside = Path(path) / "run.toml"
        hint = f"; the manifest is the file {inside}" if inside.is_file() else ""
        raise ManifestError(f"{path} is a directory, not a manifest file{hint}") from None
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path} is not valid TOML: {exc}") from None
    return manifest, verify_manifest(manifest)
