"""Checkpoints as content-addressed chunks plus a chunk manifest (pure: no I/O, no trio).

A checkpoint blob is cut into fixed-size chunks (4 MiB by default), each named by its
SHA-256. The chunk manifest lists, in order, the chunk hashes, the total size and the
SHA-256 of the whole blob; its own SHA-256 (the "manifest hash") is what peers sign in
their provider records (`p2ptrain.ckpt.providers`). A fetcher that trusts a manifest hash can
therefore verify every chunk as it arrives, from any donor, before assembling anything:
a donor can waste its time but never feed it wrong bytes.

Manifest wire form: msgpack map {"v": 1, "size": int, "chunk": int, "sha256": hex,
"chunks": [32-byte digests]}. `decode_manifest` checks the byte length before parsing and
every field after, so a hostile manifest is rejected without large allocations.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgpack

VERSION = 1
CHUNK_BYTES = 4 << 20
MIN_CHUNK = 4 << 10
MAX_CHUNK = 64 << 20
MAX_CHUNKS = 16384  # 64 GiB at 4 MiB: far above any model we train; bounds the manifest
MAX_MANIFEST_BYTES = 64 + MAX_CHUNKS * 34


class ChunkError(ValueError):
    pass


@dataclass(frozen=True)
class ChunkManifest:
    size: int
    chunk: int
    sha256: str
    chunks: tuple[str, ...]

    def encode(self) -> bytes:
        return msgpack.packb({"v": VERSION, "size": self.size, "chunk": self.chunk, "sha256": self.sha256,
                              "chunks": [bytes.fromhex(c) for c in self.chunks]}, use_bin_type=True)

    def digest(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()

    def span(self, i: int) -> tuple[int, int]:
        start = i * self.chunk
        return start, min(self.size, start + self.chunk)


def expected_chunks(size: int, chunk: int) -> int:
    return max(1, -(-size // chunk))


def split(data: bytes | memoryview, chunk: int = CHUNK_BYTES) -> tuple[ChunkManifest, list[memoryview]]:
    """The manifest of `data` and its chunks (views into `data`, no copies)."""
    if not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise ChunkError(f"chunk size {chunk} is outside [{MIN_CHUNK}, {MAX_CHUNK}]")
    view = memoryview(data).cast("B")
    n = expected_chunks(len(view), chunk)
    if n > MAX_CHUNKS:
        raise ChunkError(f"{len(view)} bytes need {n} chunks, over the limit {MAX_CHUNKS}")
    parts = [view[i * chunk:(i + 1) * chunk] for i in range(n)]
    hashes = tuple(hashlib.sha256(p).hexdigest() for p in parts)
    return ChunkManifest(len(view), chunk, hashlib.sha256(view).hexdigest(), hashes), parts


def decode_manifest(data: bytes, expected_digest: str | None = None,
                    max_size: int = 1 << 36) -> ChunkManifest:
    """A chunk manifest from untrusted bytes; with `expected_digest`, it must hash to it."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ChunkError(f"chunk manifest of {len(data)} bytes is over the limit {MAX_MANIFEST_BYTES}")
    if expected_digest is not None and hashlib.sha256(data).hexdigest() != expected_digest:
        raise ChunkError("chunk manifest does not match its hash")
    try:
        m = msgpack.unpackb(data, raw=False, max_array_len=MAX_CHUNKS, max_map_len=8, max_bin_len=32,
                            max_str_len=64)
        version, size, chunk, whole, raw = m["v"], m["size"], m["chunk"], m["sha256"], m["chunks"]
    except Exception:
        raise ChunkError("chunk manifest is malformed") from None
    if type(version) is not int or version != VERSION:  # True == 1
        raise ChunkError(f"chunk manifest version {version!r} is not supported")
    if not (type(size) is int and type(chunk) is int and 0 <= size <= max_size
            and MIN_CHUNK <= chunk <= MAX_CHUNK):
        raise ChunkError("chunk manifest size or chunk size is out of range")
    if not (isinstance(whole, str) and len(whole) == 64 and _is_hex(whole)):
        raise ChunkError("chunk manifest content hash is malformed")
    if not isinstance(raw, list) or len(raw) != expected_chunks(size, chunk):
        raise ChunkError("chunk manifest lists the wrong number of chunks")
    if not all(isinstance(c, bytes) and len(c) == 32 for c in raw):
        raise ChunkError("chunk manifest has a malformed chunk hash")
    return ChunkManifest(size, chunk, whole, tuple(c.hex() for c in raw))


def _is_hex(s: str) -> bool:
    try:
        bytes.fromhex(s)
        return True
    except ValueError:
        return False


def verify_chunk(manifest: ChunkManifest, i: int, data: bytes | memoryview) -> bool:
    start, end = manifest.span(i)
    return len(data) == end - start and hashlib.sha256(data).hexdigest() == manifest.chunks[i]


class Assembler:
    """Collects verified chunks into one preallocated buffer."""

    def __init__(self, manifest: ChunkManifest) -> None:
        self.manifest = manifest
        self.buf = bytearray(manifest.size)
        self.have: set[int] = set()

    def missing(self) -> list[int]:
        return [i for i in range(len(self.manifest.chunks)) if i not in self.have]

    def put(self, i: int, data: bytes | memoryview) -> bool:
        """Store chunk `i` if it verifies; False means the bytes are wrong (blame the donor)."""
        if not 0 <= i < len(self.manifest.chunks):
            return False
        if i in self.have:
            return True
        if not verify_chunk(self.manifest, i, data):
            return False
        start, end = self.manifest.span(i)
        self.buf[start:end] = data
        self.have.add(i)
        return True

    def done(self) -> bool:
        return len(self.have) == len(self.manifest.chunks)

    def result(self) -> bytes:
        """The whole blob, checked against the manifest's content hash."""
        if not self.done():
            raise ChunkError(f"{len(self.missing())} chunks are still missing")
        data = bytes(self.buf)
        if hashlib.sha256(data).hexdigest() != self.manifest.sha256:
            raise ChunkError("assembled checkpoint does not match the manifest's content hash")
        return data
