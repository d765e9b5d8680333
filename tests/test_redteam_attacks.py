"""The red-team bench's issue-32 attacks, each hostile part on its own (fast tier: pure logic
and the in-memory DHT). What each part does to a real run is `p2ptrain bench redteam`'s to
measure; these show that each part does what its name says, and that the bench reports it."""

from __future__ import annotations

import numpy as np
import trio

from conftest import trio_test
from test_dht_memory import join_all, make_swarm
from p2ptrain.bench import redteam, squatter
from p2ptrain.bench.adversary import ANTI_SCALE, HostileContributor
from p2ptrain.clock import wall_time
from p2ptrain.identity import Identity
from p2ptrain.run import contribution as C
from p2ptrain.records import RunRecords, codecs, keys
from p2ptrain.run import influence
from p2ptrain.run.round import Contributor

RUN = "r" * 16


def _header(ident: Identity, members: list[str], delta: np.ndarray, contributor=None) -> bytes:
    contributor = contributor or Contributor()
    sent = contributor.payload(delta)
    n = float(np.linalg.norm(delta))  # as run.round: the header of the trained delta, then `sign` may scale it
    h = C.Header(RUN, 3, 0, "x" * 64, ident.peer_id_str, tuple([n / np.sqrt(len(members))] * len(members)),
                 ("ab" * 32,), n, 5, 100)
    return contributor.sign(h, ident), sent


def test_anti_updates_pass_every_bound_and_pull_the_mean_against_descent():
    """k = 4 Sybils beside 4 honest members with norms within 15 % of theirs: every header
    passes the shared verdict (median rule and every honest anchor's probation bound), and
    the group's mean points against the honest descent direction (k * 2.5 > H)."""
    rng = np.random.default_rng(3)
    descent = rng.standard_normal(1000).astype(np.float32)
    honest = [Identity.generate() for _ in range(4)]
    sybils = [Identity.generate() for _ in range(4)]
    members = [i.peer_id_str for i in honest + sybils]
    raw, sent = {}, {}
    for j, ident in enumerate(honest):  # honest norms 0.85 .. 1.0 of the Sybils' own
        raw[ident.peer_id_str], sent[ident.peer_id_str] = _header(ident, members, descent * np.float32(1 - 0.05 * j))
    for ident in sybils:
        raw[ident.peer_id_str], sent[ident.peer_id_str] = _header(ident, members, descent, HostileContributor("anti"))
    v = influence.judge_headers(raw, RUN, 3, 0, "x" * 64, members, {})
    assert v.bad == {} and set(v.ok) == set(members), v.bad
    for ident in sybils:  # true to its bytes: within the bound by its signed norm, not a lie
        assert np.allclose(sent[ident.peer_id_str], -ANTI_SCALE * descent)
        assert abs(v.ok[ident.peer_id_str].norm - float(np.linalg.norm(sent[ident.peer_id_str]))) < 1e-3
    mean = np.mean(list(sent.values()), axis=0)
    assert float(mean @ descent) < 0  # the committed step would climb the loss
    # and one notch more (3.5x, over the probation factor) is refused by every honest anchor
    loud = HostileContributor("anti")
    loud_raw, _ = _header(sybils[0], members, descent * np.float32(3.5 / ANTI_SCALE), loud)
    v2 = influence.judge_headers({**raw, sybils[0].peer_id_str: loud_raw}, RUN, 3, 0, "x" * 64, members, {})
    assert v2.bad == {sybils[0].peer_id_str: "norm-over-anchor"}


def test_the_bench_names_each_attack_and_measures_reputation_against_the_robust_baseline(tmp_path):
    def row(attack, committed, val, **kw):
        return {"event": "bench_redteam_attack", "attack": attack, "honest_committed": committed, "rate": 1.0,
                "common_step": 4, "val_loss": val, "val_curve": {4: val}, "param_forks": 0, "wrongly_excluded": 0,
                **kw}
    rows = [row("baseline", 16, 4.0), row("sybil-k4", 16, 4.04), row("sybil-k8", 16, 4.2),
            row("late-honest", 12, 4.1), row("provider", 12, 4.1), row("baseline-robust", 10, 5.0),
            row("reputation", 5, 5.0, baseline="baseline-robust")]
    s = redteam.summarize(rows)
    assert s["sybil_k4_val_loss_pct"] == 1.0 and s["sybil_k8_val_loss_pct"] == 5.0
    assert s["worst_val_loss_pct"] == 5.0
    by = {r["attack"]: r for r in rows}
    assert by["reputation"]["measured_against"] == "baseline-robust" and by["reputation"]["progress_ratio"] == 0.5
    assert by["provider"]["measured_against"] == "late-honest" and by["provider"]["progress_ratio"] == 1.0
    assert s["honest_progress_min_ratio"] == 0.5  # the control (late-honest, 0.75) is not an attack
    assert "baseline-robust" not in s["attacks"] and "reputation" in s["attacks"]
    na = redteam.summarize(rows[:1] + [{"event": "bench_redteam_attack", "attack": "reputation",
                                        "not_applicable": "init failed"}])
    assert na["not_applicable"] == {"reputation": "init failed"} and na["honest_progress_min_ratio"] == 1.0
    # the selective Sybils each talk to one honest member and to each other
    modes = redteam.hostile_modes("selective", tmp_path, tmp_path)
    h = redteam.peer_ids(tmp_path, ["h0", "h1"])
    a = redteam.peer_ids(tmp_path, ["a0", "a1"])
    assert modes == [f"selective:{h[0]},{a[1]}", f"selective:{h[1]},{a[0]}"]
    pool = redteam.hostile_modes("inflate", tmp_path, tmp_path)
    assert len(pool) == redteam.INFLATE_RUNNING and len(pool[0].split(":")[1].split(",")) == redteam.INFLATE_POOL
    assert redteam.hostile_modes("sybil-k8", tmp_path, tmp_path) == ["anti"] * 8


@trio_test()
async def test_eclipse_records_stored_first_hide_no_honest_ready_record():
    """The eclipse part stores 5 x ~60 KiB records under the next 3 ready keys before the
    honest peers publish; every one is refused (a ready record's byte bound) and a reader
    that is no replica still reads every honest record."""
    _, nodes = make_swarm(10)
    await join_all(nodes)
    out: dict = {}
    done: set[int] = set()
    await squatter.eclipse_once(nodes[9], RUN, 0, [Identity.generate() for _ in range(5)], done, out)
    assert done == {1, 2, 3} and out.get("stored", 0) == 0 and out["refused"] == 15, out
    for node in nodes[:6]:
        assert await node.store(keys.ready(RUN, 1), b"honest", ttl=600) >= 1
    got = await nodes[8].get(keys.ready(RUN, 1))
    assert {n.identity.peer_id for n in nodes[:6]} <= set(got)


@trio_test()
async def test_expiry_and_reputation_parts_store_what_they_claim():
    """expiry: a ready record 10 minutes early that expires in 8 s, for this step and the next;
    reputation: two fresh identities each name every writer of the step's ready records."""
    from p2ptrain.run import elect

    _, nodes = make_swarm(8)
    await join_all(nodes)
    for node in nodes[:4]:
        await elect.publish_ready(node, RUN, 2, [], False, 3.0)
    out: dict = {}
    atk = nodes[7]
    await squatter.expiry_once(atk, RUN, 2, ["/ip4/127.0.0.1/tcp/9"], out)
    assert out["stored"] == 2, out
    recs = await nodes[5].get(keys.ready(RUN, 3))
    mine = recs[atk.identity.peer_id]
    assert mine.expiry <= wall_time() + 8.5
    assert await squatter.current_step(nodes[6], RUN, -1) == 3  # it follows the run from ready records
    fakes = [Identity.generate() for _ in range(2)]
    rep: dict = {}
    await squatter.reputation_once(atk, RUN, 2, fakes, rep)
    assert rep["named"] == 4 and rep["stored"] == 2, rep
    reports = await RunRecords(nodes[0], RUN).read_reputation()
    assert {f.peer_id_str for f in fakes} <= set(reports)
    assert set(reports[fakes[0].peer_id_str]) == {n.identity.peer_id_str for n in nodes[:4]}


@trio_test()
async def test_provider_copies_sort_first_and_name_the_honest_checkpoint():

    _, nodes = make_swarm(6)
    await join_all(nodes)
    honest = nodes[0]
    value = codecs.encode_provider(3, "aa" * 32, "bb" * 32, "cc" * 32, [n.identity.peer_id_str for n in nodes[:3]],
                             ["/ip4/127.0.0.1/tcp/1"])
    await honest.store(keys.providers(RUN), value, ttl=600)
    got = await squatter.newest_providers(nodes[5], RUN, set())
    assert [p.peer for p in got] == [honest.identity.peer_id_str]
    fakes = squatter.first_sorting(2, pool=64)
    assert fakes[0].peer_id_str < fakes[1].peer_id_str
    out: dict = {}
    await squatter.copy_provider(nodes[5], RUN, got[0], fakes, [["/ip4/127.0.0.1/tcp/2"]] * 2, out)
    assert out["stored"] == 2 and out["copied_step"] == 3, out
    now = await squatter.newest_providers(nodes[4], RUN, set())
    copies = [p for p in now if p.peer in {f.peer_id_str for f in fakes}]
    assert len(copies) == 2 and all(p.manifest == "aa" * 32 and p.step == 3 for p in copies)


@trio_test()
async def test_the_slot_hog_holds_what_one_identity_may_and_an_honest_fetch_is_still_served():
    """The slot part opens 8 slow requests for a donor's manifest from one identity, and
    reopens each as it ends; the donor gives that identity 2 slots and a short queue, refuses
    the rest, and serves an honest request at once."""
    import hashlib
    import os
    import types

    from fakehost import PipeNet
    from p2ptrain.ckpt import fetch, providers
    from p2ptrain.ckpt.fetch import BlobServer, ServeConfig

    async with trio.open_nursery() as nursery:
        net = PipeNet(nursery)
        donor_id, hog_id, honest_id = (Identity.generate() for _ in range(3))
        blobs = BlobServer(net.host(donor_id.peer_id), config=ServeConfig(upload_mbps=0, slot_allowance=5.0,
                                                                          slot_min_mbps=1.0))
        digest = blobs.add(os.urandom(1 << 20))
        node = types.SimpleNamespace(host=net.host(hog_id.peer_id), identity=hog_id,
                                     rpc=types.SimpleNamespace(learn_addrs=lambda peer, addrs: None))
        donor = providers.Provider(donor_id.peer_id_str, 2, digest, "bb" * 32, "cc" * 32, (), ())
        out = {"refused": 0, "opened": 0, "ended": 0}
        scope = await nursery.start(squatter._hog, node, [donor], out)
        await trio.sleep(0.5)
        assert blobs.slots.active == {hog_id.peer_id: 2} and blobs.slots.waiting == 4
        t0 = trio.current_time()
        data = await fetch.request(net.host(honest_id.peer_id), donor_id.peer_id, digest, 2 << 20, timeout=60.0)
        assert hashlib.sha256(data).hexdigest() == digest and trio.current_time() - t0 < 1.0
        await trio.sleep(30)  # it keeps coming back as its requests are reset or refused
        assert out["opened"] > 8 and out["ended"] > 2, out
        scope.cancel()
        nursery.cancel_scope.cancel()

