"""Persistent bulk links, ring commit votes and buffer reuse (fast tier: real sockets, real
AES-GCM and Ed25519, one thread per member). The libp2p rounds that open and reuse links
are in test_allreduce_integration.py."""

from __future__ import annotations

import hashlib
import socket
import threading

import numpy as np
import pytest
from test_ring import make_ring, run_members

from p2ptrain.reduce import ringvote
from p2ptrain.reduce.bulk import FrameChannel, SocketIO, derive_key
from p2ptrain.identity import Identity, verify
from p2ptrain.reduce.links import OPEN_LEN, Link, LinkError, LinkTable, check_open, seal_open
from p2ptrain.reduce.ring import ArenaPool, RingConfig, RingError, allreduce


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


def link_pair(secret: bytes = b"k" * 32):
    a, b = tcp_pair()
    sender, receiver = b"S" * 38, b"R" * 38
    return (Link(receiver, SocketIO(a, 5), secret), Link(sender, SocketIO(b, 5), secret), sender, receiver)


def test_open_frame_authenticates_the_round_and_the_secret():
    out, inn, sender, receiver = link_pair()
    try:
        frame, key = seal_open(out, sender, b"round-01")
        assert len(frame) == OPEN_LEN
        assert check_open(inn, receiver, b"round-01", frame) == key
        frame2, key2 = seal_open(out, sender, b"round-01")
        assert key2 != key  # a fresh salt: never the same key twice, even for a reused round id
        with pytest.raises(LinkError, match="another round"):
            check_open(inn, receiver, b"round-02", frame)
        tampered = bytearray(frame)
        tampered[HEADER_SALT] ^= 1
        with pytest.raises(LinkError, match="authentication"):
            check_open(inn, receiver, b"round-01", bytes(tampered))
        stranger = Link(sender, inn.io, b"x" * 32)  # right peer id, wrong secret
        with pytest.raises(LinkError, match="authentication"):
            check_open(stranger, receiver, b"round-01", frame)
        with pytest.raises(LinkError):
            check_open(inn, receiver, b"round-01", frame[:-1])
    finally:
        out.close()
        inn.close()


HEADER_SALT = 32  # first salt byte


def test_a_link_whose_peer_closed_is_not_alive_and_tables_are_bounded():
    out, inn, _, _ = link_pair()
    assert out.alive()
    inn.close()
    for _ in range(100):  # the FIN arrives asynchronously
        if not out.alive():
            break
        threading.Event().wait(0.01)
    assert not out.alive()
    out.close()
    table = LinkTable(limit=2)
    links = [link_pair()[0] for _ in range(3)]
    for i, link in enumerate(links):
        link.peer = bytes([i]) * 38
        table.put(link)
    assert len(table) == 2 and table.take(bytes([0]) * 38) is None  # the oldest was closed
    assert links[0].sock.fileno() == -1
    table.close_all()
    assert all(link.sock.fileno() == -1 for link in links)


def vote_ring(world: int, digests: list[bytes], forge: int | None = None):
    """Every member gathers votes over real sockets; member `forge` signs with a wrong key."""
    ids = [Identity.generate() for _ in range(world)]
    publics = [i.public for i in ids]
    tag = b"votetag1"
    sends, recvs = [None] * world, [None] * world
    for i in range(world):
        a, b = tcp_pair()
        key = derive_key(b"s" * 32, bytes([i]), bytes([(i + 1) % world]), tag)
        sends[i] = FrameChannel(SocketIO(a, 5), key, tag, f"to{(i + 1) % world}")
        recvs[(i + 1) % world] = FrameChannel(SocketIO(b, 5), key, tag, f"from{i}")
    errors = [None] * world

    def member(i: int) -> None:
        signer = Identity.generate() if i == forge else ids[i]
        try:
            ringvote.gather(sends[i], recvs[i], i, world, tag, digests[i], signer.sign,
                            lambda j, sig, msg: verify(publics[j], sig, msg))
        except RingError as exc:
            errors[i] = str(exc)
            sends[i].close()
            recvs[i].close()

    run_members(member, world, 30)
    for ch in sends + recvs:
        ch.close()
    return errors


def test_ring_votes_commit_only_on_every_signed_identical_digest():
    d = hashlib.sha256(b"result").digest()
    assert vote_ring(4, [d] * 4) == [None] * 4
    other = hashlib.sha256(b"other").digest()
    errors = vote_ring(4, [d, d, other, d])
    assert all(errors), errors  # nobody commits
    assert any("different result" in e for e in errors)
    errors = vote_ring(3, [d] * 3, forge=1)
    assert errors[0] and errors[2], errors  # no honest member commits on a forged vote
    assert any("fails its signature" in (e or "") for e in errors)


def test_out_buffer_and_arena_pool_reuse_give_the_same_bits():
    """Rounds that reuse the pool's wire buffers and a caller's result buffer produce the very
    bits a round with fresh buffers does, and never write into the input."""
    world, n = 3, 200_003
    rng = np.random.default_rng(5)
    vecs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    cfg = RingConfig("int8", sub_chunk_bytes=64 * 1024)
    pools = [ArenaPool() for _ in range(world)]
    outs = [np.full(n, np.nan, np.float32) for _ in range(world)]
    digests = []
    for rnd in range(3):
        sends, recvs = make_ring(world)
        res, errs = [None] * world, [None] * world

        def member(i: int) -> None:
            try:
                res[i] = allreduce(vecs[i], i, world, sends[i], recvs[i], cfg, 10.0,
                                   out=outs[i] if rnd else None, pool=pools[i])
            except Exception as exc:  # reported below
                errs[i] = exc

        run_members(member, world, 30)
        assert errs == [None] * world
        assert all(r[0] is outs[i] for i, r in enumerate(res)) if rnd else True
        digests.append({r[2] for r in res} | {hashlib.sha256(r[0].tobytes()).hexdigest() for r in res[:1]})
    assert digests[0] == digests[1] == digests[2] and len(digests[0]) == 2
    with pytest.raises(ValueError, match="out must"):
        allreduce(vecs[0], 0, world, None, None, cfg, out=vecs[0])
