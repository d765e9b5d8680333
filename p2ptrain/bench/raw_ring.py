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
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from multiprocessing.connection import wait as mp_wait
from typing import Any, Dict, List, Optional

import numpy as np

from p2ptrain.bench.raw_ring_plane import (  # noqa: F401  (gaussian: the benches' shared data)
    CIPHERS,
    HELLO,
    MAGIC,
    MIB,
    MODES,
    SOCK_BUF,
    BenchError,
    Link,
    Ring,
    Sender,
    _check_loopback,
    _limit_kernel_threads,
    _recv_exact,
    _tune,
    _vm_hwm_mib,
    gaussian,
)

EVENT = "bench_allreduce_raw_ring"


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
        if cfg["mode"] == "int8":
            _limit_kernel_threads(cfg["kernel_threads"])
        ring = Ring(rank, cfg["peers"], gaussian(cfg["seed"], rank, cfg["n"]), cfg["mode"], cfg["block"],
                    cfg["frame_bytes"])
        out, inc = _connect(rank, cfg["peers"], conn, socks)
        conn.send(("done", _rounds(rank, cfg, ring, out, inc, barrier)))
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


def _connect(rank: int, N: int, conn, socks: List[socket.socket]) -> tuple:
    """(socket to rank+1, socket from rank-1), both loopback-only and tuned; all in `socks`."""
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
    return out, inc


def _rounds(rank: int, cfg: Dict[str, Any], ring: Ring, out: socket.socket, inc: socket.socket, barrier) -> dict:
    """Warm-up and measured rounds, each after a barrier; this peer's report."""
    N, keys = cfg["peers"], cfg["keys"]
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
    return {"rank": rank, "starts": starts, "ends": ends, "hashes": hashes, "peak_rss_mib": _vm_hwm_mib(),
            "loopback": True, "block": ring.block if cfg["mode"] == "int8" else None,
            "kernels": getattr(ring.K, "BACKEND", None)}


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
        ports = _recv_all(conns, procs, "port", deadline, args.timeout)
        for c in conns:
            c.send(ports)
        reports = _recv_all(conns, procs, "done", deadline, args.timeout)
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
    return _summary(args, n, reports, result)


def _recv_all(conns: list, procs: list, kind: str, deadline: float, timeout: float) -> List[Any]:
    """One `kind` message from every peer process, by rank; a peer that dies or errs fails it."""
    N = len(conns)
    got: Dict[int, Any] = {}
    while len(got) < N:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"raw ring exceeded the {timeout:.0f} s timeout")
        ready = mp_wait([c for i, c in enumerate(conns) if i not in got], timeout=min(left, 1.0))
        for c in ready:
            i = conns.index(c)
            try:
                tag, val = c.recv()
            except EOFError:
                procs[i].join(timeout=1)
                raise BenchError(f"peer {i} exited (code {procs[i].exitcode}) during {kind}") from None
            if tag == "error":
                raise BenchError(val)
            if tag != kind:
                raise BenchError(f"peer {i}: expected {kind}, got {tag}")
            got[i] = val
        for i, p in enumerate(procs):
            if i not in got and not p.is_alive() and not conns[i].poll():
                raise BenchError(f"peer {i} exited (code {p.exitcode}) during {kind}")
    return [got[i] for i in range(N)]


def _summary(args, n: int, reports: list, result: np.ndarray) -> Dict[str, Any]:
    N, W = args.peers, args.warmup
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
