"""The commit/abort protocol (`p2ptrain.reduce.commit`), vote membership and blame rules, and
the exchange inbox, on the fast tier: boards and services in one process, trio autojump clock.
Rounds over real processes and sockets are in test_allreduce_integration.py."""

from __future__ import annotations

import numpy as np
import trio

from conftest import trio_test
from fakehost import FakeNet, decode
from p2ptrain.identity import Identity
from p2ptrain.reduce.blame import BlameConfig, BlameLedger, may_blame
from p2ptrain.reduce.bulk import session_tag
from p2ptrain.reduce.commit import CommitBoard, CommitConfig
from p2ptrain.reduce.control import pack
from p2ptrain.reduce.ctlstreams import CONTROL_PROTOCOL
from p2ptrain.reduce.service import VOTE_PROTOCOL, AllReduceConfig, AllReduceService, RoundFailed

TAG = session_tag("run", "7/0")
DIGEST = "ab" * 32
TIMEOUT = 10.0


def idents(n: int) -> list[Identity]:
    return [Identity.from_seed(bytes([i + 1]) * 32) for i in range(n)]


class Wire:
    """Delivers packed control messages between boards after `delay`; `drop` withholds."""

    def __init__(self, nursery: trio.Nursery, delay: float = 0.01) -> None:
        self.nursery, self.delay, self.boards = nursery, delay, {}
        self.drop = lambda src, dst, msg: False

    def board(self, ident: Identity, **cfg) -> CommitBoard:
        me = ident.peer_id

        async def send(ids: list[bytes], msg: bytes) -> None:
            for p in ids:
                if p != me and not self.drop(me, p, decode(msg)):
                    self.nursery.start_soon(self._deliver, me, p, decode(msg))

        b = self.boards[me] = CommitBoard(me, ident.sign, send, CommitConfig(**cfg))
        return b

    async def _deliver(self, src: bytes, dst: bytes, msg: dict) -> None:
        await trio.sleep(self.delay)
        if dst in self.boards:
            await self.boards[dst].handle(src, msg)


async def run_collect(boards, digests, ids, outcome, start=0.0):
    async def one(i):
        await trio.sleep(start)
        rnd = boards[i].rounds[TAG]
        ok = await boards[i].collect(rnd, digests[i], TIMEOUT)
        if not ok:
            await boards[i].abort(rnd)
        outcome[i] = ("commit" if ok else "abort", trio.current_time())

    async with trio.open_nursery() as n:
        for i in range(len(digests)):
            n.start_soon(one, i)


def setup(nursery, n):
    ids_ = idents(n)
    wire = Wire(nursery)
    boards = [wire.board(x) for x in ids_]
    ids = [x.peer_id for x in ids_]
    for b in boards:
        b.open(TAG, ids, ring=False)
    return wire, boards, ids


@trio_test()
async def test_all_same_digest_commits_everywhere():
    async with trio.open_nursery() as nursery:
        _, boards, ids = setup(nursery, 4)
        outcome = {}
        await run_collect(boards, [DIGEST] * 4, ids, outcome)
        assert {o[0] for o in outcome.values()} == {"commit"}
        assert len({b.rounds[TAG].cert for b in boards}) == 1


@trio_test()
async def test_one_different_digest_aborts_everyone_quickly():
    async with trio.open_nursery() as nursery:
        _, boards, ids = setup(nursery, 4)
        outcome = {}
        await run_collect(boards, [DIGEST] * 3 + ["cd" * 32], ids, outcome)
        assert {o[0] for o in outcome.values()} == {"abort"}
        assert max(o[1] for o in outcome.values()) < TIMEOUT  # everyone said "none": no waiting


@trio_test()
async def test_abort_vote_mid_round_aborts_everyone_with_no_result():
    async with trio.open_nursery() as nursery:
        _, boards, ids = setup(nursery, 4)
        await boards[3].abort(boards[3].rounds[TAG], "", "data plane failed")
        outcome = {}
        await run_collect(boards[:3], [DIGEST] * 3, ids, outcome, start=0.5)
        assert {o[0] for o in outcome.values()} == {"abort"}
        assert all(b.rounds[TAG].cert is None for b in boards)
        assert max(o[1] for o in outcome.values()) < TIMEOUT


@trio_test()
async def test_vote_withheld_from_one_member_does_not_split_the_round():
    """The attacker (member 3) sends its signed vote to members 0 and 1 but not 2: 0, 1 (and 3)
    hold every vote and commit; 2 asks for the certificate instead of aborting, and commits."""
    async with trio.open_nursery() as nursery:
        wire, boards, ids = setup(nursery, 4)
        wire.drop = lambda src, dst, msg: src == ids[3] and dst == ids[2] and msg["kind"] == "vote"
        outcome = {}
        await run_collect(boards, [DIGEST] * 4, ids, outcome)
        assert {i: o[0] for i, o in outcome.items()} == {i: "commit" for i in range(4)}
        assert outcome[2][1] <= 2 * TIMEOUT


@trio_test()
async def test_vote_withheld_from_everyone_aborts_everyone_within_the_timeout():
    async with trio.open_nursery() as nursery:
        wire, boards, ids = setup(nursery, 4)
        del wire.boards[ids[3]]  # the attacker votes for nothing and answers nothing
        outcome = {}
        await run_collect(boards[:3], [DIGEST] * 3, ids, outcome)
        assert {o[0] for o in outcome.values()} == {"abort"}
        assert max(o[1] for o in outcome.values()) <= 2 * TIMEOUT + 1


@trio_test()
async def test_ring_member_missing_votes_gets_the_certificate_from_one_still_running():
    """Ring rounds gather signatures on the ring; a member whose gather failed after it signed
    asks for the certificate. Member 0 is still finishing: it answers when it commits."""
    async with trio.open_nursery() as nursery:
        ids_ = idents(3)
        wire = Wire(nursery)
        boards = [wire.board(x) for x in ids_]
        ids = [x.peer_id for x in ids_]
        rnds = [b.open(TAG, ids, ring=True) for b in boards]
        sigs = [b.sign_vote(r, DIGEST) for b, r in zip(boards, rnds)]
        await boards[1].abort(rnds[1])  # never signed: answers "none", which must not end 2's wait
        got = {}

        async def late_commit():
            await trio.sleep(3)
            await boards[0].commit(rnds[0], DIGEST, sigs)

        async def recover():
            got["ok"] = await boards[2].recover(rnds[2], DIGEST, TIMEOUT)
            got["t"] = trio.current_time()

        nursery.start_soon(late_commit)
        nursery.start_soon(recover)
    assert got["ok"] and 3 <= got["t"] < 4


def _ring_signed(nursery, n: int):
    """A ring round of n whose members all signed DIGEST (their gathers then failed)."""
    ids_ = idents(n)
    wire = Wire(nursery)
    boards = [wire.board(x) for x in ids_]
    ids = [x.peer_id for x in ids_]
    rnds = [b.open(TAG, ids, ring=True) for b in boards]
    return wire, boards, ids, rnds, [b.sign_vote(r, DIGEST) for b, r in zip(boards, rnds)]


@trio_test()
async def test_survivors_of_a_member_gone_during_the_votes_abort_after_the_grace_not_the_timeout():
    """Member 2 died after signing: it answers nothing, and the survivors find it gone (no
    connection, no dial). They abort gone_grace after that, not at the commit timeout."""
    async with trio.open_nursery() as nursery:
        wire, boards, ids, rnds, _ = _ring_signed(nursery, 3)
        del wire.boards[ids[2]]

        async def gone(peers):
            return {p for p in peers if p == ids[2]}

        got = {}

        async def recover(i, probe):
            got[i] = (await boards[i].recover(rnds[i], DIGEST, TIMEOUT, gone=probe), trio.current_time())

        async with trio.open_nursery() as n:
            for i in (0, 1):
                n.start_soon(recover, i, gone)
        assert {i: ok for i, (ok, _) in got.items()} == {0: False, 1: False}
        grace = boards[0].config.gone_grace
        assert all(grace <= t <= grace + 2 * boards[0].config.gone_probe + 0.1 for _, t in got.values())
        # Without the probe: the whole timeout, as before.
        wire, boards, ids, rnds, _ = _ring_signed(nursery, 3)
        del wire.boards[ids[2]]
        t0 = trio.current_time()
        assert not await boards[0].recover(rnds[0], DIGEST, TIMEOUT)
        assert trio.current_time() - t0 >= TIMEOUT


@trio_test()
async def test_an_abort_vote_answers_a_certificate_query_the_aborting_member_dropped():
    """Member 3 is killed mid-round; member 1 (its predecessor) fails in its data plane a
    moment later, without signing. 0 and 2 had finished theirs and signed, and asked 1 for
    the certificate while it was still running, so 1 held their queries and dropped them
    when it aborted: its abort vote is its "none". 0 and 2 abort once 3 has been gone for
    gone_grace, not at the commit timeout (11 s after a SIGKILL in the real-process test)."""
    async with trio.open_nursery() as nursery:
        wire, boards, ids, rnds, _ = _ring_signed(nursery, 4)
        del wire.boards[ids[3]]

        async def gone(peers):
            return {p for p in peers if p == ids[3]}

        async def fail_later():
            await trio.sleep(1.0)  # after 0's and 2's queries reached it
            await boards[1].abort(rnds[1])

        got = {}

        async def recover(i):
            got[i] = (await boards[i].recover(rnds[i], DIGEST, TIMEOUT, gone=gone), trio.current_time())

        async with trio.open_nursery() as n:
            n.start_soon(fail_later)
            for i in (0, 2):
                n.start_soon(recover, i)
        assert {i: ok for i, (ok, _) in got.items()} == {0: False, 2: False}
        bound = boards[0].config.gone_grace + 2 * boards[0].config.gone_probe + 0.1
        assert all(t <= bound for _, t in got.values()), got


@trio_test()
async def test_a_certificate_found_after_answering_none_reaches_those_told_none():
    """Member 2 committed (it held every signature) and died, its answer to member 0 still
    on the way; member 1 cannot reach it and already heard "none" from 0. 0 commits when the
    certificate arrives and passes it on, so 1 commits too instead of aborting after the grace."""
    async with trio.open_nursery() as nursery:
        wire, boards, ids, rnds, sigs = _ring_signed(nursery, 3)
        await boards[2].commit(rnds[2], DIGEST, sigs)

        async def slow_deliver(src, dst, msg, _orig=wire._deliver):
            if src == ids[2]:
                if dst == ids[1]:
                    return
                await trio.sleep(1.5)
            await _orig(src, dst, msg)

        wire._deliver = slow_deliver  # from 2: to 1 never, to 0 after 1.5 s (within the grace)

        async def gone(peers):
            return {p for p in peers if p == ids[2]}

        got = {}

        async def recover(i, probe):
            got[i] = await boards[i].recover(rnds[i], DIGEST, TIMEOUT, gone=probe)

        async with trio.open_nursery() as n:
            n.start_soon(recover, 0, None)  # 0 can still reach 2: no probe
            n.start_soon(recover, 1, gone)
        assert got == {0: True, 1: True}


@trio_test()
async def test_votes_only_from_members_and_bounded_early_grace():
    async with trio.open_nursery() as nursery:
        wire, boards, ids = setup(nursery, 3)
        outsider = idents(5)[4]
        rnd = boards[0].rounds[TAG]
        abort = {"kind": "vote", "tag": TAG, "ok": False, "digest": "", "blame": "", "reason": "x"}
        await boards[0].handle(outsider.peer_id, abort)
        assert rnd.votes == {}
        # A future round: an unknown sender's vote is not stored at all ...
        future = session_tag("run", "8/0")
        await boards[0].handle(outsider.peer_id, {**abort, "tag": future})
        assert outsider.peer_id not in boards[0]._early
        # ... a known member's at most early_per_sender, and only into a round naming it.
        for k in range(10):
            await boards[0].handle(ids[1], {**abort, "tag": session_tag("run", f"9/{k}")})
        assert len(boards[0]._early[ids[1]]) == CommitConfig().early_per_sender
        r9 = boards[0].open(session_tag("run", "9/9"), ids, ring=True)
        assert list(r9.votes) == [ids[1]]
        assert len(boards[0]._early[ids[1]]) == 3  # its votes for other rounds stay
        # A forged ok vote (signature of another key) is dropped.
        fake = {"kind": "vote", "tag": TAG, "ok": True, "digest": DIGEST, "sig": boards[2].sign_vote(rnd, DIGEST)}
        await boards[0].handle(ids[1], fake)
        assert ids[1] not in rnd.votes


@trio_test()
async def test_an_early_vote_older_than_early_ttl_does_not_touch_a_round_opened_later():
    # A step trained again after everyone skipped it reuses the first try's round ids: an
    # abort vote of the first try, still waiting here, aborted the retry's round at once.
    async with trio.open_nursery() as nursery:
        wire = Wire(nursery)
        ids_ = idents(3)
        board = wire.board(ids_[0], early_ttl=60.0)
        ids = [x.peer_id for x in ids_]
        board.expect(ids)
        abort = {"kind": "vote", "ok": False, "digest": "", "blame": "", "reason": "first try"}
        retried, fresh = session_tag("run", "9/0"), session_tag("run", "9/1")
        await board.handle(ids[1], {**abort, "tag": retried})
        await trio.sleep(61.0)
        await board.handle(ids[2], {**abort, "tag": fresh})
        assert board.open(retried, ids, ring=True).votes == {}
        assert board.aborted(board.rounds[retried]) == []
        assert list(board.open(fresh, ids, ring=True).votes) == [ids[2]]


def test_blame_only_of_own_ring_predecessor_and_suspects():
    a, b, c, d = (x.peer_id for x in idents(4))
    ids = [a, b, c, d]
    assert may_blame(ids, c, b, ring=True) and may_blame(ids, a, d, ring=True)
    assert not may_blame(ids, c, a, ring=True) and not may_blame(ids, c, c, ring=True)
    assert may_blame(ids, c, a, ring=False)
    ledger = BlameLedger(BlameConfig(suspect_after=2))
    ledger.note("C", "B")
    ledger.note("D", "B")  # corroborated
    ledger.note("C", "X")
    assert ledger.suspects() == {}
    ledger.note("C", "Y")
    assert ledger.suspects() == {"C": 2}


@trio_test()
async def test_board_exposes_blame_under_the_rule_and_stops_trusting_a_suspect():
    async with trio.open_nursery() as nursery:
        ids_ = idents(4)
        wire = Wire(nursery)
        board = wire.board(ids_[0])
        ids = [x.peer_id for x in ids_]
        s = [x.peer_id_str for x in ids_]

        async def blame_round(k: int, order: list[bytes], blamer: bytes, target: str) -> dict:
            tag = session_tag("run", f"{k}/0")
            rnd = board.open(tag, order, ring=True)
            await board.handle(blamer, {"kind": "vote", "tag": tag, "ok": False, "digest": "", "blame": target,
                                        "reason": "bad"})
            out = board.blamed(rnd)
            board.close(rnd)
            return out

        assert await blame_round(1, ids, ids[2], s[0]) == {}  # 2's predecessor is 1, not 0
        assert await blame_round(2, ids, ids[2], s[1]) == {s[1]: "bad"}
        # Retried without 1, 2 blames its new predecessor 0: nobody else ever caught 0 or 1.
        assert await blame_round(3, [ids[0], ids[2], ids[3]], ids[2], s[0]) == {}
        assert board.ledger.suspects() == {s[2]: 2}


# -- the service over the fake host: these failed before the fix (commit 5f080d3) ------------
def service(net: FakeNet, ident: Identity) -> AllReduceService:
    svc = AllReduceService(net.host(ident.peer_id), ident, AllReduceConfig(mode="fp32"))
    svc.host.set_stream_handler(VOTE_PROTOCOL, svc._handle_vote)
    svc.host.set_stream_handler(CONTROL_PROTOCOL, svc.ctl.serve)
    return svc


@trio_test()
async def test_abort_vote_from_a_non_member_for_a_future_round_is_ignored():
    """Round tags are predictable: an outsider pre-sends an abort blaming an honest peer."""
    async with trio.open_nursery() as nursery:
        net = FakeNet(nursery)
        me, attacker, victim = idents(3)
        svc = service(net, me)
        evil = net.host(attacker.peer_id)
        stream = await evil.new_stream(_id(me), [VOTE_PROTOCOL])
        await stream.write(pack({"tag": session_tag("run", "5/0"), "ok": False, "digest": "",
                                 "blame": victim.peer_id_str, "reason": "made up"}))
        await stream.close()
        await trio.sleep(1)
        try:
            res = await svc.allreduce(np.ones(8, np.float32), "run", "5/0", [me.peer_id_str])
        except RoundFailed as exc:
            raise AssertionError(f"an outsider's vote aborted the round, blaming {exc.blamed}") from None
        assert np.array_equal(res.result, np.ones(8, np.float32))


def _id(ident: Identity):
    from libp2p.peer.id import ID

    return ID(ident.peer_id)


@trio_test()
async def test_flood_of_bogus_exchange_tags_does_not_evict_a_live_exchange():
    async with trio.open_nursery() as nursery:
        net = FakeNet(nursery)
        a, b, x = idents(3)
        sa, sb = service(net, a), service(net, b)
        evil = net.host(x.peer_id)
        members = [a.peer_id_str, b.peer_id_str]

        async def flood(at: float) -> None:
            await trio.sleep(at)
            for k in range(300):
                s = await evil.new_stream(_id(a), [VOTE_PROTOCOL])
                await s.write(pack({"tag": session_tag("run", f"bogus/{at}/{k}"), "kind": "data", "data": b"x"}))
                await s.close()

        async def b_late() -> None:
            await trio.sleep(1)
            await sb.exchange("run", "3/0/hdr", members, b"from-b", 10)

        nursery.start_soon(flood, 0.5)
        nursery.start_soon(b_late)
        nursery.start_soon(flood, 1.5)
        got = await sa.exchange("run", "3/0/hdr", members, b"from-a", 10)
        assert got[b.peer_id_str] == b"from-b"
        assert trio.current_time() < 5  # it arrived: no waiting for the timeout
        # Early: b's message arrives before a starts, then a flood; a still finds it.
        nursery.start_soon(sb.exchange, "run", "4/0/hdr", members, b"b-early", 10)
        await flood(1)
        got = await sa.exchange("run", "4/0/hdr", members, b"a-late", 10)
        assert got[b.peer_id_str] == b"b-early"
