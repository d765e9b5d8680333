"""Encrypted raw-socket ring all-reduce: the ceiling our libp2p-based ring is measured against.

    python -m p2ptrain.bench.raw_ring --peers 4 --mb 64 --rounds 5 --mode int8|fp32
        [--cipher aesgcm|chacha|none] [--json]

PEERS processes (multiprocessing, "spawn") on 127.0.0.1 each hold a seeded gaussian fp32 vector
of MB MiB (different per peer) and average it with a plain ring all-reduce (reduce-scatter, then
all-gather) over blocking TCP sockets: peer r sends only to r+1 and receives only from r-1
(TCP_NODELAY, 4 MiB socket buffers). Chunk c (``split_bounds``) is owned by peer c. Every
message is cut into ~1 MiB frames, each sealed on its own (AES-256-GCM or ChaCha20-Poly1305 from
``cryptography``, ``encrypt_into`` / ``decrypt_into``, which release the GIL) with the key of
that ring link and a per-direction counter nonce, and opened again at every hop.

  int8  reduce-scatter: the first sender quantizes its slice, every later hop applies
        ``ring_hop`` (dequantize + add own fp32 + re-quantize, fp32 accumulation), the owner
        applies ``owner_hop`` (mean, quantized once); all-gather: the owner's bytes are forwarded
        unchanged and every peer dequantizes them, so all results are bit-identical.
  fp32  the same ring with plain fp32 sums; the owner scales by 1/PEERS and its bytes are
        forwarded unchanged.

The ring is streamed frame by frame: a frame received at hop s is reduced and handed to a sender
thread at once, which seals and sends it while the main thread receives the next frame (without
that thread the ring would deadlock or serialise). Each round starts at a barrier; the round
time is the last peer's finish minus the first peer's start (``time.perf_counter`` is
CLOCK_MONOTONIC, shared by all processes on Linux), and MiB/s = MB / round seconds. One warm-up
round (numba JIT, page faults) precedes the measured rounds. Reported: the median and every
round's MiB/s, the relative L2 error of peer 0's result against the exact (float64-accumulated)
mean, whether every peer's result has the same sha256 in every round, and each peer's peak RSS
(VmHWM). Only loopback sockets are ever opened, and every one is checked.

Imports: numpy, cryptography, p2ptrain.kernels (int8 mode only) and the standard library.
``add_arguments(parser)`` / ``run(args)`` let ``p2ptrain bench`` call it in-process.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import struct
import sys
import threading
import time
from multiprocessing.connection import wait as mp_wait
from typing import Any, Dict, List, Optional

import numpy as np

EVENT = "bench_allreduce_raw_ring"
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


def _worker(rank: int, cfg: Dict[str, Any], conn, barrier) -> None:
    """One ring peer (runs in a spawned process)."""
    deadline = threading.Timer(cfg["timeout"], lambda: os._exit(3))
    deadline.daemon = True
    deadline.start()
    ppid = os.getppid()

    def orphan_watch() -> None:  # the parent died without cleaning up: do not linger
        while True:
            time.sleep(1.0)
            if os.getppid() != ppid:
                os._exit(4)

    threading.Thread(target=orphan_watch, daemon=True).start()
    socks: List[socket.socket] = []
    try:
        N, n = cfg["peers"], cfg["n"]
        if cfg["mode"] == "int8":
            _limit_kernel_threads(cfg["kernel_threads"])
        x = gaussian(cfg["seed"], rank, n)
        ring = Ring(rank, N, x, cfg["mode"], cfg["block"], cfg["frame_bytes"])

        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        socks.append(lst)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)  # inherited by accepted sockets
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        _check_loopback(lst, "listening")
        conn.send(("port", lst.getsockname()[1]))
        ports = conn.recv()

        out = socket.create_connection(("127.0.0.1", ports[(rank + 1) % N]), timeout=30)
        socks.append(out)
        out.settimeout(None)
        _tune(out)
        out.sendall(HELLO.pack(MAGIC, rank))
        lst.settimeout(30)
        inc, addr = lst.accept()
        socks.append(inc)
        inc.settimeout(None)
        _tune(inc)
        hello = bytearray(HELLO.size)
        _recv_exact(inc, memoryview(hello))
        magic, who = HELLO.unpack(hello)
        if magic != MAGIC or who != (rank - 1) % N:
            raise BenchError(f"unexpected ring neighbour {who} from {addr}")
        _check_loopback(out, "outgoing")
        _check_loopback(inc, "incoming")

        keys = cfg["keys"]
        link_out = Link(out, cfg["cipher"], keys[rank], ring.max_frame)
        link_in = Link(inc, cfg["cipher"], keys[(rank - 1) % N], ring.max_frame)

        def abort() -> None:  # unblock the main thread's recv if the sender fails
            for s in (inc, out):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        sender = Sender(link_out, abort)
        sender.start()
        starts, ends, hashes = [], [], []
        for _ in range(cfg["warmup"] + cfg["rounds"]):
            barrier.wait(timeout=cfg["timeout"])
            t0 = time.perf_counter()
            ring.round(sender, link_in)
            t1 = time.perf_counter()
            sender.flush()
            starts.append(t0)
            ends.append(t1)
            hashes.append(hashlib.sha256(memoryview(ring.result).cast("B")).hexdigest())
        barrier.wait(timeout=cfg["timeout"])  # nobody closes a socket while a neighbour still reads
        sender.put(None)
        sender.join(timeout=10)
        report = {
            "rank": rank,
            "starts": starts,
            "ends": ends,
            "hashes": hashes,
            "peak_rss_mib": _vm_hwm_mib(),
            "loopback": True,
            "block": ring.block if cfg["mode"] == "int8" else None,
            "kernels": getattr(ring.K, "BACKEND", None),
        }
        conn.send(("done", report))
        if rank == 0:
            conn.send(("result", ring.result))
    except BaseException as e:  # noqa: BLE001  one line to the parent
        try:
            barrier.abort()
        except Exception:
            pass
        try:
            conn.send(("error", f"peer {rank}: {type(e).__name__}: {e}"))
        except Exception:
            pass
        os._exit(1)
    finally:
        for s in socks:
            try:
                s.close()
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# parent


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, default=4, help="ring size (>= 2)")
    p.add_argument("--mb", type=float, default=64.0, help="fp32 vector size per peer in MiB")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up round)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up rounds")
    p.add_argument("--mode", choices=MODES, default="int8", help="int8 (p2ptrain.kernels) or fp32 sums")
    p.add_argument("--cipher", choices=CIPHERS, default="aesgcm", help="frame AEAD (default aesgcm)")
    p.add_argument("--frame-kib", type=int, default=1024, help="plaintext frame size in KiB")
    p.add_argument("--block", type=int, default=None, help="int8 sub-block size (default: kernels' DEFAULT_BLOCK)")
    p.add_argument("--kernel-threads", type=int, default=1,
                   help="numba threads per peer process for the int8 kernels (0: numba's default)")
    p.add_argument("--seed", type=int, default=0, help="data seed")
    p.add_argument("--timeout", type=float, default=300.0, help="overall timeout in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")


def _fail(msg: str, code: int = 1) -> int:
    print(f"error: {msg}".replace("\n", " "), file=sys.stderr, flush=True)
    return code


def _exact_rel_err(result: np.ndarray, seed: int, peers: int) -> float:
    n = result.size
    acc = np.zeros(n, np.float64)
    for r in range(peers):
        acc += gaussian(seed, r, n)
    acc /= peers
    diff = result.astype(np.float64)
    diff -= acc
    return float(np.linalg.norm(diff) / np.linalg.norm(acc))


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _run_ring(args) -> Dict[str, Any]:
    n = int(round(args.mb * MIB)) // 4
    N = args.peers
    keys = [os.urandom(32) for _ in range(N)]  # key of link r -> r+1
    cfg = dict(peers=N, n=n, mode=args.mode, cipher=args.cipher, keys=keys, seed=args.seed,
               rounds=args.rounds, warmup=args.warmup, block=args.block,
               frame_bytes=args.frame_kib * 1024, kernel_threads=args.kernel_threads,
               timeout=args.timeout)
    deadline = time.monotonic() + args.timeout
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(N)
    pipes = [ctx.Pipe() for _ in range(N)]
    procs = [ctx.Process(target=_worker, args=(r, cfg, pipes[r][1], barrier), daemon=True,
                         name=f"raw-ring-{r}") for r in range(N)]
    conns = [p[0] for p in pipes]
    try:
        for p in procs:
            p.start()
        for p in pipes:
            p[1].close()

        def recv_all(kind: str) -> List[Any]:
            got: Dict[int, Any] = {}
            while len(got) < N:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"raw ring exceeded the {args.timeout:.0f} s timeout")
                ready = mp_wait([c for i, c in enumerate(conns) if i not in got], timeout=min(left, 1.0))
                for c in ready:
                    i = conns.index(c)
                    try:
                        tag, val = c.recv()
                    except EOFError:
                        procs[i].join(timeout=1)
                        code = procs[i].exitcode
                        raise BenchError(f"peer {i} exited (code {code}) during {kind}") from None
                    if tag == "error":
                        raise BenchError(val)
                    if tag != kind:
                        raise BenchError(f"peer {i}: expected {kind}, got {tag}")
                    got[i] = val
                for i, p in enumerate(procs):
                    if i not in got and not p.is_alive() and not conns[i].poll():
                        raise BenchError(f"peer {i} exited (code {p.exitcode}) during {kind}")
            return [got[i] for i in range(N)]

        ports = recv_all("port")
        for c in conns:
            c.send(ports)
        reports = recv_all("done")
        left = max(1.0, deadline - time.monotonic())
        if not conns[0].poll(left):
            raise BenchError("peer 0 did not send its result")
        tag, result = conns[0].recv()
        if tag != "result":
            raise BenchError(f"peer 0: expected result, got {tag}")
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _kill(procs)
    leftover = [p.name for p in procs if p.is_alive()]
    if leftover:
        raise BenchError(f"could not stop {leftover}")

    W = args.warmup
    seconds = []
    for i in range(W, W + args.rounds):
        seconds.append(max(r["ends"][i] for r in reports) - min(r["starts"][i] for r in reports))
    mib = n * 4 / MIB
    mib_s = [round(mib / s, 1) for s in seconds]
    hashes = {h for r in reports for h in r["hashes"]}
    return {
        "event": EVENT,
        "peers": N,
        "mb": args.mb,
        "mode": args.mode,
        "cipher": args.cipher,
        "mib_s": {"median": round(statistics.median(mib_s), 1), "all": mib_s},
        "round_s": {"median": round(statistics.median(seconds), 4), "all": [round(s, 4) for s in seconds]},
        "rel_err": float(f"{_exact_rel_err(result, args.seed, N):.4g}"),
        "identical": len(hashes) == 1,
        "peak_rss_mib": [r["peak_rss_mib"] for r in reports],
        "loopback_only": all(r["loopback"] for r in reports),
        "block": reports[0]["block"],
        "kernels": reports[0]["kernels"],
        "kernel_threads": args.kernel_threads if args.mode == "int8" else None,
        "frame_kib": args.frame_kib,
        "warmup_s": round(max(r["ends"][0] for r in reports) - min(r["starts"][0] for r in reports), 3)
        if W else None,
    }


def _print_table(rep: Dict[str, Any]) -> None:
    mode = rep["mode"] + (f" (block {rep['block']}, {rep['kernels']} kernels, "
                          f"{rep['kernel_threads'] or 'default'} thread(s) per peer)" if rep["block"] else "")
    print(f"raw-socket ring all-reduce on loopback: {rep['peers']} peers, {rep['mb']:g} MiB fp32 per peer, "
          f"{mode}, cipher {rep['cipher']}, {rep['frame_kib']} KiB frames")
    print(f"{'round':>6} {'seconds':>9} {'MiB/s':>9}")
    for i, (s, m) in enumerate(zip(rep["round_s"]["all"], rep["mib_s"]["all"])):
        print(f"{i + 1:>6} {s:>9.4f} {m:>9.1f}")
    print(f"{'median':>6} {rep['round_s']['median']:>9.4f} {rep['mib_s']['median']:>9.1f}")
    print(f"relative L2 error vs exact mean: {rep['rel_err']:.3g} ({rep['rel_err'] * 100:.3f} %)   identical on all peers: "
          f"{'yes' if rep['identical'] else 'NO'}")
    print("peak RSS per peer (MiB): " + ", ".join(f"{x:.0f}" for x in rep["peak_rss_mib"])
          + f"   loopback only: {'yes' if rep['loopback_only'] else 'NO'}")


def run(args) -> int:
    if args.peers < 2:
        return _fail("--peers must be at least 2")
    if args.rounds < 1 or args.warmup < 0:
        return _fail("--rounds must be >= 1 and --warmup >= 0")
    if args.mb <= 0 or args.frame_kib < 1:
        return _fail("--mb and --frame-kib must be positive")
    if args.cipher != "none":
        try:
            import cryptography.hazmat.primitives.ciphers.aead  # noqa: F401
        except ImportError:
            return _fail("the 'cryptography' package is required for --cipher aesgcm/chacha", 2)
    try:
        rep = _run_ring(args)
    except BenchError as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps(rep, separators=(",", ":")), flush=True)
    else:
        _print_table(rep)
    if not rep["identical"]:
        return _fail("peers ended with different results")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m p2ptrain.bench.raw_ring", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
