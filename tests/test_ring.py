"""Ring all-reduce data plane over real sockets and real AES-GCM frames, one thread per
member (fast tier). Process-level and libp2p-level tests are in test_allreduce_*.py."""

from __future__ import annotations

import hashlib
import logging
import socket
import threading

import numpy as np
import pytest

from p2ptrain.reduce.bulk import FrameChannel, SocketIO, derive_key
from p2ptrain.reduce.ring import FrameId, RingConfig, RingError, allreduce, layout, wire_bytes


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


def make_ring(world: int, tag: bytes = b"t" * 8, timeout: float = 10.0):
    """Channels for a ring over socketpairs: sends[i] goes to member (i+1) % world."""
    sends, recvs = [None] * world, [None] * world
    for i in range(world):
        a, b = tcp_pair()
        key = derive_key(b"s" * 32, bytes([i]), bytes([(i + 1) % world]), tag)
        sends[i] = FrameChannel(SocketIO(a, timeout), key, tag, f"to{(i + 1) % world}")
        recvs[(i + 1) % world] = FrameChannel(SocketIO(b, timeout), key, tag, f"from{i}")
    return sends, recvs


def run_members(member, world: int, timeout: float = 60) -> None:
    """member(i) for every i, each in its own thread, all joined (bounded)."""
    threads = [threading.Thread(target=member, args=(i,)) for i in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def run_ring(vecs, cfg, sends, recvs, timeout=10.0):
    world = len(vecs)
    results, errors, digests = [None] * world, [None] * world, [None] * world

    def member(i):
        try:
            results[i], _, digests[i] = allreduce(vecs[i], i, world, sends[i], recvs[i], cfg, timeout)
        except Exception as exc:
            errors[i] = exc
            for ch in (sends[i], recvs[i]):
                ch.close()

    run_members(member, world)
    run_ring.digests = digests
    return results, errors


def rel_err(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("world", [2, 3, 4, 7])
@pytest.mark.parametrize("mode", ["int8", "fp32"])
def test_bit_identical_and_accurate(world, mode):
    rng = np.random.default_rng(world)
    n = 300_007  # not a multiple of any block or chunk size
    vecs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    originals = [v.copy() for v in vecs]
    cfg = RingConfig(mode=mode, sub_chunk_bytes=64 * 1024)
    results, errors = run_ring(vecs, cfg, *make_ring(world))
    assert errors == [None] * world
    digests = {hashlib.sha256(r.tobytes()).hexdigest() for r in results}
    assert len(digests) == 1, "members disagree"
    assert len(set(run_ring.digests)) == 1  # and so do the digests they would vote with
    exact = np.mean(np.stack(vecs).astype(np.float64), axis=0)
    err = rel_err(results[0], exact)
    assert err <= (1e-6 if mode == "fp32" else 0.010), err
    for v, o in zip(vecs, originals):
        assert np.array_equal(v, o)  # inputs untouched


def test_wrong_session_and_forged_frames_are_dropped(caplog):
    caplog.set_level(logging.WARNING, logger="p2ptrain.reduce.bulk")
    world, n = 3, 50_000
    rng = np.random.default_rng(7)
    vecs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    cfg = RingConfig(sub_chunk_bytes=16 * 1024)
    clean, _ = run_ring(vecs, cfg, *make_ring(world))
    sends, recvs = make_ring(world)
    # Member 0 first sends a correctly sealed frame for another round (its own key, another
    # session tag), then garbage sealed with a key it does not have.
    evil = FrameChannel(sends[0].io, derive_key(b"s" * 32, b"\0", b"\1", b"t" * 8), b"other-rd", "x")
    evil.send(FrameId(0, 0), memoryview(bytearray(100)))
    # A stranger's frame with the exact header member 1 expects next, sealed with a wrong key.
    lo, hi = layout(n, world, cfg)[0][0]
    forged = FrameChannel(sends[0].io, b"k" * 32, b"t" * 8, "x")
    forged.send(FrameId(0, 0), memoryview(bytearray(wire_bytes(hi - lo, cfg))))
    results, errors = run_ring(vecs, cfg, sends, recvs)
    assert errors == [None] * world
    assert all(np.array_equal(r, clean[0]) for r in results)
    assert any("reason=wrong-session" in m for m in caplog.messages)
    assert any("reason=bad-tag" in m for m in caplog.messages)


def test_dead_member_fails_everyone_without_touching_inputs():
    world, n = 4, 400_000
    rng = np.random.default_rng(3)
    vecs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    originals = [v.copy() for v in vecs]
    sends, recvs = make_ring(world, timeout=3.0)
    sends[2].close()
    recvs[2].close()  # member 2 is gone before it sends anything
    results, errors = run_ring([v for v in vecs], RingConfig(sub_chunk_bytes=16 * 1024), sends, recvs, timeout=3.0)
    assert all(isinstance(e, RingError) for e in errors), errors
    assert all(np.array_equal(v, o) for v, o in zip(vecs, originals))


def test_check_sees_each_frames_decoded_values_and_can_blame():
    """`check` gets every received frame's exact decoded values (in a reused buffer) before
    anything is mixed in; an exception with `peer` fails the round blaming that peer."""
    from p2ptrain import kernels as K

    world, n = 3, 300_007
    cfg = RingConfig("int8", sub_chunk_bytes=64 * 1024)
    vecs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(world)]
    sends, recvs = make_ring(world)
    seen, wrong, errors = [0] * world, [0] * world, [None] * world

    class Bad(Exception):
        peer, reason = "evil", "made up"

    def member(i):
        def check(step, c, j, payload, values):
            m = layout(n, world, cfg)[c][j][1] - layout(n, world, cfg)[c][j][0]
            a = np.frombuffer(payload, np.uint8)
            wrong[i] += not np.array_equal(values, K.dequantize(a[:m].view(np.int8), a[m:], cfg.block))
            seen[i] += 1
            if i == 2 and step == world:  # an all-gather frame
                raise Bad()
        try:
            allreduce(vecs[i], i, world, sends[i], recvs[i], cfg, 10.0, check=check)
        except Exception as exc:
            errors[i] = exc
            for ch in (sends[i], recvs[i]):
                ch.close()

    run_members(member, world)
    assert isinstance(errors[2], RingError) and errors[2].blame == "evil" and errors[2].reason == "made up"
    assert seen[2] > 1 and all(s > 0 for s in seen) and wrong == [0] * world
