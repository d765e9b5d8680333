"""hivemind all-reduce baseline on loopback.

    python -m p2ptrain.bench.hivemind_allreduce --peers 4 --mb 64 --rounds 5
        [--compression none|fp16] [--json]

Starts PEERS worker processes (``python -m p2ptrain.bench.hivemind_allreduce --worker ...``),
each with its own hivemind DHT (first worker = initial peer of the others) and
DecentralizedAverager over one fp32 tensor of MB MiB, filled with seeded gaussian data that
differs per peer (the same data as ``p2ptrain.bench.raw_ring``). hivemind starts further
processes per peer (the DHT process with its Go p2pd daemon, the averager process); all listen
on 127.0.0.1 only, with NAT port mapping, AutoNAT, relays and IPFS bootstrap switched off.

One round: every peer resets its tensor to its own data and calls ``averager.step(
require_trigger=True, wait=False, allow_retries=False)`` (group key matchmaking with
target_group_size = min_group_size = PEERS); once every peer has its group, the parent sends
"go" and each peer triggers the all-reduce. The round time is the last peer's finish minus the
first peer's trigger (``time.perf_counter`` is CLOCK_MONOTONIC, shared by all processes), so it
measures the all-reduce alone; matchmaking time is reported separately. "fp32-payload MiB/s" =
MB / round seconds. A round fails if a peer errs, times out or ends in a group smaller than
PEERS; failed rounds are retried (at most ROUNDS extra attempts) so that up to ROUNDS successful
rounds are measured, after one warm-up round. Reported: per-round seconds and MiB/s (median over
successful rounds), matchmaking seconds, the relative L2 error of every peer's tensor after the
last round against the exact (float64-accumulated) mean (max over peers), whether all peers
ended every successful round with the same sha256 of the tensor bytes, each peer's peak RSS
(its worker process plus all descendants, summed, sampled every 0.2 s: pages shared between
them, like the tensor in shared memory, count once per process) and the failures.

hivemind 1.1.12's 8-bit codecs are broken under NumPy 2, hence only none / fp16. The parent
process imports neither hivemind nor libp2p (only psutil, numpy and the standard library); the
workers import hivemind and never libp2p (both register the protobuf symbol
``crypto.pb.KeyType`` and cannot share a process). Run it as ``python -m`` (a subprocess).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

from p2ptrain.bench.hivemind_peer import MIB, PREFIX, BenchError
from p2ptrain.bench._hivemind_common import (
    merge_audits,
    INSTALL_HINT,
    PeakRssSampler,
    Watchdog,
    audit_loopback,
    fail,
    fill_gaussian,
    kill_descendants,
    remaining_descendants,
)

EVENT = "bench_allreduce_hivemind"
COMPRESSIONS = ("none", "fp16")


# =============================================================================================
# parent


class Peer:
    def __init__(self, rank: int, proc: subprocess.Popen, inbox: "queue.Queue", errfile: str):
        self.rank, self.proc, self.errfile = rank, proc, errfile
        threading.Thread(target=self._read, args=(inbox,), daemon=True, name=f"peer{rank}-out").start()

    def _read(self, inbox: "queue.Queue") -> None:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                try:
                    inbox.put((self.rank, json.loads(line[len(PREFIX):])))
                except ValueError:
                    pass
        inbox.put((self.rank, {"kind": "eof"}))

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def stderr_tail(self) -> str:
        try:
            with open(self.errfile, errors="replace") as f:
                lines = [x.strip() for x in f.read().splitlines() if x.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""


class Parent:
    def __init__(self, args, work: str):
        self.args, self.work = args, work
        self.inbox: "queue.Queue" = queue.Queue()
        self.peers: List[Peer] = []
        self.run_id = secrets.token_hex(4)
        self.deadline = time.monotonic() + args.timeout

    def spawn(self, rank: int, initial: Optional[List[str]]) -> Peer:
        a = self.args
        cmd = [sys.executable, "-m", "p2ptrain.bench.hivemind_allreduce", "--worker", "--rank", str(rank),
               "--peers", str(a.peers), "--mb", repr(a.mb), "--compression", a.compression,
               "--seed", str(a.seed), "--run-id", self.run_id, "--loglevel", a.loglevel,
               "--min-matchmaking-time", repr(a.min_matchmaking_time),
               "--match-timeout", repr(a.match_timeout), "--allreduce-timeout", repr(a.allreduce_timeout),
               "--timeout", repr(a.timeout + 30)]
        if initial:
            cmd += ["--initial-peers", json.dumps(initial)]
        errfile = os.path.join(self.work, f"peer{rank}.stderr")
        with open(errfile, "w") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                    cwd=self.work, env=dict(os.environ))
        peer = Peer(rank, proc, self.inbox, errfile)
        self.peers.append(peer)
        return peer

    def collect(self, kind: str, ranks: List[int], timeout: Optional[float] = None) -> Dict[int, Dict[str, Any]]:
        got: Dict[int, Dict[str, Any]] = {}
        end = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        while len(got) < len(ranks):
            left = end - time.monotonic()
            if left <= 0:
                raise BenchError(f"timed out waiting for {kind} from peers {sorted(set(ranks) - set(got))}")
            try:
                rank, msg = self.inbox.get(timeout=left)
            except queue.Empty:
                continue
            if msg["kind"] == "error":
                raise BenchError(f"peer {rank}: {msg['error']}")
            if msg["kind"] == "eof":
                p = self.peers[rank]
                code = p.proc.wait(timeout=5)
                tail = p.stderr_tail()
                raise BenchError(f"peer {rank} exited (code {code}) while waiting for {kind}"
                                 + (f": {tail}" if tail else ""))
            if msg["kind"] == kind and rank in ranks:
                got[rank] = msg
        return got

    def broadcast(self, line: str) -> None:
        for p in self.peers:
            p.send(line)

    def shutdown(self) -> int:
        self.broadcast("quit")
        for p in self.peers:
            try:
                p.proc.wait(timeout=max(5.0, min(30.0, self.deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5
        while remaining_descendants() and time.monotonic() < deadline:
            time.sleep(0.1)
        forced = kill_descendants() if remaining_descendants() else 0
        for p in self.peers:
            try:
                p.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        return forced


def _verify(paths: List[str], seed: int, peers: int) -> Dict[str, Any]:
    """Relative L2 error of each peer's tensor vs the exact mean, and how far the peers differ."""
    import numpy as np

    first = np.load(paths[0], mmap_mode="r")
    n = first.size
    del first
    acc = np.zeros(n, np.float64)
    buf = np.empty(n, np.float32)
    for r in range(peers):
        acc += fill_gaussian(buf, seed, r)
    acc /= peers
    ref = float(np.linalg.norm(acc))
    rel, differing, max_diff = [], 0, 0.0
    res0 = np.load(paths[0])
    for i, p in enumerate(paths):
        res = res0 if i == 0 else np.load(p)
        diff = res.astype(np.float64)
        diff -= acc
        rel.append(float(np.linalg.norm(diff)) / ref)
        if i:
            ne = res != res0
            differing = max(differing, int(np.count_nonzero(ne)))
            if differing:
                max_diff = max(max_diff, float(np.max(np.abs(res[ne].astype(np.float64) - res0[ne]))))
    return {"rel": rel, "differing": differing, "max_diff": max_diff}


def _rounds(parent: Parent, ranks: List[int]) -> tuple:
    """Warm-up and measured rounds (failed ones retried, at most 2 x ROUNDS attempts):
    (per-round records, the loopback audit taken after the warm-up)."""
    a = parent.args
    rounds: List[Dict[str, Any]] = []
    audit_mid: Dict[str, Any] = {}
    successes, attempt, max_attempts = 0, 0, a.warmup + 2 * a.rounds
    while successes < a.rounds and attempt < max_attempts:
        warm = attempt < a.warmup
        parent.broadcast(f"match {attempt}")
        matched = parent.collect("matched", ranks, timeout=a.match_timeout + 30)
        parent.broadcast(f"go {attempt}")
        done = parent.collect("round", ranks, timeout=a.allreduce_timeout + 30)
        errors = [f"peer {r}: {m['error']}" for r, m in sorted(matched.items()) if not m["ok"]]
        errors += [f"peer {r}: {m['error']}" for r, m in sorted(done.items()) if not m["ok"] and matched[r]["ok"]]
        rec = {
            "attempt": attempt,
            "warmup": warm,
            "ok": not errors,
            "seconds": max(m["t1"] for m in done.values()) - min(m["t0"] for m in done.values()),
            "match_s": max(m["match_s"] for m in matched.values()),
            "identical": len({m["sha"] for m in done.values()}) == 1,
            "groups": [done[r]["group"] for r in ranks],
            "errors": errors,
        }
        rounds.append(rec)
        if warm:
            audit_mid = audit_loopback()
        elif rec["ok"]:
            successes += 1
        attempt += 1
    return rounds, audit_mid


def _measure(parent: Parent) -> Dict[str, Any]:
    a = parent.args
    N = a.peers
    ranks = list(range(N))
    t_start = time.perf_counter()
    p0 = parent.spawn(0, None)
    sampler = PeakRssSampler([p0.proc.pid])
    with sampler:
        ready = parent.collect("ready", [0])
        initial = ready[0]["maddrs"]
        for r in range(1, N):
            sampler.add(parent.spawn(r, initial).proc.pid)
        ready.update(parent.collect("ready", ranks[1:]))
        startup_s = time.perf_counter() - t_start

        rounds, audit_mid = _rounds(parent, ranks)
        paths = [os.path.join(parent.work, f"result{r}.npy") for r in ranks]
        for r, p in enumerate(parent.peers):
            p.send(f"dump {paths[r]}")
        parent.collect("dumped", ranks)
        audit_end = audit_loopback()
    forced = parent.shutdown()
    ver = _verify(paths, a.seed, N)
    rel = ver["rel"]

    measured = [r for r in rounds if not r["warmup"]]
    good = [r for r in measured if r["ok"]]
    mib = int(round(a.mb * MIB)) // 4 * 4 / MIB
    mib_s = [round(mib / r["seconds"], 1) for r in good]
    audits = [x for x in (audit_mid, audit_end) if x]
    non_loopback = [s for x in audits for s in x["non_loopback"]]
    if non_loopback:
        raise BenchError(f"non-loopback sockets seen: {non_loopback[:5]}")
    return {
        "event": EVENT,
        "peers": N,
        "mb": a.mb,
        "compression": a.compression,
        "mib_s": {"median": round(statistics.median(mib_s), 1) if mib_s else None, "all": mib_s},
        "round_s": {"median": round(statistics.median(r["seconds"] for r in good), 4) if good else None,
                    "all": [round(r["seconds"], 4) for r in good]},
        "match_s": {"median": round(statistics.median(r["match_s"] for r in measured), 3) if measured else None},
        "rel_err": float(f"{max(rel):.4g}"),
        "rel_err_per_peer": [float(f"{x:.4g}") for x in rel],
        "last_round_ok": bool(measured and measured[-1]["ok"]),
        "identical": bool(good) and all(r["identical"] for r in good),
        # last round: most elements differing from peer 0's result (of n), largest difference
        "peer_mismatch": {"elements": ver["differing"], "of": int(round(a.mb * MIB)) // 4,
                          "max_abs": float(f"{ver['max_diff']:.4g}")},
        "peak_rss_mib": sampler.peak_mib(),
        "failures": len(measured) - len(good),
        "errors": [e for r in measured for e in r["errors"]][:5],
        "warmup_s": round(rounds[0]["seconds"], 3) if a.warmup and rounds else None,
        "startup_s": round(startup_s, 2),
        "loopback_audit": merge_audits(audits),
        "forced_kills": forced,
    }


def _print_table(rep: Dict[str, Any]) -> None:
    print(f"hivemind all-reduce on loopback: {rep['peers']} peers, {rep['mb']:g} MiB fp32 per peer, "
          f"compression {rep['compression']} (startup {rep['startup_s']:.1f} s, warm-up round "
          f"{rep['warmup_s']} s)")
    print(f"{'round':>6} {'seconds':>9} {'MiB/s':>9}")
    for i, (s, m) in enumerate(zip(rep["round_s"]["all"], rep["mib_s"]["all"])):
        print(f"{i + 1:>6} {s:>9.4f} {m:>9.1f}")
    if rep["mib_s"]["median"] is not None:
        print(f"{'median':>6} {rep['round_s']['median']:>9.4f} {rep['mib_s']['median']:>9.1f}")
    print(f"matchmaking (median, not in the round time): {rep['match_s']['median']} s; failed rounds: "
          f"{rep['failures']}")
    print(f"relative L2 error vs exact mean (max over peers, last round): {rep['rel_err']:.3g}   "
          f"identical on all peers: {'yes' if rep['identical'] else 'NO'}")
    pm = rep["peer_mismatch"]
    if pm["elements"]:
        print(f"  (last round: up to {pm['elements']} of {pm['of']} elements differ from peer 0's, "
              f"by at most {pm['max_abs']:.3g})")
    print("peak RSS per peer incl. its hivemind processes and p2pd (MiB): "
          + ", ".join("-" if x is None else f"{x:.0f}" for x in rep["peak_rss_mib"]))
    au = rep["loopback_audit"]
    print(f"loopback audit: {au['sockets']} inet sockets in {au['processes']} processes, 0 non-loopback")
    for e in rep["errors"]:
        print(f"error: {e}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, default=4, help="number of hivemind peers (>= 2)")
    p.add_argument("--mb", type=float, default=64.0, help="fp32 tensor size per peer in MiB")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up rounds")
    p.add_argument("--compression", choices=COMPRESSIONS, default="none",
                   help="hivemind wire compression (its 8-bit codecs are broken under NumPy 2)")
    p.add_argument("--seed", type=int, default=0, help="data seed")
    p.add_argument("--min-matchmaking-time", type=float, default=2.0,
                   help="hivemind min_matchmaking_time (a full group starts at once anyway)")
    p.add_argument("--match-timeout", type=float, default=60.0, help="matchmaking timeout per round (s)")
    p.add_argument("--allreduce-timeout", type=float, default=120.0, help="all-reduce timeout per round (s)")
    p.add_argument("--timeout", type=float, default=600.0, help="overall timeout in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.add_argument("--loglevel", default="ERROR", help="hivemind log level in the peers (HIVEMIND_LOGLEVEL)")


def run(args) -> int:
    """Run the baseline; call this only in a process without libp2p (``python -m`` it)."""
    if getattr(args, "worker", False):
        from p2ptrain.bench.hivemind_peer import worker

        return worker(args)
    if args.peers < 2:
        fail("--peers must be at least 2")
    if args.rounds < 1 or args.warmup < 0 or args.mb <= 0:
        fail("--rounds must be >= 1, --warmup >= 0 and --mb positive")
    try:
        spec = importlib.util.find_spec("hivemind")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        fail(INSTALL_HINT, 2)
    try:
        import psutil  # noqa: F401  (a hivemind dependency)
    except ImportError:
        fail(f"psutil is missing; {INSTALL_HINT}", 2)
    work = tempfile.mkdtemp(prefix="p2ptrain-bench-hm-allreduce-")
    try:
        with Watchdog(args.timeout, "hivemind all-reduce benchmark",
                      on_timeout=lambda: shutil.rmtree(work, ignore_errors=True)):
            parent = Parent(args, work)
            error = None
            try:
                rep = _measure(parent)
            except BenchError as e:
                error = str(e)
            finally:
                parent.shutdown()  # idempotent; also on KeyboardInterrupt
            if error:
                fail(error, 2 if "hivemind is not installed" in error else 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(rep, separators=(",", ":")), flush=True)
    else:
        _print_table(rep)
    if rep["mib_s"]["median"] is None:
        print("error: no successful all-reduce round", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m p2ptrain.bench.hivemind_allreduce",
                                description=__doc__.split("\n\n")[0])
    add_arguments(p)
    w = p.add_argument_group("internal (one peer)")
    w.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    w.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    w.add_argument("--run-id", default="x", help=argparse.SUPPRESS)
    w.add_argument("--initial-peers", default="", help=argparse.SUPPRESS)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
