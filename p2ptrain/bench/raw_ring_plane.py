"""The raw-socket ring's data plane (bench only): sealed frames over blocking TCP sockets
(`Link`), a sender thread (`Sender`), the int8 / fp32 ring schedule (`Ring`) and the socket
helpers the peer processes use. `p2ptrain.bench.raw_ring` runs it in processes and measures.
"""

from __future__ import annotations

import ipaddress
import os
import queue
import socket
import struct
import sys
import threading
from typing import List, Optional

import numpy as np

MIB = 1 << 20
SOCK_BUF = 4 * MIB
TAG = 16  # AEAD tag bytes
HELLO = struct.Struct("<8sI")
MAGIC = b"p2ptring"
CIPHERS = ("aesgcm", "chacha", "none")
MODES = ("int8", "fp32")


class BenchError(RuntimeError):
    """A failure to report as one line."""


def gaussian(seed: int, rank: int, n: int) -> np.ndarray:
    """The benchmark vector of peer ``rank`` (same generator as the hivemind baseline)."""
    return np.random.default_rng([seed, rank]).standard_normal(n, dtype=np.float32)


def _is_loopback(ip: str) -> bool:
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _check_loopback(sock: socket.socket, what: str) -> None:
    local = sock.getsockname()[0]
    try:
        remote = sock.getpeername()[0]
    except OSError:
        remote = None  # a listener
    if not _is_loopback(local) or (remote is not None and not _is_loopback(remote)):
        raise BenchError(f"{what} socket is not loopback-only: {local} -> {remote}")


def _vm_hwm_mib() -> Optional[float]:
    """Peak resident set of this process (VmHWM; unlike ru_maxrss it is not inherited across exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _aead(cipher: str, key: bytes):
    if cipher == "none":
        return None
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

    return AESGCM(key) if cipher == "aesgcm" else ChaCha20Poly1305(key)


_NONCE = struct.Struct("<4xQ")  # 12 bytes: 4 zero bytes, 64-bit little-endian frame counter


def _recv_exact(sock: socket.socket, mv: memoryview) -> None:
    got, n = 0, len(mv)
    while got < n:
        k = sock.recv_into(mv[got:], n - got)
        if k == 0:
            raise BenchError("ring neighbour closed the connection")
        got += k


class Link:
    """One direction of a ring link: frames sealed with a fixed key and a counter nonce."""

    def __init__(self, sock: socket.socket, cipher: str, key: bytes, max_frame: int):
        self.sock, self.aead = sock, _aead(cipher, key)
        self.ctr = 0
        self.buf = bytearray(max_frame + TAG) if self.aead is not None else None
        self.mv = memoryview(self.buf) if self.buf is not None else None

    def send(self, data: memoryview) -> None:
        if self.aead is None:
            self.sock.sendall(data)
            return
        ct = self.mv[: len(data) + TAG]
        self.aead.encrypt_into(_NONCE.pack(self.ctr), data, None, ct)
        self.ctr += 1
        self.sock.sendall(ct)

    def recv_into(self, target: memoryview) -> None:
        if self.aead is None:
            _recv_exact(self.sock, target)
            return
        ct = self.mv[: len(target) + TAG]
        _recv_exact(self.sock, ct)
        self.aead.decrypt_into(_NONCE.pack(self.ctr), ct, None, target)  # raises InvalidTag
        self.ctr += 1


class Sender(threading.Thread):
    """Seals and sends queued frames in order; ``flush()`` waits until the queue is drained."""

    def __init__(self, link: Link, on_error):
        super().__init__(daemon=True, name="ring-sender")
        self.link, self.on_error = link, on_error
        self.q: "queue.Queue[Optional[memoryview]]" = queue.Queue()
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    self.link.send(item)
            except BaseException as e:  # noqa: BLE001  reported by the main thread
                self.error = e
                self.on_error()
            finally:
                self.q.task_done()

    def put(self, mv: memoryview) -> None:
        self.q.put(mv)

    def flush(self) -> None:
        self.q.join()
        if self.error is not None:
            raise BenchError(f"sender failed: {type(self.error).__name__}: {self.error}")


def _frames(a: int, b: int, frame_values: int) -> List[tuple]:
    """Split [a, b) into frames of frame_values (a multiple of the kernels' super-block)."""
    return [(s, min(b, s + frame_values)) for s in range(a, b, frame_values)] or [(a, a)]


class Ring:
    """Buffers and the per-round schedule of one peer."""

    def __init__(self, rank: int, peers: int, x: np.ndarray, mode: str, block: int, frame_bytes: int):
        self.rank, self.N, self.x, self.mode, self.block = rank, peers, x, mode, block
        n = x.size
        self.result = np.empty(n, np.float32)
        self.mul = np.float32(1.0 / peers)
        if mode == "int8":
            import p2ptrain.kernels as K

            self.K = K
            block = self.block = K.DEFAULT_BLOCK if block is None else block
            sup = K.SUBS_PER_SUPER * block
            self.bounds = K.split_bounds(n, peers, block)
            fv = max(sup, (frame_bytes // sup) * sup)
        else:
            self.K = None
            self.bounds = [(i * n) // peers for i in range(peers + 1)]
            fv = max(1024, frame_bytes // 4)
        self.frames = [_frames(self.bounds[c], self.bounds[c + 1], fv) for c in range(peers)]
        if mode == "int8":
            # wire layout of chunk c: frame after frame, each [int8 q | uint8 meta]
            self.layout = []
            for c in range(peers):
                lay, off = [], 0
                for fa, fb in self.frames[c]:
                    nq = fb - fa
                    nm = K.meta_nbytes(nq, block)
                    lay.append((fa, fb, off, nq, nm))
                    off += nq + nm
                self.layout.append((lay, off))
            self.max_frame = max(nq + nm for lay, _ in self.layout for (_, _, _, nq, nm) in lay)
            # reduce-scatter send buffers (step s sends chunk r-1-s) and all-gather buffers per chunk
            self.rs = [self._wire(c) for c in self._rs_chunks()]
            self.ag = {c: self._wire(c) for c in range(peers)}
            self.rbuf = np.empty(self.max_frame, np.uint8)
        else:
            self.max_frame = 4 * max(fb - fa for fr in self.frames for fa, fb in fr)
            # step 0 sends the local slice itself, so only steps 1 .. N-2 need a send buffer
            self.rs = [None] + [np.empty(self.bounds[c + 1] - self.bounds[c], np.float32)
                                for c in self._rs_chunks()[1:]]
            self.rbuf = np.empty(self.max_frame // 4, np.float32)

    def _rs_chunks(self) -> List[int]:
        return [(self.rank - 1 - s) % self.N for s in range(self.N - 1)]

    def _wire(self, c: int) -> List[tuple]:
        """A wire buffer for chunk c as per-frame (x-range, q view, meta view, bytes view)."""
        lay, total = self.layout[c]
        buf = np.zeros(total, np.uint8)
        views = []
        for fa, fb, off, nq, nm in lay:
            q = buf[off : off + nq].view(np.int8)
            meta = buf[off + nq : off + nq + nm]
            views.append((fa, fb, q, meta, memoryview(buf[off : off + nq + nm])))
        return views

    # -- one all-reduce round -------------------------------------------------------------------

    def round(self, send: Sender, link_in: Link) -> None:
        if self.mode == "int8":
            self._round_int8(send, link_in)
        else:
            self._round_fp32(send, link_in)

    def _round_int8(self, send: Sender, link_in: Link) -> None:
        K, N, r, x, blk = self.K, self.N, self.rank, self.x, self.block
        # reduce-scatter hop 0: quantize own slice of chunk r-1 and stream it out
        for fa, fb, q, meta, mv in self.rs[0]:
            K.quantize(x[fa:fb], blk, q, meta)
            send.put(mv)
        rq_all = self.rbuf
        for s in range(N - 1):
            c = (r - 2 - s) % N
            lay, _ = self.layout[c]
            owner = s == N - 2
            out_views = self.ag[r] if owner else self.rs[s + 1]
            for (fa, fb, _, nq, nm), (_, _, q_out, m_out, mv_out) in zip(lay, out_views):
                link_in.recv_into(memoryview(rq_all[: nq + nm]))
                q_in, m_in = rq_all[:nq].view(np.int8), rq_all[nq : nq + nm]
                if owner:
                    K.owner_hop(q_in, m_in, x[fa:fb], self.mul, blk, q_out, m_out, self.result[fa:fb])
                else:
                    K.ring_hop(q_in, m_in, x[fa:fb], blk, q_out, m_out)
                send.put(mv_out)
        # all-gather: receive the owners' bytes, dequantize, forward unchanged (except the last)
        for s in range(N - 1):
            c = (r - 1 - s) % N
            last = s == N - 2
            for fa, fb, q, meta, mv in self.ag[c]:
                link_in.recv_into(mv)
                if not last:
                    send.put(mv)
                K.dequantize(q, meta, blk, self.result[fa:fb])

    def _round_fp32(self, send: Sender, link_in: Link) -> None:
        N, r, x, res = self.N, self.rank, self.x, self.result
        c0 = (r - 1) % N
        for fa, fb in self.frames[c0]:
            send.put(memoryview(x[fa:fb]).cast("B"))
        for s in range(N - 1):
            c = (r - 2 - s) % N
            base = self.bounds[c]
            owner = s == N - 2
            for fa, fb in self.frames[c]:
                rv = self.rbuf[: fb - fa]
                link_in.recv_into(memoryview(rv).cast("B"))
                if owner:
                    out = res[fa:fb]
                    np.add(rv, x[fa:fb], out=out)
                    np.multiply(out, self.mul, out=out)
                else:
                    out = self.rs[s + 1][fa - base : fb - base]
                    np.add(rv, x[fa:fb], out=out)
                send.put(memoryview(out).cast("B"))
        for s in range(N - 1):
            c = (r - 1 - s) % N
            last = s == N - 2
            for fa, fb in self.frames[c]:
                mv = memoryview(res[fa:fb]).cast("B")
                link_in.recv_into(mv)
                if not last:
                    send.put(mv)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)


def _limit_kernel_threads(k: int) -> None:
    """numba's thread pool per peer process. PEERS processes already oversubscribe the cores, and
    a parallel kernel then waits for descheduled pool threads: with 4 peers on 2 cores one thread
    per process gave ~490 MiB/s int8 AES-GCM against ~125 MiB/s with numba's default of 2."""
    if k <= 0:
        return
    if "numba" not in sys.modules:
        os.environ["NUMBA_NUM_THREADS"] = str(k)  # the pool is sized once, at import
    else:
        import numba

        numba.set_num_threads(min(k, numba.config.NUMBA_NUM_THREADS))
