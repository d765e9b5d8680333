"""Checkpoints: a safe binary format (no pickle), content hashes, atomic files.

Checkpoints come from untrusted peers, so the format is data only: a length-prefixed msgpack
header (metadata plus, per array, name, dtype, shape, offset, length) followed by raw array
bytes. Decoding checks the header size before parsing it, allows only plain numeric dtypes,
and checks every array lies inside the buffer. The content hash is SHA-256 of the bytes.

Files are written atomically (temporary file, fsync, rename, fsync of the directory), so a
crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import msgpack
import numpy as np

MAGIC = b"P2CK"
MAX_HEADER = 1 << 20
DTYPES = {"float32", "float16", "int8", "uint8", "int32", "int64", "uint16"}


class CheckpointError(ValueError):
    pass


def encode(arrays: dict[str, np.ndarray], meta: dict) -> bytes:
    entries, offset, blobs = [], 0, []
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        if a.dtype.name not in DTYPES:
            raise CheckpointError(f"dtype {a.dtype} of {name} is not allowed")
        entries.append([name, a.dtype.name, list(a.shape), offset, a.nbytes])
        blobs.append(a.tobytes())
        offset += a.nbytes
    header = msgpack.packb({"meta": meta, "arrays": entries}, use_bin_type=True)
    return MAGIC + struct.pack(">I", len(header)) + header + b"".join(blobs)


def decode(data: bytes | memoryview, max_bytes: int = 1 << 34) -> tuple[dict[str, np.ndarray], dict]:
    data = memoryview(data)
    if len(data) > max_bytes:
        raise CheckpointError(f"checkpoint of {len(data)} bytes is over the limit {max_bytes}")
    if len(data) < 8 or bytes(data[:4]) != MAGIC:
        raise CheckpointError("not a p2ptrain checkpoint")
    (hlen,) = struct.unpack(">I", data[4:8])
    if hlen > MAX_HEADER or 8 + hlen > len(data):
        raise CheckpointError("checkpoint header is too large or truncated")
    try:
        header = msgpack.unpackb(data[8:8 + hlen], raw=False, max_array_len=100_000, max_map_len=1024,
                                 max_str_len=hlen, max_bin_len=hlen, max_ext_len=0)
        meta, entries = header["meta"], header["arrays"]
    except Exception:
        raise CheckpointError("checkpoint header is malformed") from None
    if not isinstance(meta, dict) or not isinstance(entries, list) or not all(isinstance(k, str) for k in meta):
        raise CheckpointError("checkpoint header is malformed: meta must be a map, arrays a list")
    body = data[8 + hlen:]
    arrays: dict[str, np.ndarray] = {}
    for entry in entries:
        name, dt, shape, off, count = _check_entry(entry, len(body))
        if name in arrays:
            raise CheckpointError(f"checkpoint array {name!r} appears twice")
        arrays[name] = np.frombuffer(body, dtype=dt, count=count, offset=off).reshape(shape)
    return arrays, meta


def _check_entry(entry: object, body_len: int) -> tuple[str, np.dtype, tuple[int, ...], int, int]:
    """One array entry, checked field by field: entries come from untrusted peers, so a
    negative dimension, an overflowing shape or a non-integer offset must be a rejection,
    not an exception from numpy (or a silent read of the whole buffer, as count=-1 does)."""
    if not (isinstance(entry, list) and len(entry) == 5):
        raise CheckpointError("checkpoint array entry is malformed")
    name, dtype, shape, off, nbytes = entry
    if not (isinstance(name, str) and isinstance(dtype, str) and dtype in DTYPES and isinstance(shape, list)
            and len(shape) <= 8 and all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
            and type(off) is int and type(nbytes) is int and off >= 0 and nbytes >= 0):
        raise CheckpointError(f"checkpoint array entry {str(name)[:40]!r} has bad fields")
    dt = np.dtype(dtype)
    count = 1
    for d in shape:  # Python ints: no int64 overflow for hostile shapes
        count *= d
    if nbytes != count * dt.itemsize or off + nbytes > body_len:
        raise CheckpointError(f"checkpoint array {name!r} is out of bounds")
    return name, dt, tuple(shape), off, count


def state_size_limit(manifest: dict) -> int:
    """Most bytes a state checkpoint of this run may have: fetches stop before reading more.

    States hold the same arrays as genesis (whose size the signed manifest records) plus
    a few metadata fields, so twice that and a MiB of slack is generous."""
    try:
        return 2 * int(manifest["genesis"]["bytes"]) + (1 << 20)
    except (KeyError, TypeError, ValueError):
        return 1 << 32


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def outer_state_arrays(params: np.ndarray, momentum: np.ndarray) -> dict[str, np.ndarray]:
    return {"params": np.asarray(params, np.float32), "momentum": np.asarray(momentum, np.float32)}
