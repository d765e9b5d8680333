"""The emulated internet (p2ptrain/bench/inetlab.py): it builds and leaves nothing behind, its
shapers really hold a link to its rate (both directions), and a real verified all-reduce
round between three peer processes in it commits identical results.

Band for the shaped rate: plain TCP goodput / nominal rate within [0.85, 1.02]. TCP/IP and
Ethernet headers cost ~4.5 % of the wire bytes tbf counts (measured 0.957 at 50 Mbit/s), and a
busy shared machine can only slow the transfer, so the lower edge leaves room for that.
"""

from __future__ import annotations

import numpy as np
import pytest

from p2ptrain.bench import inetlab
from p2ptrain.bench.inetlab import TCP_COUNTERS, internet_lab, tcp_counters, tcp_goodput
from p2ptrain.net import netns
from p2ptrain.procs import ProcessGroup
from p2ptrain.procs import run as run_cli

pytestmark = [pytest.mark.integration, pytest.mark.netns]

REASON = inetlab.unavailable_reason()
skip_without_lab = pytest.mark.skipif(REASON is not None, reason=f"emulated internet unavailable: {REASON}")


def _ours(tag: str) -> list[str]:
    return [n for n in netns.list_namespaces() if n.startswith(f"{inetlab.FAMILY}{tag}")]


def test_config_rejects_bad_rates():
    with pytest.raises(ValueError):
        inetlab.LabConfig([0.0])
    with pytest.raises(ValueError):
        inetlab.LabConfig([])
    cfg = inetlab.LabConfig([100, (50, None), None])
    assert cfg.rates_mbit == [(100.0, 100.0), (50.0, None), (None, None)]
    # The bound: 4 members each send 1.5 x 12.5 MB through a 100 Mbit/s link -> 1.5 s.
    assert inetlab.bandwidth_bound_s(12.5e6, 4, 100) == pytest.approx(1.5)


@skip_without_lab
def test_lab_builds_shapes_and_tears_down_even_on_failure():
    with pytest.raises(RuntimeError, match="boom"):
        with internet_lab([100, (50, None)], boot=True) as lab:
            tag = lab.tag
            assert sorted(_ours(tag)) == sorted(lab.namespaces) and len(lab.namespaces) == 4
            assert lab.ip(1) == "10.78.0.11" and lab.boot_ip == "10.78.0.1"
            up = netns.sh("tc", "qdisc", "show", "dev", "eth0", ns=lab.ns(0))
            down = netns.sh("tc", "qdisc", "show", "dev", "p0", ns=lab.net_ns)
            assert "tbf" in up and "100Mbit" in up and "tbf" in down and "100Mbit" in down
            assert "tbf" not in netns.sh("tc", "qdisc", "show", "dev", "p1", ns=lab.net_ns)  # unshaped down
            out = netns.sh("ip", "-br", "addr", "show", "eth0", ns=lab.boot_ns)
            assert "10.78.0.1/24" in out
            raise RuntimeError("boom")
    assert _ours(tag) == [], "namespaces left behind after a failure inside the lab"


@skip_without_lab
def test_shaping_limits_throughput_both_ways():
    nbytes = 12_000_000  # ~2 s at 50 Mbit/s
    with internet_lab([(50, None), (None, 50), None, None], boot=False) as lab:
        before = tcp_counters(lab)  # the bench's per-row retransmission counters parse here
        up = tcp_goodput(lab, 0, 2, nbytes)    # limited by peer 0's uplink
        down = tcp_goodput(lab, 2, 1, nbytes)  # limited by peer 1's downlink
        free = tcp_goodput(lab, 2, 3, nbytes)  # unshaped both ends
        stats0, stats1 = lab.link_stats(0), lab.link_stats(1)
        after = tcp_counters(lab)
    assert set(before) == set(after) == set(TCP_COUNTERS)
    assert all(after[k] >= before[k] >= 0 for k in TCP_COUNTERS), (before, after)
    print(f"goodput at 50 Mbit/s: up {up['mbit']} ({up['mbit'] / 50:.3f}x), down {down['mbit']} "
          f"({down['mbit'] / 50:.3f}x); unshaped {free['mbit']} Mbit/s")
    assert 0.85 <= up["mbit"] / 50 <= 1.02, up
    assert 0.85 <= down["mbit"] / 50 <= 1.02, down
    assert free["mbit"] >= 5 * 50, free  # measured ~7700 Mbit/s unshaped on an idle machine
    assert stats0["up"]["bytes"] >= nbytes and stats1["down"]["bytes"] >= nbytes


def _worker(group: ProcessGroup, lab, i: int):
    ip = lab.ip(i)
    return group.start(["--listen", f"/ip4/{ip}/tcp/0", "--bulk-ip", ip], f"w{i}",
                       module="p2ptrain.bench.allreduce_worker", stdin=True, prefix=lab.prefix(i))


@skip_without_lab
def test_verified_allreduce_commits_identically_in_the_lab(tmp_path):
    from p2ptrain.bench.allreduce_worker import make_tensor

    n, world = 1 << 20, 3  # 4 MiB fp32, ~1 MiB on the wire in int8: ~0.25 s at 100 Mbit/s
    with internet_lab([100] * world, boot=False) as lab, ProcessGroup(tmp_path / "procs") as group:
        ws = [_worker(group, lab, i) for i in range(world)]
        ready = [w.wait_event(lambda e: e["event"] == "worker_ready", 60) for w in ws]
        members = [[r["peer"], r["addrs"][0]] for r in ready]
        assert all(f"/ip4/{lab.ip(i)}/" in m[1] for i, m in enumerate(members))
        for i, w in enumerate(ws):
            w.send({"cmd": "round", "round": "r1", "members": members, "seed": 10 + i, "n": n,
                    "mode": "int8", "verified": True})
        res = [w.wait_event(lambda e: e.get("round") == "r1" and e["event"] in ("round_committed", "round_failed"),
                            60) for w in ws]
        assert all(r["event"] == "round_committed" for r in res), res
        assert len({r["digest"] for r in res}) == 1
        ws[0].send({"cmd": "dump", "path": str(tmp_path / "out.npy")})
        ws[0].wait_event(lambda e: e["event"] == "dumped", 30)
        shaped = [lab.link_stats(i)["up"]["bytes"] for i in range(world)]
        for w in ws:
            w.send({"cmd": "exit"})
    exact = sum(make_tensor(10 + i, n).astype(np.float64) for i in range(world)) / world
    got = np.load(tmp_path / "out.npy")
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.01
    # Every member's share of the ring (2(W-1)/W x ~1 MiB) went through its shaped uplink.
    assert min(shaped) >= 2 * (world - 1) / world * n * 0.9, shaped


@skip_without_lab
def test_namespaces_of_a_dead_run_are_removed_on_entry():
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{inetlab.FAMILY}{dead.pid}_dead-net"
    netns.sh("ip", "netns", "add", stale)
    try:
        with internet_lab([None], boot=False):
            assert stale not in netns.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=20)


@skip_without_lab
def test_a_traced_bench_row_has_every_members_timeline_in_order(tmp_path):
    """`bench allreduce --trace` on the verified path: each member's milestones are there and
    in the order a round runs them (`p2ptrain.reduce.roundtrace`), medians and the slowest
    round's own."""
    from p2ptrain.bench.allreduce import measure_ours

    world = 3
    with internet_lab([200] * world, boot=False) as lab:
        r = measure_ours(world, 4, 2, "int8", True, tmp_path, verified=True, lab=lab, trace=True)
    assert r["identical"]
    slowest = r["timeline_slowest_ms"]
    assert slowest["round_s"] == max(r["round_s"]["all"]) and len(slowest["members"]) == world
    for tl in r["timeline_ms"] + slowest["members"]:
        steps = [tl[f"step{s}"] for s in range(2 * world - 2)]
        assert steps == sorted(steps)
        assert tl["first_seal"] <= tl["first_send"] <= tl["last_send"] <= tl["data"]
        assert tl["signed"] <= tl["headers"] <= tl["check"] and steps[-1] <= tl["data"]
        assert tl["data"] <= tl["vote0_sent"] <= tl["votes"] <= tl["end"]
        assert 0 < tl["first_send"] < tl["end"] < 1000 * max(r["round_s"]["all"]) + 1


@skip_without_lab
def test_readpause_bench_times_every_mode_on_a_shaped_link():
    """`bench readpause`: every mode's rounds come back, none faster than the link can carry
    its frames (so the shaper, not loopback, carried them), and the CLI prints its summary."""
    import json

    from p2ptrain.bench import readpause

    mbit, frames = 200.0, 3
    times = readpause.measure(mbit, 30.0, frames, 2)
    assert sorted(times) == sorted(readpause.MODES) and all(len(v) == 2 for v in times.values())
    wire = frames * readpause._frame_bytes() * 8 / (mbit * 1e6)
    assert all(wire * 0.95 < t < 30 for v in times.values() for t in v)
    out = run_cli(["bench", "readpause", "--mbit", "200", "--frames", "3",
                   "--rounds", "1", "--json"], timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["event"] == "bench_readpause_summary" and summary["frames"] == 3
