"""Integration tier: real `p2ptrain` processes talking real libp2p on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import time

import pytest
import trio

from conftest import start_bootstrap, start_peer
from p2ptrain.clock import wall_time
from p2ptrain.dht.libp2p_rpc import Libp2pRpc
from p2ptrain.dht.record import Record, make_record, signing_payload
from p2ptrain.identity import Identity, peer_id_from_str
from p2ptrain.net.node import NodeConfig, build_host, parse_peer_maddr
from p2ptrain.records.keys import presence as presence_key
from p2ptrain.procs import run as run_cli

pytestmark = pytest.mark.integration
N = 10


def status(bootstrap: str, cwd) -> dict:
    out = run_cli(["status", "--bootstrap", bootstrap, "--json"],
                  timeout=60, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return {p["remote"]: p for p in json.loads(out.stdout.strip().splitlines()[-1])["peers"]}


def wait_all_discovered(peers, ids, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p, pid in zip(peers, ids):
        want = set(ids) - {pid}
        got = {e["remote"] for e in p.all_events if e["event"] == "peer_discovered"}
        while not want <= got:
            ev = p.wait_event(lambda e: e["event"] == "peer_discovered", max(0.1, deadline - time.monotonic()))
            got.add(ev["remote"])


def test_ten_nodes_find_each_other_and_survive_bootstrap_death(procs, tmp_path):
    boot, baddr = start_bootstrap(procs)
    peers = [start_peer(procs, baddr, f"n{i}") for i in range(N)]
    listening = [p.wait_event(lambda e: e["event"] == "listening", 90) for p in peers]
    ids = [ev["peer"] for ev in listening]
    addrs = [ev["addrs"][0] for ev in listening]
    for p in peers:
        p.wait_event(lambda e: e["event"] == "dht_ready", 90)
    wait_all_discovered(peers, ids, 120)

    boot.kill(signal.SIGKILL)
    boot.proc.wait(10)

    # A record stored after the bootstrap died (a newcomer entering through node 3's address)
    # is readable through other nodes, and so are records stored before.
    late = start_peer(procs, addrs[3], "late")
    late_id = late.wait_event(lambda e: e["event"] == "listening", 90)["peer"]
    late.wait_event(lambda e: e["event"] == "dht_ready", 60)
    peers[7].wait_event(lambda e: e["event"] == "peer_discovered" and e["remote"] == late_id, 60)
    seen = status(addrs[5], tmp_path)
    assert set(seen) == set(ids) | {late_id}
    assert seen[ids[0]]["addrs"] == [addrs[0].split("/p2p/")[0]]


def _hostile(attacker: Identity, victim: bytes, now: float) -> dict[str, bytes]:
    key = presence_key("lobby")
    good = make_record(attacker, key, b"x", now + 60)
    forged = Record(key, good.subkey, b"tampered", good.expiry, good.signer, good.signature)
    foreign = Record(key, victim, b"y", now + 60, attacker.public,
                     attacker.sign(signing_payload(key, victim, b"y", now + 60)))
    expired = make_record(attacker, key, b"z", now - 5)
    huge = Record(key, attacker.peer_id, b"\0" * (1 << 20), now + 60, attacker.public, b"\0" * 64)
    return {"bad-signature": forged.encode(), "foreign-subkey": foreign.encode(),
            "expired": expired.encode(), "oversize": huge.encode()}


async def _attack(targets: list[str], victim: bytes) -> dict[str, dict]:
    attacker = Identity.generate()
    host = build_host(attacker, NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    outcome: dict[str, dict] = {}
    async with host.run([__import__("multiaddr").Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        rpc = Libp2pRpc(host)
        records = _hostile(attacker, victim, wall_time())
        for target in targets:
            pid, addr = parse_peer_maddr(target)
            await rpc.connect(pid, [addr], 10)
            results = {}
            for reason, raw in records.items():
                try:
                    reply = await rpc.call(pid, "store", {"records": [raw]}, 10)
                    results[reason] = reply["results"][0]
                except Exception as exc:  # the oversize frame makes the node reset the stream
                    results[reason] = f"dropped: {exc}"
            results["after"] = await rpc.call(pid, "get", {"key": presence_key("lobby")}, 10)
            outcome[target] = results
    return outcome


def test_every_node_rejects_hostile_records_with_logged_reason(procs, tmp_path):
    boot, baddr = start_bootstrap(procs)
    peers = [start_peer(procs, baddr, f"n{i}") for i in range(4)]
    listening = [p.wait_event(lambda e: e["event"] == "listening", 90) for p in peers]
    for p in peers:
        p.wait_event(lambda e: e["event"] == "dht_ready", 90)
    targets = [baddr] + [ev["addrs"][0] for ev in listening]
    victim = peer_id_from_str(listening[0]["peer"])
    outcome = trio.run(_attack, targets, victim)
    for target, results in outcome.items():
        assert results["bad-signature"] == "bad-signature"
        assert results["foreign-subkey"] == "foreign-subkey"
        assert results["expired"] == "expired"
        assert results["oversize"].startswith("dropped")
        # Nothing the attacker sent is served; only honest presence records are.
        for raw in results["after"]["records"]:
            from p2ptrain.dht.record import decode
            assert decode(raw).value != b"tampered" and decode(raw).subkey != victim or decode(raw).value != b"y"
    time.sleep(0.5)
    for proc in [boot, *peers]:
        log = proc.stderr_text()
        for reason in ("bad-signature", "foreign-subkey", "expired"):
            assert f"record rejected: reason={reason}" in log, (proc.name, reason)
        assert "frame dropped: reason=oversize" in log, proc.name


def test_bad_input_gives_one_line_error_and_exit_2(tmp_path, procs):
    def run(*args, env=None, timeout=60):
        return run_cli([*args], timeout=timeout, cwd=tmp_path, env=env)

    import os

    r = run("join", "--bootstrap", "not-a-multiaddr", "--key", str(tmp_path / "k"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "cannot parse multiaddr" in r.stderr
    r = run("join", "--bootstrap", "/ip4/127.0.0.1/tcp/4001", "--key", str(tmp_path / "k"))
    assert r.returncode == 2 and "/p2p/" in r.stderr
    dead = "/ip4/127.0.0.1/tcp/9/p2p/" + Identity.generate().peer_id_str
    env = dict(os.environ, P2PTRAIN_NODE_BOOTSTRAP_TIMEOUT="3")
    r = run("join", "--bootstrap", dead, "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(tmp_path / "k"), env=env)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("p2ptrain: error: no bootstrap reachable") and "(" in last
    assert r.stderr.count("unreachable (attempt") >= 2  # retried with backoff, each attempt logged
    boot, baddr = start_bootstrap(procs)
    port = baddr.split("/tcp/")[1].split("/")[0]
    r = run("join", "--bootstrap", baddr, "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--key", str(tmp_path / "k"))
    assert r.returncode == 2 and "address already in use" in r.stderr.strip().splitlines()[-1]
    os.chmod(tmp_path / "k", 0o644)
    r = run("join", "--bootstrap", baddr, "--key", str(tmp_path / "k"))
    assert r.returncode == 2 and "chmod 600" in r.stderr
