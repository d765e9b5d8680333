"""The ring all-reduce data plane: reduce-scatter then all-gather, pipelined, int8 or fp32.

Synchronous on purpose: a round runs in one worker thread (`trio.to_thread`), which also
receives, plus a sender thread, so the bytes never pass through the trio scheduler. The numba
kernels and AES-GCM both release the GIL, so quantizing sub-chunk i+1 overlaps sealing/sending i.

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

import hashlib
import queue
import threading
import time

import numpy as np
from blake3 import blake3

from p2ptrain import kernels as K
from p2ptrain.reduce import roundtrace
from p2ptrain.reduce.arena import ArenaPool
from p2ptrain.reduce.schedule import (  # noqa: F401  (re-exported: the ring's public names)
    Channel,
    FrameId,
    RingConfig,
    RingError,
    encode_payload,
    frame_tag,
    layout,
    own_payloads,
    payload_views,
    schedule,
    wire_bytes,
)


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


class _Sender(threading.Thread):
    """Seals and sends queued frames in order, so the compute thread never blocks on send:
    a ring whose members all block in send() while nobody reads deadlocks. On failure it
    closes the receive channel too, which wakes the compute thread out of recv()."""

    def __init__(self, ch: Channel, recv_ch: Channel) -> None:
        super().__init__(daemon=True, name="ring-send")
        self.ch, self.recv_ch = ch, recv_ch
        self.q: "queue.Queue" = queue.Queue()
        self.error: BaseException | None = None

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is not None:
                continue
            try:
                t0 = roundtrace.now()
                self.ch.send(*item)
                roundtrace.mark("send", t0=t0, step=item[0].step)
            except BaseException as exc:  # reported to the compute thread
                self.error = exc
                self.recv_ch.close()


READ_AHEAD_BYTES = 64 << 20
"""At most this many received bytes wait for their turn in one round (a 1 Gbit/s link
carries ~6 MiB in the 0.05 s a header may take; a predecessor's own chunk is 1/W of the
payload)."""
PULL_WAIT_S = 0.0005  # how often read-ahead takes what has come (~60 KiB at 1 Gbit/s)


def _split(buf, m: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.frombuffer(buf, np.uint8)
    return a[:m].view(np.int8), a[m:]


def allreduce(vec: np.ndarray, rank: int, world: int, send_ch: Channel | None, recv_ch: Channel | None,
              cfg: RingConfig, timeout: float = 30.0, own: list[bytearray] | None = None,
              check=None, out: np.ndarray | None = None,
              pool: ArenaPool | None = None, on_own=None) -> tuple[np.ndarray, int, str]:
    """Mean of every member's `vec` as a new array (or in `out`, which then holds garbage
    if the round fails), the payload bytes this rank sent, and the result's digest.

    The digest is BLAKE3 over the BLAKE3 of every final sub-chunk payload in (chunk, sub)
    order. Every member decodes its result from exactly those bytes, so equal digests mean
    equal results; hashing each one right after it is forwarded keeps the digest off the
    critical path (hashing the 64 MiB fp32 result afterwards cost ~12 % of a round). It must
    be collision-resistant: it is how honest members catch a forwarder that changed bytes
    (each hop's AES-GCM tag cannot, every member holds a key). BLAKE3 rather than SHA-256:
    2.85 against 1.54 GB/s on one core here, ~6 % of a member's CPU per 64 MiB round.

    `own`: this rank's step-0 payloads (its own chunk, already encoded, e.g. so their digests
    could be signed first). Without it the round encodes them itself and hands each one to
    `on_own(j, payload)` as soon as it is queued (then `on_own(-1, None)` when the round
    ends, however), so they can be hashed and signed beside the data plane: the view stays
    unchanged while the round runs. `check(step, chunk, sub, payload, sq)`: called on every
    received frame, before anything is mixed in or decoded into the result, with `sq` the
    float64 sum of squares of the values it decodes to (int8 frames: `kernels.sumsq_q8` of
    the payload, no decode: a decode and a sum per frame cost more CPU than the hop itself);
    an exception with a `peer` attribute aborts the round blaming that peer. It must not keep
    or write `payload` (the buffer is reused). A check with
    a `pending()` method that returns True is waiting for something (`HeldChecker`): the
    round meanwhile reads its predecessor's step-0 frames ahead. `pool` lends the wire buffers (see ArenaPool).

    Like the raw-socket ceiling (p2ptrain/bench/raw_ring.py), this thread receives straight
    into preallocated buffers and only sending has its own thread: no receive pump, no
    per-frame allocation.

    Raises RingError on any failure (including no frame for `timeout` seconds, which the
    channels enforce per operation); `vec` is never modified."""
    vec = np.ascontiguousarray(vec, dtype=np.float32).ravel()
    if out is not None and (out.dtype != np.float32 or out.shape != vec.shape or not out.flags.c_contiguous
                            or np.shares_memory(out, vec)):
        raise ValueError("out must be a C-contiguous float32 array shaped like vec, not sharing its memory")
    if world == 1:
        if on_own is not None:
            on_own(-1, None)
        return vec.copy(), 0, hashlib.sha256(vec.data).hexdigest()
    _set_kernel_threads(cfg.kernel_threads)
    return _RingRound(vec, rank, world, send_ch, recv_ch, cfg, own, check, out, pool or ArenaPool(0),
                      on_own).run(timeout)


class _RingRound:
    """One member's run of the schedule (`schedule.schedule`) in the calling thread."""

    def __init__(self, vec, rank, world, send_ch, recv_ch, cfg: RingConfig, own, check, out, pool: ArenaPool,
                 on_own=None) -> None:
        self.vec, self.world, self.recv_ch, self.cfg, self.own, self.check = vec, world, recv_ch, cfg, own, check
        self.on_own = on_own
        self.lay = layout(vec.size, world, cfg)
        self.sends, self.recvs = schedule(rank, world, self.lay)
        self.fp32 = cfg.mode == "fp32"
        self.result = np.empty_like(vec) if out is None else out
        self.inv = np.float32(1.0 / world)
        # Reduce-scatter payloads we send (each (chunk, sub) is sent once) and, in int8 mode, the
        # owners' final payloads that the all-gather receives and forwards. fp32 all-gather
        # frames land straight in `result`.
        self.pool, self.key = pool, (vec.size, world, cfg.mode, cfg.block, cfg.sub_chunk_bytes)
        self.rs = pool.take(self.key, self.lay, cfg)
        self.fin = None if self.fp32 else pool.take(self.key, self.lay, cfg)
        self.scratch = np.empty(max(nb for _, nb, _ in self.rs.at.values()), np.uint8)
        self.sender = _Sender(send_ch, recv_ch)
        # Frames received before their turn (`read_ahead`): recv index -> (buffer, spare).
        self.ahead: dict[int, tuple[memoryview, np.ndarray | None]] = {}
        self.spares: list[np.ndarray] = []
        self.ahead_bytes = 0
        self.ready: dict[tuple[int, int], memoryview] = {}  # (chunk, sub) -> payload to send next
        self.final: dict[tuple[int, int], bytes] = {}  # (chunk, sub) -> BLAKE3 of its final payload
        self.si = self.sent = 0
        self.receiving = False  # the receive loop has begun (frames taken early start at 0)

    def run(self, timeout: float) -> tuple[np.ndarray, int, str]:
        sender, self.timeout = self.sender, timeout
        try:
            sender.start()
            self.flush()
            self.receiving = True
            for i, (fid, c, j) in enumerate(self.recvs):
                buf, spare = self.ahead.pop(i) if i in self.ahead else self.receive(fid, c, j)
                self.read_ahead(i + 1)
                self.step(fid, c, j, self.checked(fid, c, j, buf))
                if spare is not None:  # step is done with it (only all-gather frames are kept)
                    self.spares.append(spare)
                    self.ahead_bytes -= len(buf)
            if self.si != len(self.sends):
                raise RingError(f"schedule incomplete: {len(self.sends) - self.si} frames never sent")
            sender.q.put(None)
            sender.join(timeout)
            if sender.is_alive() or sender.error is not None:
                raise RingError(f"send failed: {sender.error or 'timeout'}")
        except RingError as exc:
            # A blamed sender stays blamed: our own send may have failed meanwhile (a peer that
            # trickles its frames may not read ours either).
            if sender.error is not None and "send failed" not in str(exc) and exc.blame is None:
                raise RingError(f"send failed: {sender.error}") from exc
            raise
        except Exception as exc:
            raise RingError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            if self.on_own is not None:
                self.on_own(-1, None)  # no more: a waiter for a frame never encoded stops waiting
            sender.error = sender.error or RingError("round over")  # drops anything still queued
            sender.q.put(None)
            if not sender.is_alive():  # else it may still read them: let them go
                self.pool.give(self.key, self.rs)
                self.pool.give(self.key, self.fin)
        final = self.final
        if len(final) != sum(len(subs) for subs in self.lay):
            raise RingError("result incomplete")
        return self.result, self.sent, blake3(b"".join(final[k] for k in sorted(final))).hexdigest()

    def flush(self) -> None:
        """Queue every send whose payload exists, in schedule order."""
        cfg, rs = self.cfg, self.rs
        while self.si < len(self.sends):
            fid, c, j = self.sends[self.si]
            if fid.step == 0:
                lo, hi = self.lay[c][j]
                if self.own is not None:
                    payload = memoryview(self.own[j])
                elif self.fp32:
                    payload = memoryview(self.vec[lo:hi]).cast("B")
                else:
                    q, meta = rs.parts(c, j)
                    K.quantize(self.vec[lo:hi], cfg.block, q=q, meta=meta)
                    payload = rs.view(c, j)
                if self.on_own is not None and self.own is None:
                    self.on_own(j, payload)  # written once: it stays as sent until the round ends
            elif (c, j) in self.ready:
                payload = self.ready.pop((c, j))
            else:
                return
            self.sender.q.put((fid, payload))
            self.sent += len(payload)
            self.si += 1
            if fid.step == 0 and not self.receiving:  # encoding a big own chunk takes long: take
                self.take_arrived(0)  # what arrived meanwhile, so our predecessor's link goes on

    def receive(self, fid: FrameId, c: int, j: int, ahead: bool = False,
                pull=None) -> tuple[memoryview, np.ndarray | None] | None:
        """The frame, straight into its buffer, and the spare buffer it took if any: a
        reduce-scatter frame read `ahead` cannot use the one shared scratch buffer. With
        `pull` (the channel's read without blocking): None while the frame is not all in."""
        lo, hi = self.lay[c][j]
        m, spare = hi - lo, None
        if fid.step < self.world - 1:
            if ahead:
                spare = self.spares.pop() if self.spares else np.empty(self.scratch.size, np.uint8)
            buf = memoryview((self.scratch if spare is None else spare)[:wire_bytes(m, self.cfg)])
        elif self.fp32:
            buf = memoryview(self.result[lo:hi]).cast("B")
        else:
            buf = self.fin.view(c, j)
        got = (pull or self.recv_ch.recv)(fid, buf)
        if got is None:
            self.spares.append(spare)
            return None
        roundtrace.mark("recv", step=fid.step)
        if got != len(buf):
            raise RingError(f"frame {fid} has {got} bytes, expected {len(buf)}")
        return buf, spare

    def take_arrived(self, i: int) -> bool:
        """Take our predecessor's step-0 frames from index `i` on into spare buffers as far
        as their bytes are in, without waiting (`pull`), up to READ_AHEAD_BYTES. A receiver
        that leaves bytes unread slows its sender (TCP's receive window: `p2ptrain bench
        readpause`, 7 ms a round at 1 Gbit/s for a 20 ms pause). Step-0 frames only: our
        predecessor sends its own chunk unconditionally, while any later frame may depend on
        our own progress. True when the next frame is not all in yet (a caller may wait)."""
        pull = self.recv_ch.pull if getattr(self.recv_ch, "pulls", False) else None
        while (pull is not None and i + len(self.ahead) < len(self.recvs)
               and self.recvs[i + len(self.ahead)][0].step == 0 and self.ahead_bytes < READ_AHEAD_BYTES):
            k = i + len(self.ahead)
            got = self.receive(*self.recvs[k], ahead=True, pull=pull)
            if got is None:
                return True
            self.ahead[k] = got
            self.ahead_bytes += len(got[0])
        return False

    def read_ahead(self, i: int) -> None:
        """While the frame check is held (the members' signed headers are not in yet), keep
        taking frames as they arrive (`take_arrived`), so the header wait does not land on
        the round: and as bytes come, not frame by frame, so the headers' arrival releases
        the checks at once (a blocking read begun just before held them back by up to a
        frame's time on the wire). Bounded by the frame timeout, after which the check's own
        timeout or the blocking read's ends the round. A channel that cannot read without
        blocking reads the next step-0 frames ahead in turn."""
        pending = getattr(self.check, "pending", None)
        if pending is None:
            return
        while (not getattr(self.recv_ch, "pulls", False) and pending() and (k := i + len(self.ahead)) < len(self.recvs)
               and self.recvs[k][0].step == 0 and self.ahead_bytes < READ_AHEAD_BYTES):
            self.ahead[k] = self.receive(*self.recvs[k], ahead=True)
            self.ahead_bytes += len(self.ahead[k][0])
        until, have = time.monotonic() + self.timeout, len(self.ahead)
        while pending() and self.take_arrived(i) and time.monotonic() < until:
            if len(self.ahead) > have:  # progress: the bound is per frame
                until, have = time.monotonic() + self.timeout, len(self.ahead)
            getattr(self.check, "wait", time.sleep)(PULL_WAIT_S)

    def checked(self, fid: FrameId, c: int, j: int, buf: memoryview) -> memoryview:
        """`buf`, held to the caller's check before anything is mixed in."""
        if self.check is not None:
            lo, hi = self.lay[c][j]
            if self.fp32:
                sq = K.sumsq(np.frombuffer(buf, np.float32))
            else:
                sq = K.sumsq_q8(*_split(buf, hi - lo), self.cfg.block)
            try:
                self.check(fid.step, c, j, buf, sq)
            except Exception as exc:
                if getattr(exc, "peer", None):
                    raise RingError(f"bad frame: {exc}", blame=exc.peer, reason=getattr(exc, "reason", "")) from exc
                raise
            if fid.step == 0:
                roundtrace.mark("check")
        return buf

    def step(self, fid: FrameId, c: int, j: int, buf: memoryview) -> None:
        lo, hi = self.lay[c][j]
        m, local, world, block = hi - lo, self.vec[lo:hi], self.world, self.cfg.block
        if fid.step < world - 2:  # a middle hop: add ours, pass the sum on
            if self.fp32:
                np.add(np.frombuffer(buf, np.float32), local, out=self.rs.parts(c, j)[0])
            else:
                q, meta = self.rs.parts(c, j)
                K.ring_hop(*_split(buf, m), local, block, q_out=q, meta_out=meta)
            self.ready[(c, j)] = self.rs.view(c, j)
            self.flush()
        elif fid.step == world - 2:  # we own this chunk: the mean, quantized once
            if self.fp32:
                out = self.result[lo:hi]
                np.add(np.frombuffer(buf, np.float32), local, out=out)
                np.multiply(out, self.inv, out=out)
                payload = memoryview(out).cast("B")
            else:
                q, meta = self.fin.parts(c, j)
                K.owner_hop(*_split(buf, m), local, float(self.inv), block, q_out=q, meta_out=meta,
                            out=self.result[lo:hi])
                payload = self.fin.view(c, j)
            self.ready[(c, j)] = payload
            self.flush()
            self.final[(c, j)] = blake3(payload).digest()
        else:  # all-gather: forward the very same bytes first, then decode
            if fid.step < 2 * world - 3:
                self.ready[(c, j)] = buf
                self.flush()
            if not self.fp32:
                K.dequantize(*_split(buf, m), block, out=self.result[lo:hi])
            self.final[(c, j)] = blake3(buf).digest()


def _set_kernel_threads(n: int) -> None:
    """numba's thread count is per calling thread, so this affects only this round."""
    if K.BACKEND == "numba":
        import numba

        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
