"""Ring all-reduce data plane over real sockets and real AES-GCM frames, one thread per
member (fast tier). Process-level and libp2p-level tests are in test_allreduce_*.py."""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time

import numpy as np
import pytest

from p2ptrain.reduce.bulk import FrameBudget, FrameChannel, SocketIO, derive_key
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


def run_ring(vecs, cfg, sends, recvs, timeout=10.0, extra=None):
    """Every member's round; `extra(i)`: member i's further `allreduce` keywords."""
    world = len(vecs)
    results, errors, digests = [None] * world, [None] * world, [None] * world

    def member(i):
        try:
            results[i], _, digests[i] = allreduce(vecs[i], i, world, sends[i], recvs[i], cfg, timeout,
                                                  **(extra(i) if extra else {}))
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


def test_check_sees_each_frames_sum_of_squares_and_can_blame():
    """`check` gets every received frame's sum of squares (of the values it decodes to,
    taken from the payload) before anything is mixed in; an exception with `peer` fails the
    round blaming that peer."""
    from p2ptrain import kernels as K

    world, n = 3, 300_007
    cfg = RingConfig("int8", sub_chunk_bytes=64 * 1024)
    vecs = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(world)]
    sends, recvs = make_ring(world)
    seen, wrong, errors = [0] * world, [0] * world, [None] * world

    class Bad(Exception):
        peer, reason = "evil", "made up"

    def member(i):
        def check(step, c, j, payload, sq):  # sq: the decoded values' sum of squares
            m = layout(n, world, cfg)[c][j][1] - layout(n, world, cfg)[c][j][0]
            a = np.frombuffer(payload, np.uint8)
            want = K.sumsq(K.dequantize(a[:m].view(np.int8), a[m:], cfg.block))
            wrong[i] += not abs(sq - want) <= 1e-12 * want
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


def _record_steps(ch) -> None:
    """ch.seen_steps: the step of every frame the channel delivered, by `recv` or `pull`."""
    ch.seen_steps = []
    recv, pull = ch.recv, ch.pull
    ch.recv = lambda fid, out: (ch.seen_steps.append(fid.step), recv(fid, out))[1]

    def pulled(fid, out):
        got = pull(fid, out)
        if got is not None:
            ch.seen_steps.append(fid.step)
        return got
    ch.pull = pulled


class _HeldSpy:
    """A check that is pending until `settle` (like `contribution.HeldChecker`) and records,
    at its first call, how many frames its member had already received."""

    def __init__(self, recv_ch) -> None:
        self.ev = threading.Event()
        self.recv_ch = recv_ch
        self.received_at_first_check: int | None = None
        self.steps_received_at_first_check: set[int] = set()

    def pending(self) -> bool:
        return not self.ev.is_set()

    def __call__(self, step, c, j, payload, sq) -> None:
        assert self.ev.wait(10.0)
        if self.received_at_first_check is None:
            self.received_at_first_check = self.recv_ch.stats.frames
            self.steps_received_at_first_check = set(self.recv_ch.seen_steps)


@pytest.mark.parametrize("world", [2, 4])
def test_a_held_check_reads_the_predecessors_own_chunk_ahead_and_changes_no_bit(world):
    """While the members' headers are not in (check pending), each member keeps receiving
    its predecessor's step-0 frames into spare buffers, so the link keeps moving; never a
    later frame (it may depend on our own progress: waiting for it would deadlock). The
    result is bit for bit the unchecked round's."""
    n = 300_007
    cfg = RingConfig("int8", sub_chunk_bytes=64 * 1024)
    vecs = [np.random.default_rng(10 + i).standard_normal(n).astype(np.float32) for i in range(world)]
    clean, _ = run_ring(vecs, cfg, *make_ring(world))
    sends, recvs = make_ring(world)
    for ch in recvs:  # which steps a channel has delivered so far, blocking or not
        _record_steps(ch)
    spies = [_HeldSpy(recvs[i]) for i in range(world)]
    threading.Timer(0.5, lambda: [s.ev.set() for s in spies]).start()
    results, errors = run_ring(vecs, cfg, sends, recvs, extra=lambda i: {"check": spies[i]})
    assert errors == [None] * world
    k = len(layout(n, world, cfg)[0])  # sub-chunks per chunk: the predecessor's step-0 frames
    assert k > 2
    for s in spies:
        assert s.received_at_first_check == k, "all of the predecessor's own chunk, nothing more"
        assert s.steps_received_at_first_check == {0}
    assert all(np.array_equal(r, clean[0]) for r in results)


def test_a_held_check_is_released_at_once_with_a_frame_half_in_and_the_rest_read_in_turn():
    """Read-ahead takes bytes as they come (`FrameChannel.pull`), never waiting inside a
    frame: a blocking read begun just before the headers came kept their checks (and the
    next step's frames) waiting for that frame's last byte. Here each member's transport
    hands read-ahead only half of the predecessor's second frame while the check is held
    (the rest "still on the wire"): the first check runs with one frame in hand as soon as
    it is released, the half-read frame is finished by the blocking read where the pull
    stopped, and the result is the plain round's, bit for bit."""
    world, n = 2, 300_007
    cfg = RingConfig("int8", sub_chunk_bytes=64 * 1024)
    vecs = [np.random.default_rng(20 + i).standard_normal(n).astype(np.float32) for i in range(world)]
    clean, _ = run_ring(vecs, cfg, *make_ring(world))
    sends, recvs = make_ring(world)
    spies = [_HeldSpy(recvs[i]) for i in range(world)]
    lay = layout(n, world, cfg)
    assert len(lay[0]) > 2
    budgets = []
    for i, ch in enumerate(recvs):
        lo, hi = lay[(i - 1) % world][1]
        budget = [(wire_bytes(hi - lo, cfg) + 48) // 2]  # half the predecessor's second frame
        budgets.append(budget)
        some = ch.io.recv_some

        def half(view, some=some, budget=budget):
            got = some(view[:budget[0]])
            budget[0] -= got
            return got
        ch.io.recv_some = half
        _record_steps(ch)
    threading.Timer(0.3, lambda: [s.ev.set() for s in spies]).start()
    results, errors = run_ring(vecs, cfg, sends, recvs, extra=lambda i: {"check": spies[i]})
    assert errors == [None] * world
    assert [s.received_at_first_check for s in spies] == [1] * world  # only the frame in hand
    assert budgets == [[0]] * world  # read-ahead did take the half it was given
    assert all(np.array_equal(r, clean[0]) for r in results)


def test_frames_that_arrive_while_we_encode_our_own_chunk_are_taken_at_once():
    """Encoding our whole own chunk comes before the first receive (~0.1 s a round for a 1B
    model); our predecessor's frames that arrive meanwhile are taken between encodes
    (`take_arrived`), so its link is not held back by a window we let close. Member 1
    starts first and sends its whole own chunk; member 0's first frames then come by pull,
    in its encoding, before any blocking read, and the result is the plain round's."""
    world, n = 2, 300_007
    cfg = RingConfig("int8", sub_chunk_bytes=64 * 1024)
    vecs = [np.random.default_rng(30 + i).standard_normal(n).astype(np.float32) for i in range(world)]
    clean, _ = run_ring(vecs, cfg, *make_ring(world))
    sends, recvs = make_ring(world)
    order = []
    recv, pull = recvs[0].recv, recvs[0].pull
    recvs[0].recv = lambda fid, out: (order.append("recv"), recv(fid, out))[1]
    recvs[0].pull = lambda fid, out: (lambda got: (order.append("pull") if got is not None else None, got)[1])(
        pull(fid, out))
    results = [None] * world

    def member(i):
        results[i] = allreduce(vecs[i], i, world, sends[i], recvs[i], cfg, 10.0)[0]

    first = threading.Thread(target=member, args=(1,))
    first.start()
    deadline = time.monotonic() + 5
    while recvs[0].io.available() < sum(wire_bytes(hi - lo, cfg) + 48 for lo, hi in layout(n, world, cfg)[1]) \
            and time.monotonic() < deadline:
        time.sleep(0.005)
    member(0)
    first.join(10)
    assert order[0] == "pull" and order.count("pull") >= 1, order[:5]
    assert all(np.array_equal(r, clean[0]) for r in results)


def test_a_frame_pulled_in_pieces_opens_once_whole_and_bad_frames_are_dropped_on_the_way():
    """`FrameChannel.pull` never blocks: None until the frame's last byte is in, then its
    length, the payload opened into `out`; a frame for another session ahead of it is
    dropped (logged) without failing the pull, and a broken header fails the channel."""
    a, b = tcp_pair()
    key, tag = derive_key(b"s" * 32, b"\0", b"\1", b"t" * 8), b"t" * 8
    tx, rx = FrameChannel(SocketIO(a, 5.0), key, tag, "tx"), FrameChannel(SocketIO(b, 5.0), key, tag, "rx")
    payload = np.random.default_rng(3).integers(0, 256, 50_000, dtype=np.uint8).tobytes()
    FrameChannel(SocketIO(a, 5.0), key, b"other-rd", "x").send(FrameId(0, 0), memoryview(payload))
    sealed = bytearray(len(payload) + 16)
    tx.aead.encrypt_into(tx._nonce(FrameId(0, 0)), payload, tx.header(FrameId(0, 0), len(payload)), sealed)
    wire = tx.header(FrameId(0, 0), len(payload)) + bytes(sealed)
    out = bytearray(len(payload))
    assert rx.pull(FrameId(0, 0), memoryview(out)) is None  # the stranger's frame may be in, ours is not
    for lo, hi in ((0, 10), (10, 20_000), (20_000, len(wire) - 1)):
        a.sendall(wire[lo:hi])
        deadline = time.monotonic() + 5
        while rx.io.available() < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert rx.pull(FrameId(0, 0), memoryview(out)) is None
    a.sendall(wire[-1:])
    got, deadline = None, time.monotonic() + 5
    while got is None and time.monotonic() < deadline:
        got = rx.pull(FrameId(0, 0), memoryview(out))
    assert got == len(payload) and bytes(out) == payload
    assert rx.stats.dropped == {"wrong-session": 1} and rx.stats.frames == 1
    a.sendall(b"XX" + bytes(30))
    with pytest.raises(RingError, match="malformed header"):
        while rx.pull(FrameId(0, 1), memoryview(out)) is None and time.monotonic() < deadline + 5:
            time.sleep(0.001)
    a.close()
    b.close()


def _trickle(sock, data: bytes, head: int, every: float, stop: threading.Event) -> threading.Thread:
    """Send `data`'s first `head` bytes at once, then one byte every `every` seconds."""
    def run():
        try:
            sock.sendall(data[:head])
            for i in range(head, len(data)):
                if stop.wait(every):
                    return
                sock.sendall(data[i:i + 1])
        except OSError:
            pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("head", [0, 5, 200])
def test_a_trickled_frame_fails_within_its_budget_and_blames_its_sender(head):
    """Slowloris (issue 32): a sender that trickles one byte every 0.2 s never lets a
    per-operation timeout of 1 s expire (it restarted on every partial read: 210 s for this
    1 KiB frame, blaming nobody). A frame once begun, in its header (head 0, 5) or its body
    (200), must be whole within its budget (0.5 s here, plus its size at 100 kB/s), and the
    channel then fails blaming the sender."""
    a, b = tcp_pair()
    key, tag = derive_key(b"s" * 32, b"\0", b"\1", b"t" * 8), b"t" * 8
    budget = FrameBudget(allowance=0.5, min_rate=100_000)
    tx = FrameChannel(SocketIO(a, 1.0), key, tag, "rx")
    rx = FrameChannel(SocketIO(b, 1.0), key, tag, "tx", budget=budget)
    payload = bytes(1000)
    sealed = bytearray(len(payload) + 16)
    tx.aead.encrypt_into(tx._nonce(FrameId(0, 0)), payload, tx.header(FrameId(0, 0), len(payload)), sealed)
    wire = tx.header(FrameId(0, 0), len(payload)) + bytes(sealed)
    stop = threading.Event()
    t0 = time.monotonic()
    _trickle(a, wire, head, 0.2, stop)
    try:
        with pytest.raises(RingError) as err:
            rx.recv(FrameId(0, 0), memoryview(bytearray(len(payload))))
        took = time.monotonic() - t0
        bound = budget.seconds(len(wire)) + (0.2 if head == 0 else 0.0)  # head 0: the first byte's wait is silence
        assert err.value.blame == "tx" and "slow frame" in err.value.reason, err.value
        assert bound - 0.3 < took < bound + 0.5, (took, bound)
        with pytest.raises(RingError, match="slow frame"):  # framing is lost for good
            rx.recv(FrameId(0, 1), memoryview(bytearray(len(payload))))
    finally:
        stop.set()
        a.close()
        b.close()


def test_silence_before_a_frame_blames_nobody_and_a_frame_sent_whole_passes_a_tight_budget():
    """An honest sender may wait for its own predecessor before a frame: silence before the
    first byte is the per-operation timeout's (no blame). A frame written in one go is whole
    within any budget, however late its first byte came."""
    a, b = tcp_pair()
    key, tag = derive_key(b"s" * 32, b"\0", b"\1", b"t" * 8), b"t" * 8
    tx = FrameChannel(SocketIO(a, 1.0), key, tag, "rx")
    rx = FrameChannel(SocketIO(b, 0.5), key, tag, "tx", budget=FrameBudget(allowance=0.05, min_rate=1e9))
    out = bytearray(200_000)
    try:
        with pytest.raises(RingError, match="timed out") as err:
            rx.recv(FrameId(0, 0), memoryview(out))
        assert err.value.blame is None
        payload = np.random.default_rng(1).integers(0, 256, len(out), dtype=np.uint8).tobytes()
        threading.Timer(0.3, tx.send, (FrameId(0, 0), memoryview(payload))).start()
        assert rx.recv(FrameId(0, 0), memoryview(out)) == len(out) and bytes(out) == payload
    finally:
        a.close()
        b.close()


def test_own_digests_hash_exactly_what_the_ring_sends_while_it_runs():
    """`OwnDigests` (the training path: our step-0 frames hashed beside the data plane): the
    ring hands over each own frame as it encodes it, a signer waiting from before the round
    starts gets the digests of exactly the bytes the eager `own_payloads` would sign, the
    round is bit for bit the plain one, and a round that ends (or stalls) before its frames
    exist fails the wait instead of hanging the signer."""
    from p2ptrain.reduce.ring import own_payloads
    from p2ptrain.run.contribution import NotEncoded, OwnDigests, frame_digest

    world, n = 3, 300_007
    cfg = RingConfig("int8", sub_chunk_bytes=64 * 1024)
    vecs = [np.random.default_rng(20 + i).standard_normal(n).astype(np.float32) for i in range(world)]
    clean, _ = run_ring(vecs, cfg, *make_ring(world))
    owns = [OwnDigests(len(layout(n, world, cfg)[i]), 10.0) for i in range(world)]
    digests = [None] * world
    signers = [threading.Thread(target=lambda i=i: digests.__setitem__(i, owns[i].wait())) for i in range(world)]
    for th in signers:
        th.start()
    results, errors = run_ring(vecs, cfg, *make_ring(world), extra=lambda i: {"on_own": owns[i]})
    for th in signers:
        th.join(10)
    assert errors == [None] * world
    assert all(np.array_equal(r, clean[0]) for r in results)
    for i in range(world):
        assert digests[i] == tuple(frame_digest(p) for p in own_payloads(vecs[i], i, world, cfg))

    over = OwnDigests(2, 10.0)
    over(0, memoryview(b"x"))
    over(-1, None)  # the round ended before frame 1 was encoded
    with pytest.raises(NotEncoded, match="ended before"):
        over.wait()
    with pytest.raises(NotEncoded, match="in time"):
        OwnDigests(1, 0.05).wait()


@pytest.mark.parametrize("n", [(16 << 20) // 4 * 4, (16 << 20) + 777, 5_000_003, 300_000, 1000])
def test_layout_puts_a_small_frame_at_each_end_of_a_chunk_on_super_block_bounds(n):
    """The first frame a member sends and the last one it receives are small (pipeline fill
    and drain), every cut stays on a super-block multiple, and the bytes on the wire are
    those of the whole tensor encoded at once (the bandwidth bound counts them)."""
    from p2ptrain import kernels as K
    from p2ptrain.reduce.schedule import EDGE_DIVISOR

    cfg = RingConfig(sub_chunk_bytes=4 << 20)
    sup = K.SUBS_PER_SUPER * cfg.block
    edge = cfg.sub_chunk_bytes // 4 // EDGE_DIVISOR
    lay = layout(n, 4, cfg)
    flat = [r for subs in lay for r in subs]
    assert flat[0][0] == 0 and flat[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:])) and all(hi > lo for lo, hi in flat)
    assert all(hi % sup == 0 for _, hi in flat[:-1])
    for subs in lay:
        if len(subs) > 1:
            sizes = [hi - lo for lo, hi in subs]
            assert sizes[0] == edge and edge - sup < sizes[-1] <= edge + sup
            assert min(sizes[1:-1]) > 2 * edge
    assert sum(wire_bytes(hi - lo, cfg) for lo, hi in flat) == wire_bytes(n, cfg)
    assert layout(n, 4, cfg) == lay  # a pure function: every member cuts the same frames


@pytest.mark.parametrize("world", [2, 4, 16, 64])
def test_a_ring_members_signed_header_fits_one_control_message_however_large_the_model(world):
    """A header lists the digest of every frame of the member's own chunk and travels as one
    control message (4 KiB). With 4 MiB sub-chunks a model past ~110M parameters (2 members)
    needed 56+ digests: every header was dropped as oversize and no verified round could
    commit. Chunks that large now get larger frames, at most MAX_FRAMES_PER_CHUNK."""
    from p2ptrain.identity import Identity
    from p2ptrain.reduce.bulk import session_tag
    from p2ptrain.reduce.control import MAX_CONTROL_MSG, pack
    from p2ptrain.reduce.schedule import MAX_FRAMES_PER_CHUNK
    from p2ptrain.run.contribution import Header, frame_digest, sign_header

    ident = Identity.from_seed(b"h" * 32)
    for n in (125_000_000, 2_000_000_000):  # GPT-2 small; an 8 GB fp32 model
        lay = layout(n, world, RingConfig())
        k = max(len(subs) for subs in lay)
        assert k <= MAX_FRAMES_PER_CHUNK
        assert sum(hi - lo for subs in lay for lo, hi in subs) == n
        h = Header("r" * 64, 10**6, 3, "a" * 64, ident.peer_id_str, tuple([1e30] * world),
                   tuple(frame_digest(bytes([i % 256, i // 256])) for i in range(k)), 1e31, 10**6, 10**12)
        msg = pack({"tag": session_tag("r" * 64, f"{10**6}/3/hdr"), "kind": "data", "data": sign_header(h, ident)})
        assert len(msg) - 4 <= MAX_CONTROL_MSG, (n, world, k, len(msg))
