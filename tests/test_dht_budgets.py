"""DHT budgets against Sybils (issue 32, item 2), on the in-memory transport under trio's
autojump clock: replies that big or early records cannot fill, byte budgets per writer,
sender, key and node, a full key that still admits newcomers, cached signature checks,
and expiry horizons per kind of key."""

from __future__ import annotations

import pytest
import trio

from conftest import trio_test
from p2ptrain.clock import wall_time
from p2ptrain.dht import record as record_mod
from p2ptrain.dht.node import DHTConfig, DHTNode
from p2ptrain.dht.record import make_record
from p2ptrain.dht.transport import MemoryNetwork
from p2ptrain.identity import Identity
from p2ptrain.records import keys
from test_dht_memory import join_all, make_swarm


def _ident(tag: int, i: int) -> Identity:
    return Identity.from_seed(tag.to_bytes(2, "big") + i.to_bytes(4, "big") + b"\0" * 26)


async def _store_raw(net: MemoryNetwork, sender: Identity, node: DHTNode, recs) -> list[str]:
    t = net.nodes.get(sender.peer_id) or net.transport(sender.peer_id)
    out: list[str] = []
    for i in range(0, len(recs), 4):  # 4 records of 64 KiB fit one frame
        reply = await t.call(node.identity.peer_id, "store", {"records": [r.encode() for r in recs[i:i + 4]]}, 5.0)
        out += reply["results"]
    return out


@trio_test()
async def test_big_records_stored_first_do_not_hide_small_ones():
    """Eight ~60 KiB records, each written by its own identity over its own connection, land
    on the replicas before ten honest ones. Replies were insertion order cut at 256 KiB, so a
    reader that is not a replica saw none of the honest records."""
    net, nodes = make_swarm(12)
    await join_all(nodes)
    key = "/p2ptrain/r/manifest"  # a kind of key whose records may be 64 KiB
    big = []
    for i in range(8):
        ident = _ident(7, i)
        node = DHTNode(ident, net.transport(ident.peer_id), server=False)
        await node.bootstrap([(nodes[0].identity.peer_id, [])])
        rec = make_record(ident, key, b"\xee" * 60_000, wall_time() + 600)
        big.append(rec.subkey)
        assert await node.store_record(rec) >= 3
    honest = nodes[:10]
    for node in honest:
        assert await node.store(key, b"small", ttl=600) >= 3
    rid = _ident(7, 99)  # a client: it holds no records, so everything it reads came in replies
    reader = DHTNode(rid, net.transport(rid.peer_id), server=False)
    await reader.bootstrap([(nodes[11].identity.peer_id, [])])
    got = await reader.get(key)
    assert {n.identity.peer_id for n in honest} <= set(got)
    assert len(set(got) & set(big)) >= 3  # big ones fill what is left of each reply


@trio_test()
async def test_big_ready_records_are_refused_everywhere():
    net, nodes = make_swarm(4)
    await join_all(nodes)
    atk = _ident(8, 0)
    key = keys.ready("r" * 16, 7)
    rec = make_record(atk, key, b"\xee" * 60_000, wall_time() + 600)
    for node in nodes:
        assert await _store_raw(net, atk, node, [rec]) == ["oversize-for-key"]
        assert not node.store_.get(key, wall_time())


@trio_test()
async def test_a_full_key_still_admits_a_new_writer():
    """4,096 subkeys (256 senders, 16 identities each) used to lock every newcomer out of a
    key ('store-full'). Now the newcomer, storing its own record, displaces one of theirs."""
    net, nodes = make_swarm(2)
    await join_all(nodes)
    target = nodes[0]
    key = keys.ready("r" * 16, 3)
    exp = wall_time() + 600
    for s in range(256):
        sender = _ident(9, s)
        recs = [make_record(_ident(10 + s, i), key, b"x", exp) for i in range(16)]
        assert await _store_raw(net, sender, target, recs) == ["ok"] * 16
    assert len(target.store_.get(key, wall_time())) == 4096
    newcomer = nodes[1]
    rec = make_record(newcomer.identity, key, b"honest", exp)
    assert await _store_raw(net, newcomer.identity, target, [rec]) == ["ok"]
    held = {r.subkey for r in target.store_.get(key, wall_time())}
    assert newcomer.identity.peer_id in held and len(held) == 4096
    # A sender that already delivered 16 records there cannot displace anyone: it holds the most.
    more = [make_record(_ident(10, 99), key, b"x", exp)]
    assert await _store_raw(net, _ident(9, 0), target, more) == ["sender-full"]


@trio_test()
async def test_one_writer_holds_a_byte_budget_not_just_a_record_count():
    """1,024 records of 64 KiB per identity (and 100,000 per node: ~6 GiB) fitted within the
    record counts. Bytes are counted now: one identity holds at most 1 MiB on a node."""
    net, nodes = make_swarm(2)
    await join_all(nodes)
    atk = _ident(11, 0)
    recs = [make_record(atk, f"/p2ptrain/f{i}/manifest", b"\xee" * 60_000, wall_time() + 600) for i in range(40)]
    results = await _store_raw(net, atk, nodes[0], recs)
    assert results.count("ok") == 17 and set(results[17:]) == {"writer-full"}
    assert nodes[0].store_.bytes <= DHTConfig().max_bytes_per_writer
    ok = await _store_raw(net, nodes[1].identity, nodes[0],
                          [make_record(nodes[1].identity, "/p2ptrain/f0/manifest", b"y", wall_time() + 600)])
    assert ok == ["ok"]


@trio_test()
async def test_one_sender_cannot_store_for_a_crowd_of_identities():
    """200 identities wrote 99,200 records through one connection at t = 0: the limits were
    per identity only. A remote peer now stores for at most 16 identities on a node."""
    net, nodes = make_swarm(2)
    await join_all(nodes)
    sender = _ident(12, 0)
    exp = wall_time() + 600
    recs = [make_record(_ident(13, i), f"/p2ptrain/s/ready/{i % 5}", b"x", exp) for i in range(200)]
    results = await _store_raw(net, sender, nodes[0], recs)
    assert results.count("ok") == 16 and results.count("sender-full") == 184
    assert len(nodes[0].store_) == 16
    mine = make_record(nodes[1].identity, "/p2ptrain/s/ready/0", b"y", exp)
    assert await _store_raw(net, nodes[1].identity, nodes[0], [mine]) == ["ok"]


@trio_test()
async def test_signature_checks_are_cached(monkeypatch):
    """Each get re-verified every record from every replica, and each replica re-verified
    what it served (up to 256 signatures, 25-58 ms a reply). Now a record is verified once
    when stored and once by a reader, whichever replicas it comes from, however often read."""
    net, nodes = make_swarm(10)
    await join_all(nodes)
    key = keys.ready("r" * 16, 1)
    for node in nodes[:8]:
        await node.store(key, b"r", ttl=600)
    calls = []
    real = record_mod.verify
    monkeypatch.setattr(record_mod, "verify", lambda *a: calls.append(1) or real(*a))
    reader = nodes[9]
    assert len(await reader.get(key)) == 8
    assert len(calls) <= 8
    calls.clear()
    for _ in range(3):
        assert len(await reader.get(key)) == 8
    assert calls == []


@trio_test()
async def test_expiry_horizon_is_bounded_per_kind_of_key():
    """Records could expire up to 24 h ahead under any key. Each kind of key now has its
    own horizon, a few times the TTL its honest writers use; beyond it every node refuses."""
    net, nodes = make_swarm(3)
    await join_all(nodes)
    atk = _ident(14, 0)
    now = wall_time()
    cases = {keys.presence("lobby"): (3600.0, 300.0), keys.ready("r" * 16, 2): (23 * 3600.0, 3600.0),
             keys.providers("r" * 16): (6 * 3600.0, 900.0), "/p2ptrain/test/other": (12 * 3600.0, 3600.0)}
    for key, (far, fine) in cases.items():
        far_rec = make_record(atk, key, b"x", now + far)
        ok_rec = make_record(atk, key, b"x", now + fine)
        for node in nodes:
            assert await _store_raw(net, atk, node, [far_rec]) == ["far-future"], key
        assert await _store_raw(net, atk, nodes[0], [ok_rec]) == ["ok"], key


@trio_test()
async def test_own_records_are_cut_to_their_key_horizon():
    net, nodes = make_swarm(3)
    await join_all(nodes)
    key = keys.presence("lobby")
    assert await nodes[0].store(key, b"p", ttl=10 * 3600) >= 2
    got = await nodes[2].get(key)
    horizon = record_mod.KEY_CLASSES["peers"].max_ttl
    assert got[nodes[0].identity.peer_id].expiry <= wall_time() + horizon


def test_dht_config_checks_every_bound():
    for bad in ({"rpc_timeout": 0}, {"max_writers_per_sender": 0}, {"max_bytes": 0},
                {"max_reply_bytes": 1 << 20}, {"key_classes": {"ready": 60.0}}):
        with pytest.raises(ValueError):
            DHTConfig(**bad)
    limits = DHTConfig(max_bytes_per_sender=123).store_limits()
    assert limits.max_bytes_per_sender == 123 and limits.max_per_writer == DHTConfig().max_records_per_writer


def test_every_key_has_a_class_whose_horizon_covers_its_writers_ttl():
    from p2ptrain.net.presence import PresenceConfig
    from p2ptrain.records import board
    from p2ptrain.run import election
    from p2ptrain.run.spec import TimeoutsSpec

    run = "r" * 16
    ttl = {keys.manifest(run): 3600, keys.ready(run, 5): election.ready_ttl(TimeoutsSpec().join_window),
           keys.state(run): board.STATE_TTL, keys.providers(run): 600.0, keys.data(run): 3600,
           keys.reputation(run): board.REPUTATION_TTL, keys.presence(run): PresenceConfig().ttl}
    for key, t in ttl.items():
        c = record_mod.KEY_CLASSES[record_mod.key_class(key)]
        assert t <= c.max_ttl / 2, key


def test_reply_order_ignores_insertion_order_and_tiny_records():
    """`select`: self-stored records before relayed crowds, small before big, and a
    per-request random order within; a record too big for what is left is skipped."""
    from p2ptrain.dht.storage import RecordStore, StoreLimits

    store = RecordStore(limits=StoreLimits())
    key = "/p2ptrain/r/manifest"
    exp = 1000.0
    big = [make_record(_ident(15, i), key, b"\xee" * 60_000, exp) for i in range(5)]
    relay = _ident(16, 0)
    tiny = [make_record(_ident(17, i), key, b"", exp) for i in range(16)]
    honest = [make_record(_ident(18, i), key, b"h" * 500, exp) for i in range(10)]
    for r in big:
        store.put(r, 0.0)
    for r in tiny:
        store.put(r, 0.0, sender=relay.peer_id)
    for r in honest:
        store.put(r, 0.0)
    out = store.select(key, 0.0, 12, 256 * 1024, b"salt")
    assert {r.subkey for r in out[:10]} == {r.subkey for r in honest}
    orders = {tuple(r.subkey for r in store.select(key, 0.0, 256, 256 * 1024, bytes([i]))) for i in range(8)}
    assert len(orders) > 1
    full = store.select(key, 0.0, 256, 256 * 1024, b"s")
    assert len([r for r in full if r.subkey in {b.subkey for b in big}]) == 4  # 26 small + 4 big fit
    assert {r.subkey for r in tiny} <= {r.subkey for r in full}


def test_a_full_node_makes_room_from_the_heaviest_sender_only():
    """A full store used to refuse every newcomer. Now it evicts from the sender holding the
    most bytes, and only for a sender that holds less: a flooder cannot push out lighter ones."""
    from p2ptrain.dht.record import RecordError
    from p2ptrain.dht.storage import RecordStore, StoreLimits

    store = RecordStore(limits=StoreLimits(max_bytes=47_000, max_bytes_per_sender=30_000))
    flooder, other = _ident(19, 0).peer_id, _ident(19, 1).peer_id
    exp = 1000.0
    big = [make_record(_ident(20, i), f"/p2ptrain/n{i}/manifest", b"\xee" * 4500, exp) for i in range(6)]
    for r in big:
        store.put(r, 0.0, sender=flooder)
    for i in range(4):
        store.put(make_record(_ident(21, i), f"/p2ptrain/m{i}/manifest", b"\xdd" * 4500, exp), 0.0, sender=other)
    honest = _ident(22, 0)
    assert store.put(make_record(honest, "/p2ptrain/h/manifest", b"h" * 500, exp), 0.0)
    assert store.get("/p2ptrain/h/manifest", 0.0) and store.bytes <= 47_000 and store.evicted == 1
    assert len([r for r in big if store.get(r.key, 0.0)]) == 5  # the heaviest sender lost one
    with pytest.raises(RecordError) as err:  # the flooder, still the heaviest, displaces no one
        store.put(make_record(_ident(20, 9), "/p2ptrain/n9/manifest", b"\xee" * 4500, exp), 0.0, sender=flooder)
    assert err.value.reason == "store-full"
