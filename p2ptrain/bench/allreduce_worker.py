"""One all-reduce peer process, driven by JSON commands on stdin (bench and tests).

    python -m p2ptrain.bench.allreduce_worker [--listen MADDR] [--direct/--no-direct] ...

It runs a real libp2p node and an AllReduceService, prints `worker_ready` (peer id, addrs),
then executes commands, one JSON object per stdin line:
  {"cmd": "round", "round": "r1", "members": [[peer_id, addr], ...], "seed": 7, "n": 1000,
   "mode": "int8", "verified": true}
("robust": the butterfly data plane; "verified": the training path, signed headers and every frame checked: `bench.signed_round`;
 "refuse": REASON, this member's gate refuses the result, as the loss gate does: `run.lossgate`.)
It keeps one fp32 tensor: created from `seed` on the first round (or when "reset" is set);
a committed round replaces it with the result, a failed round must leave it unchanged.
Events: round_started, round_committed (digest, seconds, path, sent_bytes, rss), and
round_failed (reason, tensor_sha256 before and after).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import resource
import sys
import time

import numpy as np
import trio

from p2ptrain.bench.signed_round import verified_allreduce
from p2ptrain.reduce.robust import RobustConfig
from p2ptrain.reduce.service import AllReduceConfig, AllReduceService, RoundFailed
from p2ptrain.reduce import roundtrace
from p2ptrain.events import EventSink, setup_logging
from p2ptrain.identity import Identity
from p2ptrain.net.node import Node, NodeConfig

SPIN_S = 0.003  # the last stretch before a round's start instant is spun, not slept (see there)


async def _barrier(start_at: float) -> None:
    """A barrier, as the raw-socket ceiling's: every member starts at the same CLOCK_MONOTONIC
    instant (shared by all processes on Linux), after its reset copy and command parsing, so
    start skew is not counted as round time. trio's sleep wakes 1-2 ms late (epoll's
    millisecond timeouts, then the loop's turn), by a different amount in each member, and
    that skew was counted as round time: we sleep to SPIN_S before the instant, then spin
    (bounded by SPIN_S; this process has nothing else to do meanwhile)."""
    await trio.sleep(max(0.0, start_at - SPIN_S - time.monotonic()))
    while time.monotonic() < start_at:
        pass


def make_tensor(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


def _sha(x: np.ndarray) -> str:
    return hashlib.sha256(x.tobytes()).hexdigest()


def _cpu() -> float:
    """CPU seconds of this whole process (all threads), user + system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rss_mib() -> float:
    """Peak RSS of this process. VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss
    across exec, so a child of a big parent would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main(args) -> None:
    identity = Identity.generate()
    events = EventSink(identity.peer_id_str, True)
    node = Node(identity, NodeConfig(listen=[args.listen]), EventSink(identity.peer_id_str, False))
    tensor: np.ndarray | None = None
    pristine: np.ndarray | None = None
    spare: np.ndarray | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        configs: dict[str, AllReduceService] = {}

        async def service_for(mode: str) -> AllReduceService:
            # One service, reconfigured per round: the config is read at round start.
            svc = configs.get("svc")
            if svc is None:
                svc = AllReduceService(node.host, identity, AllReduceConfig(), listen_ip=args.bulk_ip)
                await nursery.start(svc.run)
                configs["svc"] = svc
            svc.config = AllReduceConfig(mode=mode, direct=args.direct, send_rate_mbps=args.rate,
                                         sub_chunk_bytes=int(args.sub_chunk_mb * (1 << 20)),
                                         frame_timeout=args.frame_timeout, commit_timeout=args.commit_timeout)
            return svc

        await service_for("int8")
        events.emit("worker_ready", addrs=node.full_addrs(), bulk_port=configs["svc"].port,
                    rss_mib=round(_rss_mib(), 1))
        stdin = trio.wrap_file(sys.stdin)
        while True:
            line = await stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd.get("cmd") == "exit":
                break
            if cmd.get("cmd") == "dump" and tensor is not None:
                np.save(cmd["path"], tensor)
                events.emit("dumped", path=cmd["path"])
                continue
            if cmd.get("cmd") == "prepare":
                # Inputs are made outside the timed round, so one member generating 64 MiB
                # of random numbers does not count against everyone's round time.
                pristine = make_tensor(int(cmd["seed"]), int(cmd["n"]))
                tensor = pristine.copy()
                events.emit("prepared", n=int(cmd["n"]), rss_mib=round(_rss_mib(), 1))
                continue
            if cmd.get("cmd") != "round":
                continue
            if tensor is None or (cmd.get("reset") and pristine is None):
                pristine = make_tensor(int(cmd["seed"]), int(cmd["n"]))
                tensor = pristine.copy()
            elif cmd.get("reset"):
                np.copyto(tensor, pristine)
            for pid, addr in cmd["members"]:
                if pid != identity.peer_id_str:
                    node.rpc.learn_addrs(identity_bytes(pid), [addr.split("/p2p/")[0]])
            svc = await service_for(cmd.get("mode", "int8"))
            # Hashing 64 MiB costs CPU the other members need: only when a test asks.
            before = _sha(tensor) if cmd.get("verify") else ""
            if cmd.get("start_at"):
                await _barrier(float(cmd["start_at"]))
            events.emit("round_started", round=cmd["round"])
            cpu0 = _cpu()
            try:
                res = await _round(svc, cmd, tensor, spare if spare is not None and spare.shape == tensor.shape else None)
            except RoundFailed as exc:
                roundtrace.take(0.0)  # a failed round's marks must not run into the next one's
                events.emit("round_failed", round=cmd["round"], reason=str(exc), tensor_before=before,
                            tensor_after=_sha(tensor) if cmd.get("verify") else "")
                continue
            # Double buffering, as a trainer would: the old tensor receives the next result.
            spare, tensor = tensor, res.result
            events.emit("round_committed", round=cmd["round"], digest=res.digest, seconds=round(res.seconds, 4),
                        path=res.path, sent_bytes=res.sent_bytes, rss_mib=round(_rss_mib(), 1), phases=res.phases,
                        ended=time.monotonic(), cpu_s=round(_cpu() - cpu0, 4), reused=res.reused,
                        **({"trace": roundtrace.take(float(cmd["start_at"]))} if roundtrace.ON and cmd.get("start_at") else {}))
        nursery.cancel_scope.cancel()


async def _round(svc: AllReduceService, cmd: dict, tensor: np.ndarray, out: np.ndarray | None):
    run, ids = cmd.get("run", "bench"), [m[0] for m in cmd["members"]]
    if cmd.get("verified"):
        return await verified_allreduce(svc, tensor, run, cmd["round"], ids, out=out)
    if cmd.get("robust"):  # the butterfly data plane, votes over libp2p
        return await svc.allreduce(tensor, run, cmd["round"], ids, robust=RobustConfig())
    if cmd.get("refuse"):  # as a member whose loss gate refuses the result (p2ptrain.run.lossgate)
        return await svc.allreduce(tensor, run, cmd["round"], ids, out=out, gate=lambda result: str(cmd["refuse"]))
    return await svc.allreduce(tensor, run, cmd["round"], ids, out=out)


def identity_bytes(pid: str) -> bytes:
    from p2ptrain.identity import peer_id_from_str

    return peer_id_from_str(pid)


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m p2ptrain.bench.allreduce_worker")
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    ap.add_argument("--bulk-ip", default="127.0.0.1", help="IP for the raw bulk listener")
    ap.add_argument("--no-direct", dest="direct", action="store_false", help="bulk bytes over libp2p only")
    ap.add_argument("--rate", type=float, default=0.0, help="bulk send cap, MB/s (0 = none)")
    ap.add_argument("--frame-timeout", type=float, default=20.0)
    ap.add_argument("--sub-chunk-mb", type=float, default=4.0, help="fp32 MiB per pipelined frame")
    ap.add_argument("--commit-timeout", type=float, default=10.0)
    args = ap.parse_args(argv)
    setup_logging()
    logging.getLogger("p2ptrain").setLevel(logging.WARNING)
    trio.run(main, args)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
