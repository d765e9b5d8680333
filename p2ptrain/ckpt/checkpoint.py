"""Checkpoints: a safe binary format (no pickle), content hashes, atomic files.

Checkpoints come from untrusted peers, so the format is data only: a length-prefixed msgpack
header (metadata plus, per array, name, dtype, shape, offset, length) followed by raw array
bytes. Decoding checks the header size before parsing it, allows only plain numeric dtypes,
and checks every array lies inside the buffer. The content hash is SHA-256 of the bytes.

Files are written atomically (temporary file, fsync, rename, fsync of the directory), so a
crash mid-write leaves the previous checkpoint intact; a write that fails (a full disk)
removes its temporary file and leaves the previous one intact too. `AsyncWriter` does that
in a thread of its own: training hands over the bytes of an in-memory snapshot and goes on;
the writer keeps the last K files, removes temporary files a killed process left behind, and
reports a failed write (issue 33: a full disk used to stop checkpoints in silence).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
from pathlib import Path

import msgpack
import numpy as np

log = logging.getLogger("p2ptrain.ckpt.checkpoint")
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


def state_size_limit(genesis_bytes: int) -> int:
    """Most bytes a state checkpoint of this run may have: fetches stop before reading more.

    States hold the same arrays as genesis (whose size the run's spec records) plus a few
    metadata fields, so twice that and a MiB of slack is generous."""
    return 2 * int(genesis_bytes) + (1 << 20)


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def tmp_path(path: Path) -> Path:
    """Where `write_atomic` writes `path` before the rename (a crash leaves it behind)."""
    return path.with_name(f".{path.name}.tmp.{os.getpid()}")


def write_atomic(path: Path, data: bytes) -> None:
    """`path` holds `data` or, if this raises (a full disk), whatever it held before; the
    temporary file is removed either way, so a failed write leaves nothing behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AsyncWriter:
    """Writes `step-NNNNNN.p2ck` files in a background thread, keeping the newest `keep`.

    One write runs at a time; if training commits faster than the disk writes, only the
    newest waiting snapshot is written (an older one would be deleted right after anyway).
    `on_written(step, seconds, path)` is called from the writer thread, and so is
    `on_failed(step, reason, resume_from)` when a write fails (a full disk): training goes on,
    but a restart resumes from `resume_from`, the newest step still on disk (None: none is).
    The files already written are kept as they are.
    """

    def __init__(self, directory: Path, keep: int = 3, on_written=None, on_failed=None) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.dir = Path(directory)
        self.keep = keep
        self.on_written = on_written
        self.on_failed = on_failed
        self._cond = threading.Condition()
        self._waiting: tuple[int, bytes] | None = None
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="checkpoint-writer", daemon=True)
        self._remove_stale_tmp()
        self._thread.start()

    def _remove_stale_tmp(self) -> None:
        for tmp in self.dir.glob(".step-*.p2ck.tmp.*"):
            log.info("removing %s, a write interrupted by a crash", tmp)
            tmp.unlink(missing_ok=True)

    def path(self, step: int) -> Path:
        return self.dir / f"step-{step:06d}.p2ck"

    def submit(self, step: int, data: bytes) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("checkpoint writer is closed")
            self._waiting = (step, data)
            self._cond.notify_all()

    def flush(self, timeout: float = 120.0) -> bool:
        """Wait until everything submitted is on disk; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._waiting is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 120.0) -> bool:
        ok = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return ok

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._waiting is None:
                    return
                (step, data), self._waiting = self._waiting, None
                self._busy = True
            try:
                t0 = time.perf_counter()
                self._write(step, data)
                for old in sorted(self.dir.glob("step-*.p2ck"))[:-self.keep]:
                    old.unlink(missing_ok=True)
                if self.on_written is not None:
                    self.on_written(step, time.perf_counter() - t0, str(self.path(step)))
            except Exception as exc:
                self._failed(step, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _failed(self, step: int, exc: Exception) -> None:
        reason = f"{exc.strerror} ({exc.filename})" if isinstance(exc, OSError) and exc.strerror else repr(exc)
        try:
            on_disk = sorted(self.dir.glob("step-*.p2ck"))
            resume_from = int(on_disk[-1].stem.split("-")[1]) if on_disk else None
        except (OSError, ValueError):
            resume_from = None
        after = (f"a restart resumes from step {resume_from}" if resume_from is not None else
                 "a restart cannot resume from this disk: no checkpoint is on it")
        log.warning("checkpoint for step %d not written: %s; training goes on, but %s", step, reason, after)
        if self.on_failed is not None:
            try:
                self.on_failed(step, reason, resume_from)
            except Exception:
                log.exception("checkpoint failure listener failed")

    def _write(self, step: int, data: bytes) -> None:
        """One step's file (in the writer thread); tests subclass this to stall midway."""
        write_atomic(self.path(step), data)


def outer_state_arrays(params: np.ndarray, momentum: np.ndarray) -> dict[str, np.ndarray]:
    return {"params": np.asarray(params, np.float32), "momentum": np.asarray(momentum, np.float32)}
