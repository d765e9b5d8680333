"""Checkpoints between peers: chunk manifests, the provider quorum, and multi-donor downloads
over real libp2p nodes on 127.0.0.1 (a lying donor, a slow one, a dead one)."""

from __future__ import annotations

import hashlib
import os
import time

import msgpack
import pytest
import trio

from conftest import LOOPBACK, trio_test
from fakehost import PipeNet
from libp2p.peer.id import ID
from p2ptrain.ckpt import fetch
from p2ptrain.ckpt import chunks
from p2ptrain.ckpt import providers
from p2ptrain.records import codecs
from fakes.adversary import CorruptBlobServer, flip_one_byte
from p2ptrain.ckpt.download import CheckpointServer, DownloadConfig, download
from p2ptrain.events import EventSink
from p2ptrain.ckpt.fetch import BlobServer, FetchError, ServeConfig
from p2ptrain.identity import Identity
from p2ptrain.net.node import Node, NodeConfig

H = [hashlib.sha256(bytes([i])).hexdigest() for i in range(8)]


# -- chunk manifests (pure) ------------------------------------------------------------
def test_split_verify_assemble_roundtrip():
    data = os.urandom(100_000)
    m, parts = chunks.split(data, 8192)
    assert len(m.chunks) == 13 and m.size == len(data)
    back = chunks.decode_manifest(m.encode(), m.digest())
    assert back == m
    asm = chunks.Assembler(back)
    for i in reversed(range(len(parts))):
        assert not asm.put(i, flip_one_byte(bytes(parts[i])))  # a wrong chunk is refused
        assert asm.put(i, parts[i])
    assert asm.result() == data


@pytest.mark.parametrize("bad", [
    b"\x00" * (chunks.MAX_MANIFEST_BYTES + 1),
    msgpack.packb({"v": 1, "size": 10 << 20, "chunk": 1 << 20, "sha256": H[0], "chunks": [b"x" * 32]}),
    msgpack.packb({"v": 1, "size": 10, "chunk": 1, "sha256": H[0], "chunks": [b"x" * 32]}),
    msgpack.packb({"v": 2, "size": 10, "chunk": 4096, "sha256": H[0], "chunks": [b"x" * 32]}),
    msgpack.packb({"v": 1, "size": 10, "chunk": 4096, "sha256": "zz", "chunks": [b"x" * 32]}),
    msgpack.packb([1, 2, 3]),
    b"\xc1garbage",
])
def test_hostile_chunk_manifests_are_rejected(bad):
    with pytest.raises(chunks.ChunkError):
        chunks.decode_manifest(bad)


def test_manifest_must_match_its_attested_hash():
    m, _ = chunks.split(b"abc" * 5000, 4096)
    with pytest.raises(chunks.ChunkError, match="hash"):
        chunks.decode_manifest(m.encode(), H[0])


# -- quorum rule (pure) -----------------------------------------------------------------
def rec(peer, step, manifest, members, sha=H[5]):
    return providers.Provider(peer, step, manifest, sha, H[6], tuple(sorted(members)), ())


def test_quorum_needs_half_of_the_group_that_committed():
    g = ["a", "b", "c", "d"]
    one = [rec("a", 3, H[1], g)]
    assert providers.choose(one, H[7]) is None  # 1 of 4
    two = one + [rec("b", 3, H[1], g), rec("x", 3, H[1], [])]  # x: provider, not an attester
    c = providers.choose(two, H[7])
    assert (c.step, c.manifest, c.attesters, c.providers) == (3, H[1], ("a", "b"), ("a", "b", "x"))


def test_newest_attested_step_wins_and_liars_do_not_count():
    g = ["a", "b", "c"]
    recs = [rec("a", 2, H[1], g), rec("b", 2, H[1], g),
            rec("c", 5, H[2], g),                      # alone: 1 of 3
            rec("e", 9, H[3], ["e", "f", "g"]), rec("f", 9, H[3], ["e", "f", "g", "h"]),  # disagree on group
            rec("s", 99, H[4], [f"s{i}" for i in range(9)] + ["s"])]  # bigger than the run's groups
    c = providers.choose(recs, H[7], max_group=4)
    assert (c.step, c.manifest) == (2, H[1])


def test_step_zero_needs_the_genesis_hash():
    recs = [rec("a", 0, H[1], [], sha=H[7]), rec("m", 0, H[2], [], sha=H[3])]
    c = providers.choose(recs, H[7])
    assert (c.step, c.manifest, c.providers) == (0, H[1], ("a",))
    assert providers.choose(recs[1:], H[7]) is None


def test_provider_record_decoder_is_bounded():
    v = codecs.encode_provider(4, H[1], H[2], H[3], ["b", "a"], ["/ip4/127.0.0.1/tcp/1"])
    p = codecs.decode_provider("a", v)
    assert (p.step, p.members) == (4, ("a", "b"))
    for bad in (b"\x00" * 10000, msgpack.packb({"step": -1}), msgpack.packb({"step": 1, "manifest": "x"}),
                msgpack.packb({"step": 1, "manifest": H[1], "sha256": H[1], "params": H[1],
                               "members": ["m"] * 100})):
        with pytest.raises(codecs.RecordError):
            codecs.decode_provider("a", bad)


# -- in-memory donors (fast tier) ------------------------------------------------------
def _silent(net, *idents) -> None:
    """Hosts that accept the fetch stream and never answer (copied provider records)."""
    from p2ptrain.ckpt.fetch import PROTOCOL

    async def never_answer(stream):
        await trio.sleep_forever()

    for ident in idents:
        net.host(ident.peer_id).set_stream_handler(PROTOCOL, never_answer)


@trio_test()
async def test_copied_provider_records_do_not_stall_the_manifest_fetch():
    """Two provider records copied by identities that accept the stream and never answer,
    sorting first, each held the manifest fetch for its 60 s timeout: every newcomer spent
    its 120 s budget. Providers are raced with a first-byte deadline now, and one that
    says it lacks what its record names, or serves another manifest, is excluded."""
    from fakehost import PipeNet

    data = os.urandom(300_000)
    ids = sorted((Identity.from_seed(bytes([40 + i]) * 32) for i in range(5)), key=lambda i: i.peer_id_str)
    stall1, stall2, empty, liar, honest = ids
    async with trio.open_nursery() as nursery:
        net = PipeNet(nursery)
        fetcher = net.host(Identity.from_seed(b"\x30" * 32).peer_id)

        _silent(net, stall1, stall2)
        _, digest = CheckpointServer(BlobServer(net.host(honest.peer_id)), 64 << 10).serve(data)
        BlobServer(net.host(empty.peer_id))  # serves nothing, though its record names the manifest
        m, _ = chunks.split(b"other" * 50_000, 64 << 10)
        BlobServer(net.host(liar.peer_id)).add_known(digest, m.encode())  # another manifest under that hash
        net.delay[honest.peer_id] = 1.0  # the others answer first
        choice = providers.Choice(1, digest, hashlib.sha256(data).hexdigest(), H[0],
                                  tuple(i.peer_id_str for i in ids), ())
        t0 = trio.current_time()
        got, rep = await download(fetcher, choice)
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert got == data
    assert took < 10, took  # the first-byte deadline (10 s); it was 2 x 60 s
    assert set(rep.excluded) == {empty.peer_id_str, liar.peer_id_str}, rep.excluded
    assert "does not serve" in rep.excluded[empty.peer_id_str]
    assert "does not verify" in rep.excluded[liar.peer_id_str]
    assert rep.per_donor[honest.peer_id_str] == len(chunks.split(data, 64 << 10)[0].chunks)


@trio_test()
async def test_a_state_its_attesters_dropped_is_given_up_at_once_for_the_newer_one(monkeypatch):
    """The red team's `provider` attack after the fix above (2026-11-30): the newcomer's
    choice was dropped by its attesters (they answered so), and its other providers, copied
    records on hosts that never answer, held the download for their request timeout (60 s
    a request, 3 failures each) while the run's veterans finished and left. Once every
    attester said it no longer holds the state, they have all committed newer ones: the
    download fails at once and the catch-up takes the newest."""
    from types import SimpleNamespace

    from p2ptrain.ckpt import catchup

    old, new = os.urandom(200_000), os.urandom(200_000)
    ids = sorted((Identity.from_seed(bytes([60 + i]) * 32) for i in range(3)), key=lambda i: i.peer_id_str)
    copier, attesters = ids[0], ids[1:]
    async with trio.open_nursery() as nursery:
        net = PipeNet(nursery)
        fetcher = net.host(Identity.from_seed(b"\x31" * 32).peer_id)

        _silent(net, copier)
        for ident in attesters:
            blobs = BlobServer(net.host(ident.peer_id))
            m_old, d_old = CheckpointServer(blobs, 64 << 10).serve(old)
            m_new, d_new = CheckpointServer(blobs, 64 << 10).serve(new)  # a fresh server: old's blobs are gone
            blobs.add_known(d_old, m_old.encode())  # but the manifest is still served (read before it moved on)
        everyone = tuple(i.peer_id_str for i in ids)
        signed = tuple(i.peer_id_str for i in attesters)
        choices = [providers.Choice(1, d_old, m_old.sha256, H[0], everyone, signed),
                   providers.Choice(2, d_new, m_new.sha256, H[1], everyone, signed)]

        async def find(dht, run_id, genesis, min_step, max_group, trusted, reject, ignore):
            return next((c for c in choices if c.sha256 not in reject), None)

        monkeypatch.setattr(catchup, "find", find)
        spec = SimpleNamespace(genesis=SimpleNamespace(sha256=H[7], bytes=len(new)), train=SimpleNamespace(group_size=4))
        events = SimpleNamespace(emit=lambda name, **f: None, json_mode=True)
        node = SimpleNamespace(dht=None, host=fetcher, identity=Identity.from_seed(b"\x31" * 32))
        t0 = trio.current_time()
        got = await catchup.fetch_checkpoint(node, "r", spec, events)
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert got == (2, new)
    assert took < 15, took  # the copier's first-byte deadline on the manifest at most; 120 s before


@trio_test()
async def test_a_cut_short_download_leaves_its_verified_chunks_to_the_next_try():
    """`download.Resume`: a try that ended with some chunks verified (here its only donor
    had lost the rest; likewise a catch-up cut by its budget) leaves them to the next try of
    the same checkpoint, which fetches only the others. Before, every try began at chunk 0,
    so a state bigger than one budget's worth of a slow link never arrived."""
    from p2ptrain.ckpt.download import Resume

    data = os.urandom(640 << 10)  # 10 chunks of 64 KiB
    part, whole = Identity.from_seed(b"\x71" * 32), Identity.from_seed(b"\x72" * 32)
    async with trio.open_nursery() as nursery:
        net = PipeNet(nursery)
        fetcher = net.host(Identity.from_seed(b"\x70" * 32).peer_id)
        blobs = BlobServer(net.host(part.peer_id))
        m, digest = CheckpointServer(blobs, 64 << 10).serve(data)
        for h in m.chunks[6:]:
            blobs.remove(h)  # it serves the manifest and chunks 0-5 only
        choice = providers.Choice(1, digest, m.sha256, H[0], (part.peer_id_str,), ())
        resume = Resume()
        with pytest.raises(FetchError):
            await download(fetcher, choice, resume=resume)
        had = sorted(resume.take(digest).have)  # its first "not served" ends requests in flight
        assert had and set(had) <= set(range(6)), had
        CheckpointServer(BlobServer(net.host(whole.peer_id)), 64 << 10).serve(data)
        again = providers.Choice(1, digest, m.sha256, H[0], (part.peer_id_str, whole.peer_id_str), ())
        got, rep = await download(fetcher, again, resume=resume)
        nursery.cancel_scope.cancel()
    assert got == data
    assert rep.resumed == len(had) and sum(rep.per_donor.values()) == 10 - len(had), rep
    assert resume.take(digest) is None  # done: nothing held


@trio_test()
async def test_a_manifest_whose_chunks_verify_but_whole_does_not_is_a_fetch_error():
    """An attested manifest (Sybil attesters can be half a group) that lists true chunk
    hashes under a false whole-checkpoint hash: every chunk verifies and the assembled bytes
    do not. That was a ChunkError (a ValueError) out of `download`, which no caller catches:
    the catch-up and the peer died on hostile input. Now a FetchError, so the catch-up
    passes the choice over, and a resumed try does not keep the assembled bytes."""
    from p2ptrain.ckpt.download import Resume

    data = os.urandom(200_000)
    donor = Identity.from_seed(b"\x75" * 32)
    async with trio.open_nursery() as nursery:
        net = PipeNet(nursery)
        fetcher = net.host(Identity.from_seed(b"\x76" * 32).peer_id)
        blobs = BlobServer(net.host(donor.peer_id))
        m, parts = chunks.split(data, 64 << 10)
        lie = chunks.ChunkManifest(m.size, m.chunk, H[3], m.chunks)  # the chunks' hashes, another whole
        for h, part in zip(m.chunks, parts):
            blobs.add_known(h, part)
        blobs.add_known(lie.digest(), lie.encode())
        resume = Resume()
        with pytest.raises(FetchError, match="does not match"):
            await download(fetcher, providers.Choice(1, lie.digest(), H[3], H[0], (donor.peer_id_str,), ()),
                           resume=resume)
        nursery.cancel_scope.cancel()
    assert resume.take(lie.digest()) is None


@trio_test()
async def test_a_provider_that_stalls_alone_is_given_up_on_at_the_first_byte_deadline():
    from fakehost import PipeNet

    data = os.urandom(100_000)
    staller, honest = Identity.from_seed(b"\x50" * 32), Identity.from_seed(b"\x51" * 32)
    async with trio.open_nursery() as nursery:
        net = PipeNet(nursery)
        fetcher = net.host(Identity.from_seed(b"\x52" * 32).peer_id)

        _silent(net, staller)
        _, digest = CheckpointServer(BlobServer(net.host(honest.peer_id)), 64 << 10).serve(data)
        choice = providers.Choice(1, digest, hashlib.sha256(data).hexdigest(), H[0],
                                  (staller.peer_id_str, honest.peer_id_str), (staller.peer_id_str,))
        t0 = trio.current_time()  # attesters are asked first: the staller is
        got, rep = await download(fetcher, choice, config=DownloadConfig(race_width=1))
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert got == data
    cfg = DownloadConfig()
    assert cfg.first_byte_timeout <= took < cfg.first_byte_timeout + 5
    assert rep.per_donor[staller.peer_id_str] == 0


@trio_test()
async def test_data_records_copied_by_silent_peers_do_not_stall_the_tokenizer_fetch():
    """The tokenizer was asked of one data-record holder at a time, 30 s each: six copied
    records whose peers never answer held a join for three minutes."""
    from types import SimpleNamespace

    from fakehost import PipeNet
    from p2ptrain.dht.node import DHTNode
    from p2ptrain.dht.transport import MemoryNetwork
    from p2ptrain.records import keys
    from p2ptrain.train import shards

    tok = b'{"model": "a tokenizer"}' * 100
    sha = hashlib.sha256(tok).hexdigest()
    run = "r" * 16
    dnet = MemoryNetwork()
    ids = [Identity.from_seed(bytes([60 + i]) * 32) for i in range(8)]
    dhts = [DHTNode(i, dnet.transport(i.peer_id)) for i in ids]
    for d in dhts[1:]:
        await d.bootstrap([(ids[0].peer_id, [])])
    value = msgpack.packb({"manifest": H[1], "sha256": H[2], "tok": sha, "addrs": []})
    async with trio.open_nursery() as nursery:
        net = PipeNet(nursery)
        _silent(net, *ids[1:7])  # the copies first
        for i in range(1, 7):
            await dhts[i].store(keys.data(run), value, ttl=600)
        BlobServer(net.host(ids[7].peer_id)).add(tok)
        await dhts[7].store(keys.data(run), value, ttl=600)
        me = SimpleNamespace(dht=dhts[0], host=net.host(ids[0].peer_id), identity=ids[0])
        t0 = trio.current_time()
        got = await shards.fetch_tokenizer(me, run, sha)
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert got == tok
    assert took < 15, took  # the honest peer is asked by the time the first 4 are given up on (10 s)


# -- real libp2p donors ---------------------------------------------------------------
async def _nodes(nursery, n):
    out = []
    for _ in range(n):
        ident = Identity.generate()
        node = Node(ident, NodeConfig(listen=[LOOPBACK]), EventSink(ident.peer_id_str, False))
        await nursery.start(node.run)
        out.append(node)
    return out


async def _swarm(nursery, data, donor_cfgs, chunk_bytes):
    """Donor nodes serving `data` as chunks, and a fetcher that knows their addresses."""
    nodes = await _nodes(nursery, len(donor_cfgs) + 1)
    fetcher, donors = nodes[0], nodes[1:]
    servers, digest = [], None
    for node, (cfg, tamper) in zip(donors, donor_cfgs):
        blobs = CorruptBlobServer(node.host, config=cfg, corrupt=tamper) if tamper else BlobServer(node.host, config=cfg)
        _, digest = CheckpointServer(blobs, chunk_bytes).serve(data)
        servers.append(blobs)
        fetcher.rpc.learn_addrs(node.identity.peer_id, node.rpc.local_addrs())
    m, _ = chunks.split(data, chunk_bytes)
    choice = providers.Choice(1, digest, m.sha256, H[0], tuple(n.peer_id for n in donors), ())
    return fetcher, donors, servers, choice


@pytest.mark.integration
@pytest.mark.parametrize("per_donor", [1, 2])
def test_corrupt_donor_is_detected_refetched_elsewhere_and_never_used_again(per_donor):
    data = os.urandom(3 << 20)
    excluded = []

    async def main():
        async with trio.open_nursery() as nursery:
            # the honest donors at 4 MB/s: the liar's chunks must arrive first for it to be
            # caught (unthrottled, under load the honest two once fetched every chunk before
            # the liar's first answer, and it was never excluded)
            honest = (ServeConfig(upload_mbps=4.0, burst_mb=0.125), None)

            def chunks_only(b: bytes) -> bytes:  # serves its manifest honestly, then lies
                return flip_one_byte(b) if len(b) == 64 << 10 else b
            fetcher, donors, servers, choice = await _swarm(
                nursery, data, [(ServeConfig(), chunks_only), honest, honest], 64 << 10)
            with trio.fail_after(60):
                got, rep = await download(fetcher.host, choice, config=DownloadConfig(per_donor=per_donor),
                                          on_exclude=lambda d, r: excluded.append((d, r)))
            nursery.cancel_scope.cancel()
            return got, rep, donors, servers

    got, rep, donors, servers = trio.run(main)
    liar = donors[0].peer_id
    assert got == data
    assert [d for d, _ in excluded] == [liar] and "failed verification" in excluded[0][1]
    assert rep.per_donor[liar] == 0 and sum(rep.per_donor.values()) == rep.chunks == 48
    # The manifest, then at most its `per_donor` chunk requests in flight when it was
    # caught; nothing after the exclusion.
    assert 2 <= servers[0].served_requests <= 1 + per_donor, servers[0].served_requests


@pytest.mark.integration
def test_slow_and_dead_donors_do_not_stall_the_download():
    data = os.urandom(2 << 20)

    async def main():
        async with trio.open_nursery() as nursery:
            fetcher, donors, servers, choice = await _swarm(
                nursery, data, [(ServeConfig(upload_mbps=0.02, burst_mb=0.01), None), (ServeConfig(), None)], 128 << 10)
            dead = Identity.generate()
            fetcher.rpc.learn_addrs(dead.peer_id, ["/ip4/127.0.0.1/tcp/9"])  # nothing listens there
            choice = providers.Choice(1, choice.manifest, choice.sha256, H[0],
                                      (*choice.providers, dead.peer_id_str), ())
            t0 = time.monotonic()
            with trio.fail_after(60):
                got, rep = await download(fetcher.host, choice, config=DownloadConfig(chunk_timeout=30))
            took = time.monotonic() - t0
            nursery.cancel_scope.cancel()
            return got, rep, took, donors, dead

    got, rep, took, donors, dead = trio.run(main)
    assert got == data
    # Alone, the slow donor needs 2 MiB / 20 kB/s = 100 s; stealing finishes far sooner.
    assert took < 30, took
    assert rep.per_donor[donors[1].peer_id] >= 14 and rep.stolen >= 1, rep
    assert rep.per_donor[dead.peer_id_str] == 0


@pytest.mark.integration
def test_donors_that_moved_on_are_not_avoided_for_the_newer_state(monkeypatch):
    """A catch-up chose a state its donors dropped between the manifest and the chunks (they
    committed twice more: they serve the chunks of their last 2 states). Each answers "I do
    not have it": alive and answering, so it must still serve the next choice, the newer
    state. Before, three such answers made it "unresponsive": the catch-up avoided every
    honest donor for its next choices, and the red team's late newcomer (the `provider`
    attack, 2026-11-30) fetched nothing more and committed 0 of its 3 steps."""
    from types import SimpleNamespace

    from p2ptrain.ckpt import catchup as dl

    old, new = os.urandom(256 << 10), os.urandom(256 << 10)
    seen = []

    async def main():
        async with trio.open_nursery() as nursery:
            fetcher, donors, servers, stale = await _swarm(nursery, old, [(ServeConfig(), None)] * 2, 64 << 10)
            fresh = None
            for blobs in servers:
                server = CheckpointServer(blobs, 64 << 10)
                m_new, d_new = server.serve(new)
                fresh = providers.Choice(2, d_new, m_new.sha256, H[1], stale.providers, ())
                m_old = chunks.split(old, 64 << 10)[0]
                blobs.add_known(stale.manifest, m_old.encode())  # still served; its chunks are gone
                assert all(h not in blobs.blobs for h in m_old.chunks)
            choices = [stale, fresh]

            async def find(dht, run_id, genesis, min_step, max_group, trusted, reject, ignore):
                left = [c for c in choices if c.sha256 not in reject]
                return left[0] if left else None

            monkeypatch.setattr(dl, "find", find)
            spec = SimpleNamespace(genesis=SimpleNamespace(sha256=H[7], bytes=len(new)),
                                   train=SimpleNamespace(group_size=4))
            events = SimpleNamespace(emit=lambda name, **f: seen.append((name, f)), json_mode=True)
            node = SimpleNamespace(dht=None, host=fetcher.host, identity=fetcher.identity)
            with trio.fail_after(60):
                got = await dl.fetch_checkpoint(node, "r", spec, events, avoid=(avoid := set()))
            nursery.cancel_scope.cancel()
            return got, avoid

    got, avoid = trio.run(main)
    assert got == (2, new), [f for f in seen if f[0] == "donor_excluded"]
    assert avoid == set()
    assert any(n == "donor_excluded" and "does not serve" in f["reason"] for n, f in seen), seen


@pytest.mark.integration
def test_download_fails_cleanly_when_every_donor_lies():
    data = os.urandom(256 << 10)

    async def main():
        async with trio.open_nursery() as nursery:
            fetcher, donors, servers, choice = await _swarm(
                nursery, data, [(ServeConfig(), flip_one_byte)] * 2, 64 << 10)
            with pytest.raises(FetchError), trio.fail_after(60):
                await download(fetcher.host, choice)
            nursery.cancel_scope.cancel()

    trio.run(main)


# -- async checkpoint writer ------------------------------------------------------------
def test_async_writer_keeps_last_k_and_cleans_torn_writes(tmp_path):
    from fakes.adversary import PausingWriter
    from p2ptrain.ckpt import checkpoint

    (tmp_path / ".step-000009.p2ck.tmp.123").write_bytes(b"torn")  # a killed process's leftover
    written, paused = [], []

    class Events:
        def emit(self, event, step):
            paused.append(step)

    w = PausingWriter(tmp_path, keep=2, on_written=lambda s, sec, p: written.append(s), events=Events(),
                      pause_step=3, seconds=0.2)
    assert not list(tmp_path.glob(".step-*"))
    for step in range(1, 5):
        w.submit(step, checkpoint.encode({"x": __import__("numpy").full(3, step, "float32")}, {"outer_step": step}))
        assert w.flush(10)
    assert w.close(10)
    assert written == [1, 2, 3, 4] and paused == [3]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000003.p2ck", "step-000004.p2ck"], names
    assert checkpoint.decode((tmp_path / names[-1]).read_bytes())[1]["outer_step"] == 4


# -- serving slots (in memory) ---------------------------------------------------------
async def _slow_request(host, server: bytes, digest: str, log: list) -> None:
    """A request whose reader takes 1 KiB a second: it would hold its slot ~17 minutes."""
    stream = await host.new_stream(ID(server), [fetch.PROTOCOL])
    req = msgpack.packb({"sha256": digest})
    await stream.write(len(req).to_bytes(2, "big") + req)
    t0 = trio.current_time()
    try:
        while await stream.read(1024):
            await trio.sleep(1.0)
        log.append(("eof", trio.current_time() - t0))
    except ConnectionError:
        log.append(("reset", trio.current_time() - t0))


@trio_test()
async def test_one_identity_cannot_hold_every_serving_slot():
    """Slot hogging (issue 32): one identity opens 10 requests for a 1 MiB blob and reads each
    at 1 KiB/s, before an honest fetcher asks once with a 60 s timeout. Before, the first 4
    held every slot for their whole 60 s and the rest queued ahead of the honest request,
    whose first byte came long after its timeout. Now that identity holds at most 2 slots,
    queues at most 4 more (the rest are refused at once), and each slow reader gives its slot
    back within its deadline: the honest request is served at once."""
    async with trio.open_nursery() as nursery:
        net = PipeNet(nursery)
        server_id, hog_id, honest_id = (Identity.generate().peer_id for _ in range(3))
        cfg = ServeConfig(upload_mbps=0, slot_allowance=5.0, slot_min_mbps=1.0)
        blobs = BlobServer(net.host(server_id), config=cfg)
        digest = blobs.add(os.urandom(1 << 20))
        hog, honest = net.host(hog_id), net.host(honest_id)
        outcomes: list = []
        for _ in range(10):
            nursery.start_soon(_slow_request, hog, server_id, digest, outcomes)
        await trio.sleep(0.5)
        assert blobs.slots.active == {hog_id: 2} and blobs.slots.waiting == 4
        assert sorted(outcomes) == [("reset", 0.0)] * 4  # refused at once
        t0 = trio.current_time()
        data = await fetch.request(honest, server_id, digest, 2 << 20, timeout=60.0)
        assert hashlib.sha256(data).hexdigest() == digest and trio.current_time() - t0 < 1.0
        with trio.fail_after(60):
            while len(outcomes) < 10:
                await trio.sleep(1)
        # Each slow reader was reset when its deadline ran out (5 s + 1 MiB at 1 MB/s of
        # waiting on it; it notices at its next read, within 1 s); the queued ones, 2 at a
        # time, after the ones ahead of them.
        held = sorted(t for kind, t in outcomes[4:])
        deadline = 5.0 + (1 << 20) / 1e6
        assert all(kind == "reset" for kind, _ in outcomes), outcomes
        assert all(deadline <= t <= (i // 2 + 1) * deadline + 1.01 for i, t in enumerate(held)), held
        assert blobs.slots.active == {} and blobs.slots.waiting == 0
        nursery.cancel_scope.cancel()


def test_fair_slots_take_turns_per_identity_and_bound_their_queues():
    from p2ptrain.ckpt.slots import FairSlots, SlotConfig

    slots = FairSlots(SlotConfig(slots=2, per_peer=1, per_peer_waiting=2, max_waiting=3))
    assert slots.ask("a", "a1") is True and slots.ask("a", "a2") is False and slots.ask("a", "a3") is False
    assert slots.ask("a", "a4") is None  # its own queue is full
    assert slots.ask("b", "b1") is True  # a free slot, under b's share
    assert slots.ask("c", "c1") is False and slots.ask("d", "d1") is None  # every queue together is full
    assert slots.release("a") == ["c1"]  # c's turn before a's second request
    assert slots.release("b") == ["a2"]
    assert slots.leave("a", "a3") and not slots.leave("a", "a3")
    assert slots.release("c") == [] and slots.release("a") == [] and slots.busy == 0 and slots.waiting == 0
    with pytest.raises(ValueError):
        SlotConfig(per_peer=0)


@trio_test()
async def test_a_catch_up_retries_a_state_whose_holders_were_cut_off(monkeypatch):
    """The head is found while a partition cuts its holders off: its fetch fails, and the
    catch-up keeps it out -- for `FORGIVE` seconds, not for the whole catch-up. Before, the
    state was never fetched after the partition healed; the peer retried its old step beside
    it and the run forked (the simulator, 4 peers, seed 74)."""
    from p2ptrain.ckpt import catchup as dl

    healed_at = trio.current_time() + 15.0
    calls = []

    async def fetch_checkpoint(node, run_id, spec, events, at_least, have_step, *, trusted, reject, avoid, resume):
        calls.append(trio.current_time())
        if "s" * 64 in reject:
            return None  # nothing else is advertised
        if trio.current_time() < healed_at:
            exc = dl.FetchError("no provider served the chunk manifest")
            exc.sha256 = "s" * 64
            raise exc
        return 3, b"state"

    monkeypatch.setattr(dl, "fetch_checkpoint", fetch_checkpoint)
    loaded = []
    step = await dl.adopt(None, "r", None, None, 3, 2, loaded.append, timeout=60.0)
    assert step == 3 and loaded == [b"state"], calls
    assert trio.current_time() - calls[0] < 15.0 + dl.FORGIVE + 1.0
