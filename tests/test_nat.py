"""NAT traversal through real NATs built in network namespaces (tests/netlab.py).

(a) two peers behind port-preserving NATs meet through the DHT, connect via the relay, are
    upgraded by DCUtR, and a 64 MiB push then puts at most 1 % of its bytes on the relay;
(b) behind a fully-random NAT punching fails and the push completes over the relay;
(c) a public and a NATed peer end up directly connected whichever side dials.
The relay's byte counts come from the bootstrap's `relay_bytes` events and are printed.
"""

from __future__ import annotations

import os

import pytest

from netlab import LabUnavailable, nat_lab
from p2ptrain.identity import load_or_create
from p2ptrain.procs import ProcessGroup
from p2ptrain.procs import run as run_cli

pytestmark = [pytest.mark.integration, pytest.mark.netns]
MIB = 1 << 20
PORT = 4001


@pytest.fixture
def lab():
    try:
        with nat_lab() as built:
            yield built
    except LabUnavailable as exc:
        print(f"NAT tests skipped: {exc}")
        pytest.skip(str(exc))


@pytest.fixture
def group(tmp_path):
    with ProcessGroup(tmp_path / "procs") as g:
        yield g


def start_boot(group: ProcessGroup, lab, env: dict | None = None):
    key = group.log_dir / "boot.key"
    boot = group.start(["bootstrap", "--listen", f"/ip4/{lab.boot_ip}/tcp/{PORT}", "--key", str(key), "--json"],
                       "boot", prefix=lab.prefix(lab.boot_ns), env=env)
    return boot, boot.first_line(60)


def start_probe(group: ProcessGroup, lab, ns: str, ip: str, baddr: str, name: str, port: int = PORT,
                *extra: str):
    key = group.log_dir / f"{name}.key"
    pid = load_or_create(key).peer_id_str
    p = group.start(["--bootstrap", baddr, "--listen", f"/ip4/{ip}/tcp/{port}", "--key", str(key), "--json", *extra],
                    name, module="p2ptrain.net.natprobe", stdin=True, prefix=lab.prefix(ns),
                    env={"P2PTRAIN_DEBUG": "1"} if os.environ.get("NAT_DEBUG") else None)
    return p, pid


def ready(p, timeout=60) -> dict:
    return p.wait_event(lambda e: e["event"] == "probe_ready", timeout)


def send(p, to: str, nbytes: int, wait_direct: float, timeout: float = 180) -> dict:
    p.send({"send_to": to, "bytes": nbytes, "wait_direct": wait_direct})
    ev = p.wait_event(lambda e: e["event"] in ("probe_sent", "probe_failed"), timeout)
    assert ev["event"] == "probe_sent", ev
    assert ev["sha_ok"], ev
    return ev


def relayed_between(boot, a: str, b: str, settle: float = 2.5) -> int:
    """Bytes the relay carried between peers a and b (both directions), from its last report."""
    import time

    time.sleep(settle)  # the relay reports once a second
    reports = [e for e in boot.all_events if e["event"] == "relay_bytes"]
    if not reports:
        return 0
    last = reports[-1]
    return sum(c["bytes"] for c in last["circuits"] if {c["src"], c["dst"]} == {a, b})


def _tracker_upgrades(p1, p2, id1: str, id2: str, wait: float = 10.0) -> list[dict]:
    """The nodes' `connection_upgraded` events for the pair. The connection tracker polls the
    connection table, so its event can trail the probe's own observation (once it came after
    the test looked: a full-suite run, 2026-11-26); wait for it, bounded. None at all is right
    only if the tracker never saw the pair relayed (the hole punch beat its first poll), and
    then the probe's own "relayed, then hole-punched" is the evidence."""
    import time

    deadline = time.monotonic() + wait
    while True:
        evs = [e for e in p1.all_events + p2.all_events if e["event"] == "connection_upgraded"]
        if evs or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not evs:
        seen = [e for p, other in ((p1, id2), (p2, id1)) for e in p.all_events
                if e["event"] == "peer_connection" and e.get("remote") == other and e.get("kind") == "relayed"]
        assert not seen, f"the tracker saw the pair relayed but reported no upgrade: {seen}"
        evs = [{"event": "connection_upgraded", "method": "hole-punch", "seen_by": "probe only"}]
    return evs


def test_a_hole_punch_then_bulk_bypasses_relay(lab, group, report):
    boot, baddr = start_boot(group, lab)
    s1, s2 = lab.sites["s1"], lab.sites["s2"]
    p1, id1 = start_probe(group, lab, s1.host, s1.lan_ip, baddr, "h1")
    p2, id2 = start_probe(group, lab, s2.host, s2.lan_ip, baddr, "h2")
    r1, r2 = ready(p1), ready(p2)
    assert r1["reachability"] == r2["reachability"] == "private", (r1, r2)
    assert any("/p2p-circuit" in a for a in r2["addrs"]), r2
    size = 64 * MIB
    ev = send(p1, id2, size, wait_direct=30)
    relayed = relayed_between(boot, id1, id2)
    upgraded = _tracker_upgrades(p1, p2, id1, id2)
    report(f"(a) first connection {ev['first_kind']}, upgraded {upgraded[:1]}, transfer over {ev['kind']}: "
          f"{size} B in {ev['seconds']} s ({ev['mb_per_s']} MB/s); relay carried {relayed} B between the pair "
          f"({100 * relayed / size:.3f} % of the transfer)")
    assert ev["first_kind"] == "relayed", ev
    assert upgraded and upgraded[0]["method"] == "hole-punch", upgraded
    assert ev["kind"] == "direct" and ev["peer_kind"] == "hole-punched", ev
    assert relayed <= size // 100, relayed
    # `p2ptrain status` (run on the public segment) shows how each peer reaches the other.
    shown = status_conns(group, lab, baddr, id1, id2)
    report(f"(a) status: {shown}")
    assert shown == "hole-punched", shown


def status_conns(group: ProcessGroup, lab, baddr: str, peer: str, neighbour: str, timeout: float = 60) -> str | None:
    """Kind of `peer`'s connection to `neighbour` as `p2ptrain status --json` reports it."""
    import json
    import subprocess
    import sys
    import time

    deadline, kind = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        out = subprocess.run([*lab.prefix(lab.open_ns), sys.executable, "-m", "p2ptrain", "status", "--bootstrap", baddr,
                              "--listen", f"/ip4/{lab.open_ip}/tcp/0", "--json"],
                             capture_output=True, text=True, timeout=60, cwd=group.log_dir)
        rows = {r["remote"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["peers"]} if out.stdout else {}
        kind = rows.get(peer, {}).get("conns", {}).get(neighbour)
        if kind == "hole-punched":
            return kind
        time.sleep(1)
    return kind


def test_b_fully_random_nat_falls_back_to_relay(lab, group, report):
    limit = 24 * MIB  # per-circuit byte budget: the first push fits, a second one cannot
    boot, baddr = start_boot(group, lab, env={"P2PTRAIN_RELAY_MAX_CIRCUIT_BYTES": str(limit)})
    s1, s3 = lab.sites["s1"], lab.sites["s3"]
    p1, id1 = start_probe(group, lab, s1.host, s1.lan_ip, baddr, "h1")
    p3, id3 = start_probe(group, lab, s3.host, s3.lan_ip, baddr, "h3")
    ready(p1), ready(p3)
    # 16 MiB, not 64: through a Python relay on 2 loaded cores a relayed push runs at
    # 1-2 MB/s, and this case only has to show the relayed path carries a bulk transfer.
    size = 16 * MIB
    # The push starts at once and runs while DCUtR keeps failing.
    ev = send(p3, id1, size, wait_direct=0)
    relayed = relayed_between(boot, id1, id3)
    report(f"(b) fully-random NAT: transfer over {ev['kind']}: {size} B in {ev['seconds']} s "
          f"({ev['mb_per_s']} MB/s); relay carried {relayed} B between the pair")
    assert ev["first_kind"] == "relayed" and ev["kind"] == "relayed", ev
    assert relayed >= size, relayed
    assert not [e for e in p1.all_events + p3.all_events if e["event"] == "connection_upgraded"]
    # The relay enforces its limit: a second push of twice the budget is cut, on the same
    # circuit or on a fresh one (the relayed connection was once re-dialed between the two
    # pushes, and a fresh circuit had room for a push the size of the first: a full-suite run,
    # 2026-11-26); either way no circuit carries more than its budget.
    p3.send({"send_to": id1, "bytes": 2 * limit, "wait_direct": 0})
    cut = p3.wait_event(lambda e: e["event"] in ("probe_sent", "probe_failed"), 180)
    after = relayed_between(boot, id1, id3)
    report(f"(b) with a {limit} B circuit budget a second push of {2 * limit} B ends with {cut['event']}; "
          f"relay carried {after} B for the pair ({after - relayed} B of it for the second push)")
    assert cut["event"] == "probe_failed", cut
    assert after - relayed <= limit + MIB, (relayed, after)


def test_c_public_and_natted_peer_connect_directly_both_ways(lab, group, report):
    boot, baddr = start_boot(group, lab)
    s1 = lab.sites["s1"]
    po, ido = start_probe(group, lab, lab.open_ns, lab.open_ip, baddr, "open")
    p1, id1 = start_probe(group, lab, s1.host, s1.lan_ip, baddr, "h1")
    ro, r1 = ready(po), ready(p1)
    assert ro["reachability"] == "public" and r1["reachability"] == "private", (ro, r1)
    size = 4 * MIB
    natted_dials = send(p1, ido, size, wait_direct=30)  # waits only while the connection is relayed
    # Our own dial to a public peer is direct from the start. If the public peer reached us
    # first (through our relay, for the DHT), that connection is reused until DCUtR upgrades it.
    if natted_dials["existing"] is None:
        assert natted_dials["first_kind"] == "direct", natted_dials
    assert natted_dials["kind"] == "direct", natted_dials
    # The other direction with fresh processes: the public peer can only reach the NATed one
    # through its relay address; DCUtR then reverses the connection into a direct one.
    for p in (po, p1):
        p.stop()
    # The public peer is a DHT client here, so the NATed one has no reason to dial it first.
    p1, id1 = start_probe(group, lab, s1.host, s1.lan_ip, baddr, "h1b", PORT + 1)
    ready(p1)
    po, ido = start_probe(group, lab, lab.open_ns, lab.open_ip, baddr, "open2", PORT + 1, "--dht-client")
    ready(po)
    public_dials = send(po, id1, size, wait_direct=30)
    relayed = relayed_between(boot, ido, id1)
    report(f"(c) NATed->public: first {natted_dials['first_kind']} (connection already there: "
           f"{natted_dials['existing']}), bytes went {natted_dials['kind']}; public->NATed: first "
          f"{public_dials['first_kind']}, then {public_dials['peer_kind']}; relay carried {relayed} B "
          f"for the second pair ({size} B pushed)")
    assert public_dials["kind"] == "direct", public_dials
    assert relayed <= size // 100, relayed
    # Only the relay reaches a NATed peer, then DCUtR reverses the connection: unless the NATed
    # peer had already dialed us directly (seen once under load), which leaves nothing to reverse,
    # or DCUtR had already reversed the relayed connection the DHT opened before the probe sent
    # (CI stop 51: existing "hole-punched"), which is the reversal this case exists to show.
    if public_dials["existing"] == "hole-punched":
        assert public_dials["first_kind"] == "hole-punched", public_dials
    elif public_dials["existing"] != "direct":
        assert public_dials["first_kind"] == "relayed", public_dials
        # Reversed: the probe saw its relayed connection turn direct before it sent (it polls
        # every 0.1 s). The tracker's `connection_upgraded` event (either side) polls more
        # slowly and missed a fast upgrade once (CI-like run, load ~2), so it is not required.
        reversed_ = [e for q in (po, p1) for e in q.all_events if e["event"] == "connection_upgraded"]
        assert public_dials["peer_kind"] in ("direct", "hole-punched") or reversed_, public_dials


def test_training_run_through_nats(lab, group, tmp_path, report):
    """A bootstrap and 3 NATed trainers (one behind the fully-random NAT) commit 2 outer steps."""

    out = run_cli(
        ["init", "--out", str(tmp_path / "run"), "--key", str(tmp_path / "init.key"),
         "--inner-steps", "4", "--batch-size", "4", "--seq-len", "64", "--warmup", "2", "--planned-outer-steps", "4",
         "--join-window", "20", "--group-size", "3", "--seed", "5"],
        timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip().splitlines()[-1]
    boot, baddr = start_boot(group, lab)
    peers = []
    for i, site in enumerate(("s1", "s2", "s3")):
        s = lab.sites[site]
        work = group.log_dir / f"t{i}"
        work.mkdir(parents=True, exist_ok=True)
        which = ["--manifest", str(tmp_path / "run" / "run.toml")] if i == 0 else ["--run", rid]
        peers.append(group.start(["join", "--bootstrap", baddr, "--listen", f"/ip4/{s.lan_ip}/tcp/{PORT}",
                                  "--workdir", str(work), *which, "--max-outer-steps", "2", "--min-peers", "3",
                                  "--threads", "1", "--json"], f"t{i}", prefix=lab.prefix(s.host)))
    commits = [[p.wait_event(lambda e, st=st: e["event"] == "outer_step_committed" and e["step"] == st, 300)
                for p in peers] for st in (1, 2)]
    for evs in commits:
        assert len({e["params_sha256"] for e in evs}) == 1, evs
    kinds = {}
    for p in peers:
        for e in p.all_events:
            if e["event"] == "peer_connection":
                kinds[(p.name, e["remote"][-6:])] = e["kind"]
    reports = [e for e in boot.all_events if e["event"] == "relay_bytes"]
    report(f"training through NATs: 2 outer steps committed by 3 NATed peers; connection kinds {kinds}; "
          f"relay total {reports[-1]['total'] if reports else 0} B")
