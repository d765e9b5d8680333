"""hivemind DHT latency baseline on loopback.

    python -m p2ptrain.bench.hivemind_dht --nodes 10 --ops 50 [--json]

Starts N hivemind DHT nodes (each a Python process plus a Go p2pd daemon) that listen on
127.0.0.1 only, the first node being the initial peer of all others, waits until they know each
other, and then times, after a short warm-up, ``--ops`` operations of each kind:

  store          node A stores a fresh key as a multi-writer dictionary value (key, subkey),
                 expiration now + 60 s; DHT.store returns after the replication acks
  store_plain    the same with a plain (non-dictionary) value
  get_local      node A reads its own key back, latest=False
  get_local_latest   ... latest=True (always traverses the DHT to find the newest record)
  get_remote     another node B reads A's key, latest=False   <- the apples-to-apples figure
  get_remote_latest  B reads a second fresh key of A's, latest=True
  get_remote_plain   B reads A's plain-value key, latest=False
  get_missing    B looks up a key that nobody stored (full traversal, must return None)

Every remote read is the first access of that key on B, so B's get cache never answers it; B
may still hold the record because it was one of the ``num_replicas`` (hivemind default 5) nodes
chosen by the store: how often that happened is reported as ``remote_reader_held_record``. With
5 nodes or fewer every node is a replica holder, so a "remote" get is answered locally.

Times are wall-clock around the public ``hivemind.DHT`` calls made from the parent process, so
they include hivemind's pipe round trip to the DHT process, as any hivemind user would see.
A get that does not return the stored value (or a missing-key get that returns one), an
exception or a per-op timeout counts as a failure; latency statistics cover successful ops only.

This module imports hivemind only (never libp2p: both register the protobuf symbol
``crypto.pb.KeyType`` and cannot share a process) and otherwise the standard library.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import threading
import time
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

from p2ptrain.bench._hivemind_common import (
    merge_audits,
    LOOPBACK_P2P_KWARGS,
    Watchdog,
    audit_loopback,
    fail,
    import_hivemind,
    kill_descendants,
    maddrs_are_loopback,
    remaining_descendants,
    summarize,
)

METRICS = [
    ("store", "store (dict value + subkey), node A"),
    ("store_plain", "store (plain value), node A"),
    ("get_local", "get own key, node A, latest=False"),
    ("get_local_latest", "get own key, node A, latest=True"),
    ("get_remote", "get A's key, node B, latest=False"),
    ("get_remote_latest", "get A's key, node B, latest=True"),
    ("get_remote_plain", "get A's plain key, node B"),
    ("get_missing", "get missing key, node B"),
]


# --- coroutines executed inside a DHT process via DHT.run_coroutine (module-level: picklable) ---


async def _routing_table_size(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _holds_record(_dht, node, key: str) -> bool:
    from hivemind.dht.routing import DHTID

    key_id = DHTID.generate(source=key)
    return node.protocol.storage.get(key_id) is not None or node.protocol.cache.get(key_id) is not None


async def _num_replicas(_dht, node) -> int:
    return node.num_replicas


# --- parent-side helpers ----------------------------------------------------------------------


def _timed(fn, timeout: float) -> Tuple[float, Any, Optional[str]]:
    """Run fn() (which returns an MPFuture), wait up to timeout. Returns (ms, result, error)."""
    t0 = time.perf_counter()
    try:
        result = fn().result(timeout=timeout)
        err = None
    except Exception as e:  # TimeoutError, P2P errors, ...
        result, err = None, f"{type(e).__name__}: {e}"
    return (time.perf_counter() - t0) * 1000.0, result, err


def _dict_value_ok(found, subkey: str, expected: str) -> bool:
    if found is None:
        return False
    value = getattr(found, "value", None)
    if not isinstance(value, dict) or subkey not in value:
        return False
    entry = value[subkey]
    return getattr(entry, "value", None) == expected


def _plain_value_ok(found, expected: str) -> bool:
    return found is not None and getattr(found, "value", None) == expected


class Bench:
    def __init__(self, hivemind, args):
        self.hm = hivemind
        from hivemind.utils.timed_storage import get_dht_time

        self.get_dht_time = get_dht_time
        self.args = args
        self.run_id = secrets.token_hex(4)
        self.dhts: List[Any] = []
        self.samples: Dict[str, List[float]] = {name: [] for name, _ in METRICS}
        self.failures: Dict[str, int] = {name: 0 for name, _ in METRICS}
        self.first_errors: Dict[str, str] = {}
        self.held = {"get_remote": 0, "get_remote_latest": 0, "get_remote_plain": 0}
        # remote-get samples split by whether B already held the record (replica or cache)
        self.split: Dict[str, Dict[str, List[float]]] = {m: {"held": [], "not_held": []} for m in self.held}
        self.info: Dict[str, Any] = {}

    # -- lifecycle --

    def start(self) -> None:
        a = self.args
        t0 = time.perf_counter()
        first = self.hm.DHT(start=True, **LOOPBACK_P2P_KWARGS)
        self.dhts.append(first)
        peers = [str(m) for m in first.get_visible_maddrs()]
        if not peers or not maddrs_are_loopback(peers):
            raise RuntimeError(f"first DHT node announces non-loopback or no addresses: {peers}")
        others = [self.hm.DHT(initial_peers=peers, start=False, **LOOPBACK_P2P_KWARGS) for _ in range(a.nodes - 1)]
        for d in others:
            d.run_in_background(await_ready=False)
            self.dhts.append(d)
        for d in others:
            d.wait_until_ready(timeout=a.op_timeout * 2)
        self.info["startup_s"] = round(time.perf_counter() - t0, 3)

        # Connected = every node has peers in its routing table and the initial peer knows all others.
        deadline = time.monotonic() + a.connect_timeout
        while True:
            sizes = [d.run_coroutine(_routing_table_size) for d in self.dhts]
            if min(sizes) >= 1 and sizes[0] >= a.nodes - 1:
                break
            if time.monotonic() > deadline:
                if min(sizes) < 1:
                    raise RuntimeError(f"DHT nodes did not connect within {a.connect_timeout} s: {sizes}")
                break
            time.sleep(0.2)
        self.info["connect_s"] = round(time.perf_counter() - t0, 3)
        self.info["routing_table_sizes"] = sizes
        maddrs = [str(m) for d in self.dhts for m in d.get_visible_maddrs()]
        if not maddrs_are_loopback(maddrs):
            raise RuntimeError(f"a DHT node announces a non-loopback address: {maddrs}")
        self.info["num_replicas"] = first.run_coroutine(_num_replicas)

    def shutdown(self) -> int:
        threads = [threading.Thread(target=d.shutdown, daemon=True) for d in self.dhts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=15)
        deadline = time.monotonic() + 5
        while remaining_descendants() and time.monotonic() < deadline:
            time.sleep(0.1)
        return kill_descendants() if remaining_descendants() else 0

    # -- measurement --

    def _record(
        self, metric: str, ms: float, ok: bool, err: Optional[str], measure: bool, held: Optional[bool] = None
    ) -> None:
        if not measure:
            return
        if ok:
            self.samples[metric].append(ms)
            if held is not None:
                self.split[metric]["held" if held else "not_held"].append(ms)
        else:
            self.failures[metric] += 1
            self.first_errors.setdefault(metric, err or "value not returned")

    def one_op(self, i: int, measure: bool) -> None:
        a = self.args
        A = self.dhts[1]
        B = self.dhts[-1] if len(self.dhts) >= 3 else self.dhts[0]
        tag = f"p2ptrain-bench-{self.run_id}-{'op' if measure else 'warm'}{i}"
        subkey = f"writer-{i}"
        exp = lambda: self.get_dht_time() + a.expiration  # noqa: E731

        # stores (from A)
        kx, ky, kp, km = f"{tag}-x", f"{tag}-y", f"{tag}-p", f"{tag}-missing"
        vx, vy, vp = f"vx{i}", f"vy{i}", f"vp{i}"
        ms, ok, err = _timed(lambda: A.store(kx, vx, exp(), subkey=subkey, return_future=True), a.op_timeout)
        self._record("store", ms, bool(ok), err, measure)
        # second dictionary key, only so that B's latest=True read is also a first access (untimed)
        _, ok_y, _ = _timed(lambda: A.store(ky, vy, exp(), subkey=subkey, return_future=True), a.op_timeout)
        ms, ok, err = _timed(lambda: A.store(kp, vp, exp(), return_future=True), a.op_timeout)
        self._record("store_plain", ms, bool(ok), err, measure)

        # gets from A (its own key)
        ms, res, err = _timed(lambda: A.get(kx, latest=False, return_future=True), a.op_timeout)
        self._record("get_local", ms, _dict_value_ok(res, subkey, vx), err, measure)
        ms, res, err = _timed(lambda: A.get(kx, latest=True, return_future=True), a.op_timeout)
        self._record("get_local_latest", ms, _dict_value_ok(res, subkey, vx), err, measure)

        # gets from B: first access of each key on B; note whether B was a replica holder
        held = {}
        if measure:
            for metric, key in (("get_remote", kx), ("get_remote_latest", ky), ("get_remote_plain", kp)):
                held[metric] = bool(B.run_coroutine(partial(_holds_record, key=key)))
                self.held[metric] += held[metric]
        ms, res, err = _timed(lambda: B.get(kx, latest=False, return_future=True), a.op_timeout)
        self._record("get_remote", ms, _dict_value_ok(res, subkey, vx), err, measure, held.get("get_remote"))
        ms, res, err = _timed(lambda: B.get(ky, latest=True, return_future=True), a.op_timeout)
        ok = bool(ok_y) and _dict_value_ok(res, subkey, vy)
        self._record("get_remote_latest", ms, ok, err, measure, held.get("get_remote_latest"))
        ms, res, err = _timed(lambda: B.get(kp, latest=False, return_future=True), a.op_timeout)
        self._record("get_remote_plain", ms, _plain_value_ok(res, vp), err, measure, held.get("get_remote_plain"))
        ms, res, err = _timed(lambda: B.get(km, latest=False, return_future=True), a.op_timeout)
        self._record("get_missing", ms, err is None and res is None, err, measure)

    def run(self) -> None:
        for i in range(self.args.warmup):
            self.one_op(i, measure=False)
        self.info["audit_mid"] = audit_loopback()
        for i in range(self.args.ops):
            self.one_op(i, measure=True)


def _print_table(report: Dict[str, Any], ops: int) -> None:
    print(
        f"hivemind {report['hivemind_version']} DHT on loopback: {report['nodes']} nodes, "
        f"{ops} ops per metric after {report['warmup']} warm-up ops, num_replicas={report['num_replicas']}"
    )
    print(f"startup {report['startup_s']:.2f} s, connected after {report['connect_s']:.2f} s, "
          f"routing table sizes {report['routing_table_sizes']}")
    header = f"{'operation':<40} {'median ms':>10} {'p90 ms':>10} {'ok':>6} {'failed':>7}"
    print(header)
    print("-" * len(header))
    for name, label in METRICS:
        s = report[f"{name}_ms"]
        med = "-" if s["median"] is None else f"{s['median']:.2f}"
        p90 = "-" if s["p90"] is None else f"{s['p90']:.2f}"
        print(f"{label:<40} {med:>10} {p90:>10} {s['n']:>6} {report['failures'][name]:>7}")
    held = report["remote_reader_held_record"]
    print("node B already held the record (replica or cache) before its remote get: "
          + ", ".join(f"{k} {v}/{ops}" for k, v in held.items()))
    print(f"{'remote get, split by holder':<40} {'median ms':>10} {'p90 ms':>10} {'ok':>6}")
    for metric, parts in report["get_remote_split_ms"].items():
        for part, s in parts.items():
            med = "-" if s["median"] is None else f"{s['median']:.2f}"
            p90 = "-" if s["p90"] is None else f"{s['p90']:.2f}"
            print(f"{metric + ' (B ' + part.replace('_', ' ') + ')':<40} {med:>10} {p90:>10} {s['n']:>6}")
    audit = report["loopback_audit"]
    print(f"loopback audit: {audit['sockets']} inet sockets in {audit['processes']} processes, "
          f"{audit['non_loopback']} non-loopback")
    if report.get("errors"):
        for k, v in report["errors"].items():
            print(f"first error in {k}: {v}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m p2ptrain.bench.hivemind_dht", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=10, help="number of DHT nodes (>= 2)")
    p.add_argument("--ops", type=int, default=50, help="measured operations per metric")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured warm-up operations")
    p.add_argument("--expiration", type=float, default=60.0, help="record lifetime in seconds")
    p.add_argument("--op-timeout", type=float, default=30.0, help="per-operation timeout in seconds")
    p.add_argument("--connect-timeout", type=float, default=30.0, help="max wait for the swarm to connect")
    p.add_argument("--timeout", type=float, default=300.0, help="overall timeout in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object line instead of a table")
    p.add_argument("--loglevel", default="WARNING", help="hivemind log level (HIVEMIND_LOGLEVEL)")
    args = p.parse_args(argv)
    if args.nodes < 2:
        fail("--nodes must be at least 2")
    if args.ops < 1:
        fail("--ops must be at least 1")

    hivemind = import_hivemind(args.loglevel)

    with Watchdog(args.timeout, "hivemind DHT benchmark"):
        bench = Bench(hivemind, args)
        error: Optional[str] = None
        audit_end: Dict[str, Any] = {}
        try:
            bench.start()
            bench.run()
            audit_end = audit_loopback()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            forced = bench.shutdown()
        if error:
            fail(error)

    audits = [x for x in (bench.info.get("audit_mid"), audit_end) if x]
    non_loopback = [s for x in audits for s in x["non_loopback"]]
    if non_loopback:
        fail(f"non-loopback sockets seen: {non_loopback[:5]}")
    report: Dict[str, Any] = {
        "event": "bench_dht_hivemind",
        "nodes": args.nodes,
        "ops": args.ops,
        "warmup": args.warmup,
        **{f"{name}_ms": summarize(bench.samples[name]) for name, _ in METRICS},
        "failures": bench.failures,
        "remote_reader_held_record": bench.held,
        "get_remote_split_ms": {
            m: {part: summarize(v) for part, v in parts.items()} for m, parts in bench.split.items()
        },
        "num_replicas": bench.info["num_replicas"],
        "routing_table_sizes": bench.info["routing_table_sizes"],
        "startup_s": bench.info["startup_s"],
        "connect_s": bench.info["connect_s"],
        "loopback_audit": merge_audits(audits),
        "forced_kills": forced,
        "hivemind_version": hivemind.__version__,
    }
    if bench.first_errors:
        report["errors"] = bench.first_errors
    if args.json:
        print(json.dumps(report, separators=(",", ":")), flush=True)
    else:
        _print_table(report, args.ops)
    dead = [name for name, _ in METRICS if not bench.samples[name]]
    if dead:
        print(f"error: no successful operation for {', '.join(dead)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
