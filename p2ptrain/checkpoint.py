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
        header = msgpack.unpackb(data[8:8 + hlen], raw=False, max_array_len=100_000, max_map_len=1024)
        meta, entries = header["meta"], header["arrays"]
    except Exception:
        raise CheckpointError("checkpoint header is malformed") from None
    body = data[8 + hlen:]
    arrays: dict[str, np.ndarray] = {}
    for entry in entries:
        try:
            name, dtype, shape, off, nbytes = entry
            dt = np.dtype(dtype)
            count = int(np.prod(shape)) if shape else 1
        except Exception:
            raise CheckpointError("checkpoint array entry is malformed") from None
        if dtype not in DTYPES or off < 0 or nbytes != count * dt.itemsize or off + nbytes > len(body):
            raise CheckpointError(f"checkpoint array {name!r} is out of bounds or of a bad dtype")
        arrays[name] = np.frombuffer(body, dtype=dt, count=count, offset=off).reshape(shape)
    return arrays, meta


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
