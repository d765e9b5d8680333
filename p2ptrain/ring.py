"""The ring all-reduce data plane: reduce-scatter then all-gather, pipelined, int8 or fp32.

Synchronous on purpose: a round runs in one worker thread (`trio.to_thread`) plus a sender
and a receiver thread, so the bytes never pass through the trio scheduler. The numba kernels
and AES-GCM both release the GIL, so quantizing sub-chunk i+1 overlaps sealing/sending i.

Schedule for world W, rank r (ring order is the caller's), tensor split into W chunks, each
into k sub-chunks on super-block boundaries:
  reduce-scatter step s = 0..W-2: send chunk (r-s) mod W, receive chunk (r-s-1) mod W.
    What arrives is the running sum of s+1 peers; the hop kernel adds ours (fp32) and
    re-quantizes what goes out at step s+1. At s = W-2 we own chunk (r+1) mod W: the owner
    hop quantizes the mean ONCE and writes its dequantized value into our result, so the
    owner ends with exactly what everyone else decodes.
  all-gather step s = 0..W-2: send chunk (r+1-s) mod W, receive chunk (r-s) mod W, decode
    it into the result and forward the received bytes unchanged.
Every peer therefore decodes the same bytes for every chunk: bit-identical results.

Nothing here touches the caller's tensor: the result is a new array, handed back only when
every frame arrived and verified. Whether to apply it is the commit protocol's decision.
"""

from __future__ import annotations

import functools
import hashlib
import queue
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from p2ptrain import kernels as K


class RingError(Exception):
    """The data plane failed (peer gone, timeout, too many bad frames); nothing was changed.

    `blame` names a member caught sending bad data (by the caller's frame check)."""

    def __init__(self, message: str, blame: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.blame = blame
        self.reason = reason


@dataclass(frozen=True)
class FrameId:
    step: int
    """0..W-2 reduce-scatter, W-1..2W-3 all-gather."""
    chunk: int
    """chunk index * k + sub-chunk index."""


class Channel(Protocol):
    """One direction of an authenticated, encrypted frame pipe (see p2ptrain/bulk.py)."""

    def send(self, fid: FrameId, payload: memoryview) -> None: ...

    def recv(self, fid: FrameId, out: memoryview) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RingConfig:
    mode: str = "int8"
    """'int8' (quantized wire, fp32 accumulation) or 'fp32' (exact, 4x the bytes)."""
    block: int = K.DEFAULT_BLOCK
    """Quantization sub-block size (see p2ptrain.kernels)."""
    sub_chunk_bytes: int = 1 << 20
    """Target fp32 bytes per pipelined sub-chunk (one frame)."""
    kernel_threads: int = 1
    """numba threads per kernel call. One is right: the ring already overlaps compute with
    two I/O threads, a serial kernel outruns any internet link, and parallel regions stall
    badly when cores are oversubscribed (measured: 4 ring peers on 2 cores ran ~5x slower)."""

    def __post_init__(self) -> None:
        if self.mode not in ("int8", "fp32"):
            raise ValueError("mode must be 'int8' or 'fp32'")
        if self.sub_chunk_bytes < 4096:
            raise ValueError("sub_chunk_bytes must be >= 4096")


def layout(n: int, world: int, cfg: RingConfig) -> list[list[tuple[int, int]]]:
    """[chunk][sub] -> (start, end) element ranges; identical on every member."""
    bounds = K.split_bounds(n, world, cfg.block)
    out = []
    for c in range(world):
        lo, hi = bounds[c], bounds[c + 1]
        k = max(1, -(-(hi - lo) * 4 // cfg.sub_chunk_bytes))
        sub = K.split_bounds(hi - lo, k, cfg.block)
        out.append([(lo + sub[j], lo + sub[j + 1]) for j in range(k)])
    return out


def wire_bytes(n_elems: int, cfg: RingConfig) -> int:
    return n_elems * 4 if cfg.mode == "fp32" else K.quantized_nbytes(n_elems, cfg.block)


def payload_views(m: int, cfg: RingConfig) -> tuple[bytearray, np.ndarray, np.ndarray | None]:
    """A fresh frame payload and the array views kernels write into (no copies)."""
    buf = bytearray(wire_bytes(m, cfg))
    if cfg.mode == "fp32":
        return buf, np.frombuffer(buf, np.float32), None
    return buf, np.frombuffer(buf, np.int8, count=m), np.frombuffer(buf, np.uint8, offset=m)


def encode_payload(x: np.ndarray, cfg: RingConfig) -> bytearray:
    buf, a, meta = payload_views(x.size, cfg)
    if cfg.mode == "fp32":
        a[:] = x
    else:
        K.quantize(x, cfg.block, q=a, meta=meta)
    return buf


def own_payloads(vec: np.ndarray, rank: int, world: int, cfg: RingConfig) -> list[bytearray]:
    """This rank's step-0 frames: its own chunk, encoded sub-chunk by sub-chunk."""
    vec = np.ascontiguousarray(vec, dtype=np.float32).ravel()
    return [encode_payload(vec[lo:hi], cfg) for lo, hi in layout(vec.size, world, cfg)[rank]]


def schedule(rank: int, world: int, lay: list[list[tuple[int, int]]]):
    """(sends, recvs): ordered lists of (FrameId, chunk, sub) for this rank."""
    sends, recvs = [], []
    for s in range(world - 1):
        c_send, c_recv = (rank - s) % world, (rank - s - 1) % world
        sends += [(FrameId(s, c_send * 1000 + j), c_send, j) for j in range(len(lay[c_send]))]
        recvs += [(FrameId(s, c_recv * 1000 + j), c_recv, j) for j in range(len(lay[c_recv]))]
    for s in range(world - 1):
        c_send, c_recv = (rank + 1 - s) % world, (rank - s) % world
        step = world - 1 + s
        sends += [(FrameId(step, c_send * 1000 + j), c_send, j) for j in range(len(lay[c_send]))]
        recvs += [(FrameId(step, c_recv * 1000 + j), c_recv, j) for j in range(len(lay[c_recv]))]
    return sends, recvs


class _Pump(threading.Thread):
    """Moves frames between a channel and a queue so the compute thread never blocks on the
    network: a ring whose members all block in send() while nobody reads deadlocks."""

    def __init__(self, name: str, fn) -> None:
        super().__init__(daemon=True, name=name)
        self.fn = fn
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # reported to the compute thread
            self.error = exc


def allreduce(vec: np.ndarray, rank: int, world: int, send_ch: Channel | None, recv_ch: Channel | None,
              cfg: RingConfig, timeout: float = 30.0, own: list[bytearray] | None = None,
              check=None) -> tuple[np.ndarray, int, str]:
    """Mean of every member's `vec` as a new array, the payload bytes this rank sent, and
    the result's digest.

    The digest is SHA-256 over the SHA-256 of every final sub-chunk payload in (chunk, sub)
    order. Every member decodes its result from exactly those bytes, so equal digests mean
    equal results; hashing them as they arrive keeps the commit vote off the critical path
    (hashing the 64 MiB fp32 result afterwards cost ~12 % of a round).

    `own`: this rank's step-0 payloads (its own chunk, already encoded, e.g. so their digests
    could be signed first). `check(step, chunk, sub, payload, values)`: called on every
    received frame with the fp32 values it decodes to, before anything is mixed in; an
    exception with a `peer` attribute aborts the round blaming that peer.

    Raises RingError on any failure (including no frame for `timeout` seconds); `vec` is
    never modified."""
    vec = np.ascontiguousarray(vec, dtype=np.float32).ravel()
    if world == 1:
        return vec.copy(), 0, hashlib.sha256(vec.data).hexdigest()
    _set_kernel_threads(cfg.kernel_threads)
    lay = layout(vec.size, world, cfg)
    sends, recvs = schedule(rank, world, lay)
    result = np.empty_like(vec)
    inv = np.float32(1.0 / world)
    outq: "queue.Queue" = queue.Queue()
    inq: "queue.Queue" = queue.Queue()
    stop = threading.Event()

    def send_loop() -> None:
        while not stop.is_set():
            item = outq.get()
            if item is None:
                return
            send_ch.send(*item)

    def recv_loop() -> None:
        for fid, c, j in recvs:
            lo, hi = lay[c][j]
            buf = bytearray(wire_bytes(hi - lo, cfg))
            got = recv_ch.recv(fid, memoryview(buf))
            if got != len(buf):
                raise RingError(f"frame {fid} has {got} bytes, expected {len(buf)}")
            inq.put(buf)
            if stop.is_set():
                return

    sender, receiver = _Pump("ring-send", send_loop), _Pump("ring-recv", recv_loop)
    pending: dict[tuple[int, int], bytearray] = {}  # (chunk, sub) -> payload to send next
    final: dict[tuple[int, int], bytes] = {}  # (chunk, sub) -> sha256 of its final payload
    si = 0
    sent = 0

    views = functools.partial(payload_views, cfg=cfg)
    encode = functools.partial(encode_payload, cfg=cfg)

    def split(buf: bytearray, m: int) -> tuple[np.ndarray, np.ndarray]:
        return np.frombuffer(buf, np.int8, count=m), np.frombuffer(buf, np.uint8, offset=m)

    def flush() -> None:
        """Queue every send whose payload exists, in schedule order."""
        nonlocal si, sent
        while si < len(sends):
            fid, c, j = sends[si]
            if fid.step == 0:
                lo, hi = lay[c][j]
                payload = own[j] if own is not None else encode(vec[lo:hi])
            elif (c, j) in pending:
                payload = pending.pop((c, j))
            else:
                return
            outq.put((fid, memoryview(payload)))
            sent += len(payload)
            si += 1

    try:
        sender.start()
        receiver.start()
        flush()
        for fid, c, j in recvs:
            buf = _get(inq, timeout, receiver, sender)
            lo, hi = lay[c][j]
            m, local = hi - lo, vec[lo:hi]
            if check is not None:
                if cfg.mode == "fp32":
                    values = np.frombuffer(buf, np.float32)
                else:
                    values = K.dequantize(*split(buf, m), cfg.block)
                try:
                    check(fid.step, c, j, buf, values)
                except Exception as exc:
                    if getattr(exc, "peer", None):
                        raise RingError(f"bad frame: {exc}", blame=exc.peer, reason=getattr(exc, "reason", "")) from exc
                    raise
            if fid.step < world - 2:  # a middle hop: add ours, pass the sum on
                out, a, meta = views(m)
                if cfg.mode == "fp32":
                    np.add(np.frombuffer(buf, np.float32), local, out=a)
                else:
                    K.ring_hop(*split(buf, m), local, cfg.block, q_out=a, meta_out=meta)
                pending[(c, j)] = out
            elif fid.step == world - 2:  # we own this chunk: the mean, quantized once
                out, a, meta = views(m)
                if cfg.mode == "fp32":
                    np.multiply(np.frombuffer(buf, np.float32) + local, inv, out=a)
                    result[lo:hi] = a
                else:
                    K.owner_hop(*split(buf, m), local, float(inv), cfg.block, q_out=a, meta_out=meta,
                                out=result[lo:hi])
                pending[(c, j)] = out
                final[(c, j)] = hashlib.sha256(out).digest()
            else:  # all-gather: decode, forward the very same bytes
                if cfg.mode == "fp32":
                    result[lo:hi] = np.frombuffer(buf, np.float32)
                else:
                    K.dequantize(*split(buf, m), cfg.block, out=result[lo:hi])
                final[(c, j)] = hashlib.sha256(buf).digest()
                if fid.step < 2 * world - 3:
                    pending[(c, j)] = buf
            flush()
        if si != len(sends):
            raise RingError(f"schedule incomplete: {len(sends) - si} frames never sent")
        outq.put(None)
        sender.join(timeout)
        if sender.is_alive() or sender.error is not None:
            raise RingError(f"send failed: {sender.error or 'timeout'}")
    except RingError:
        raise
    except Exception as exc:
        raise RingError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        stop.set()
        outq.put(None)
    digest = hashlib.sha256(b"".join(final[k] for k in sorted(final))).hexdigest()
    if len(final) != sum(len(subs) for subs in lay):
        raise RingError("result incomplete")
    return result, sent, digest


def _get(inq: "queue.Queue", timeout: float, receiver: _Pump, sender: _Pump) -> bytearray:
    """Next received frame; fails fast when either pump died, and after `timeout` idle seconds."""
    waited = 0.0
    while True:
        try:
            return inq.get(timeout=0.2)
        except queue.Empty:
            waited += 0.2
        for pump in (receiver, sender):
            if pump.error is not None:
                err = pump.error
                raise RingError(f"{pump.name}: {err}") from err
        if waited >= timeout:
            raise RingError(f"no frame for {timeout:.0f}s")


def _set_kernel_threads(n: int) -> None:
    """numba's thread count is per calling thread, so this affects only this round."""
    if K.BACKEND == "numba":
        import numba

        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
