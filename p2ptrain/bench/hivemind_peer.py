"""One hivemind peer of the all-reduce baseline (`p2ptrain.bench.hivemind_allreduce`), run as
``python -m p2ptrain.bench.hivemind_allreduce --worker ...``: a hivemind DHT and
DecentralizedAverager over one tensor, driven by lines on stdin ("match N", "go N",
"dump PATH", "quit"), answering with PREFIX-marked JSON lines on stdout. Imports hivemind
(never libp2p: both register the protobuf symbol ``crypto.pb.KeyType``).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
import time
from typing import Any, Optional

from p2ptrain.bench._hivemind_common import (
    LOOPBACK_P2P_KWARGS,
    Watchdog,
    fill_gaussian,
    import_hivemind,
    kill_descendants,
    maddrs_are_loopback,
    remaining_descendants,
)

MIB = 1 << 20
PREFIX = "@@p2ptrain-hm "  # marks protocol lines on a worker's stdout


class BenchError(RuntimeError):
    pass


def _emit(kind: str, **fields: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps({"kind": kind, **fields}) + "\n")
    sys.stdout.flush()


def _stdin_commands() -> "queue.Queue[Optional[str]]":
    """Lines from the parent; None on EOF (the parent is gone: shut down).

    Reads file descriptor 0 with os.read, never through ``sys.stdin``: a thread blocked inside
    sys.stdin holds its buffer lock, and a process that hivemind forks afterwards (multiprocessing
    closes sys.stdin in every child) would then deadlock at start-up."""
    q: "queue.Queue[Optional[str]]" = queue.Queue()

    def reader() -> None:
        pending = b""
        while True:
            try:
                data = os.read(0, 4096)
            except OSError:
                data = b""
            if not data:
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                q.put(line.decode().strip())
        q.put(None)

    threading.Thread(target=reader, daemon=True, name="stdin").start()
    return q


def worker(args) -> int:
    hivemind = import_hivemind(args.loglevel)
    import torch
    from hivemind.compression import Float16Compression, NoCompression

    n = int(round(args.mb * MIB)) // 4
    tensor = torch.empty(n, dtype=torch.float32)
    fill_gaussian(tensor.numpy(), args.seed, args.rank)
    compression = Float16Compression() if args.compression == "fp16" else NoCompression()
    dht = averager = None
    with Watchdog(args.timeout, f"hivemind peer {args.rank}"):
        try:
            initial = json.loads(args.initial_peers) if args.initial_peers else []
            dht = hivemind.DHT(initial_peers=initial, start=True, **LOOPBACK_P2P_KWARGS)
            maddrs = [str(m) for m in dht.get_visible_maddrs()]
            if not maddrs or not maddrs_are_loopback(maddrs):
                raise BenchError(f"DHT announces non-loopback or no addresses: {maddrs}")
            averager = hivemind.DecentralizedAverager(
                [tensor],
                dht,
                start=True,
                prefix=f"p2ptrain-bench-{args.run_id}",
                target_group_size=args.peers,
                min_group_size=args.peers,
                min_matchmaking_time=args.min_matchmaking_time,
                request_timeout=min(1.0, args.min_matchmaking_time / 2),
                compression=compression,
            )
            cmds = _stdin_commands()  # only after hivemind has forked its processes
            _emit("ready", maddrs=maddrs, pid=os.getpid())
            _serve(args, averager, cmds)
        except Exception as e:
            _emit("error", error=f"{type(e).__name__}: {e}")
            return 1
        finally:
            for obj in (averager, dht):
                if obj is not None:
                    try:
                        obj.shutdown()
                    except Exception:
                        pass
            deadline = time.monotonic() + 5
            while remaining_descendants() and time.monotonic() < deadline:
                time.sleep(0.1)
            kill_descendants()
    _emit("bye")
    return 0


def _serve(args, averager, cmds: "queue.Queue[Optional[str]]") -> None:
    import numpy as np

    control = None
    while True:
        line = cmds.get()
        if line is None or line == "quit":
            return
        cmd, _, arg = line.partition(" ")
        if cmd == "match":
            control = _match(args, averager, int(arg))
        elif cmd == "go":
            _go(args, averager, control, int(arg))
            control = None
        elif cmd == "dump":
            with averager.get_tensors() as ts:
                np.save(arg, ts[0].numpy())
            _emit("dumped", path=arg)
        else:
            raise BenchError(f"unknown command {line!r}")


def _match(args, averager, rnd: int):
    """Matchmaking up to the trigger: the step's control, or None (reported) if it failed."""
    from hivemind.averaging.control import AveragingStage

    with averager.get_tensors() as ts:
        fill_gaussian(ts[0].numpy(), args.seed, args.rank)
    t = time.perf_counter()
    err, control = None, None
    try:
        control = averager.step(wait=False, require_trigger=True, allow_retries=False, timeout=args.match_timeout)
        while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
            if time.perf_counter() - t > args.match_timeout + 5:
                raise TimeoutError("matchmaking did not finish")
            time.sleep(0.002)
        if control.done():  # failed before the trigger
            control.result(timeout=0)
            err = "matchmaking ended without a group"
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    if err and control is not None and not control.done():
        control.cancel()
    _emit("matched", round=rnd, ok=err is None, match_s=time.perf_counter() - t, error=err)
    return None if err else control


def _go(args, averager, control, rnd: int) -> None:
    """Trigger the all-reduce of a matched group and report its times and result hash."""
    t0 = time.perf_counter()
    err, group = None, 0
    if control is None:
        err = "no group"
    else:
        try:
            control.allow_allreduce()
            gathered = control.result(timeout=args.allreduce_timeout)
            group = len(gathered) if gathered else 0
            if group != args.peers:
                err = f"group of {group} peers, expected {args.peers}"
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
    t1 = time.perf_counter()
    with averager.get_tensors() as ts:
        digest = hashlib.sha256(ts[0].numpy()).hexdigest()
    _emit("round", round=rnd, t0=t0, t1=t1, ok=err is None, group=group, sha=digest, error=err)
