"""Election I/O (p2ptrain.run.elect) and state records (p2ptrain.run.states) over the
in-memory DHT under trio's autojump clock: the deadline, the early close, the give-up, and
hostile records dropped. Also the pure rule (p2ptrain.run.election)."""

from __future__ import annotations

import random
import types

import msgpack
import pytest
import trio

from conftest import trio_test
from p2ptrain.dht.record import make_record
from p2ptrain.clock import wall_time
from p2ptrain.identity import Identity
from p2ptrain.records import RunRecords, codecs as records, keys
from p2ptrain.run import election, elect, states
from test_dht_memory import join_all, make_swarm

RUN = "ab" * 32
CFG = elect.ElectConfig(window=30.0, group_size=4, give_up=100.0)


async def swarm(n: int):
    net, nodes = make_swarm(n)
    await join_all(nodes)
    return nodes


def me(node) -> str:
    return node.identity.peer_id_str


async def ready_later(node, step: int, delay: float, joining: bool = False) -> None:
    await trio.sleep(delay)
    await elect.publish_ready(node, RUN, step, ["/ip4/127.0.0.1/tcp/1"], joining, CFG.window)


@trio_test()
async def test_step_closes_at_the_deadline_and_a_late_peer_is_left_out():
    a, b, c, *_ = await swarm(6)
    learned = {}
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(ready_later, a, 3, 0.0)
        nursery.start_soon(ready_later, b, 3, 5.0)
        nursery.start_soon(ready_later, c, 3, 40.0)  # after the deadline (0 + 30)
        await trio.sleep(0.1)
        group = await elect.elect(a, RUN, 3, me(a), CFG, set(), set(), lambda p, addrs: learned.update({p: addrs}))
        closed = trio.current_time() - t0
    # deadline = upper median of the trained records' first sightings (b's: the first poll after
    # its store at 5.0, polls at most poll_max apart) + window, + margin; no earlier (nobody was expected)
    assert 35.0 + CFG.margin <= closed <= 35.0 + CFG.poll_max + CFG.margin + 0.2, closed
    assert sorted(group) == sorted([me(a), me(b)])
    assert group == election.ring_order(RUN, 3, group)
    assert set(learned) == {me(a), me(b)} and learned[me(b)] == ["/ip4/127.0.0.1/tcp/1"]


@trio_test()
async def test_step_closes_early_once_every_expected_peer_is_ready():
    a, b, c, *_ = await swarm(6)
    for node in (a, b):  # both published a state at step 2: they are training it
        await elect.publish_state(node, RUN, records.State(2, "p" * 64, "c" * 64), CFG.window)
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(ready_later, a, 2, 0.0)
        nursery.start_soon(ready_later, b, 2, 3.0)
        await trio.sleep(0.1)
        group = await elect.elect(a, RUN, 2, me(a), CFG, set(), set())
        closed = trio.current_time() - t0
    assert closed < 5.0, closed
    assert sorted(group) == sorted([me(a), me(b)])


@trio_test()
async def test_expected_peer_from_last_roster_holds_the_step_until_the_deadline():
    a, b, c, *_ = await swarm(6)
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(ready_later, a, 4, 0.0)
        nursery.start_soon(ready_later, b, 4, 1.0)
        await trio.sleep(0.1)
        # c was in our last roster but never posts: it counts as ready 'now' toward the median
        # (b's 1.0), so the step waits out the window, once.
        group = await elect.elect(a, RUN, 4, me(a), CFG, set(), {me(b), me(c)})
        closed = trio.current_time() - t0
    assert 31.0 <= closed <= 32.0, closed
    assert sorted(group) == sorted([me(a), me(b)])


@trio_test()
async def test_the_next_step_expects_every_candidate_the_last_election_closed_with():
    """Rule E2: our election of step t remembers its candidates (`Sightings.closed`), and the
    trainer expects them all at t + 1, not only its own last roster. c (another group at
    step 5) posts step 6 20 s after a and b: expected, it is waited for and elected; with only
    the last roster expected (before), a closed at once without it, and peers that saw
    different records by then dealt different groups (16 real processes)."""
    a, b, c, *_ = await swarm(6)
    seen = election.Sightings()
    for node in (a, b, c):
        await ready_later(node, 5, 0.0)
    await elect.elect(a, RUN, 5, me(a), CFG, set(), set(), sightings=seen)
    assert seen.closed[5] == {me(a): 0, me(b): 0, me(c): 0}  # each with the try it posted (T7)

    async def step6(expected: set[str], step: int) -> tuple[list[str], float]:
        async with trio.open_nursery() as nursery:
            t0 = trio.current_time()
            nursery.start_soon(ready_later, a, step, 0.0)
            nursery.start_soon(ready_later, b, step, 0.0)
            nursery.start_soon(ready_later, c, step, 20.0)
            await trio.sleep(0.1)
            group = await elect.elect(a, RUN, step, me(a), CFG, set(), expected, sightings=seen)
            return group, trio.current_time() - t0

    group, took = await step6(set(seen.closed[5]) - {me(a)}, 6)
    assert sorted(group) == sorted([me(a), me(b), me(c)]) and 20.0 <= took <= 23.0, (group, took)
    group, took = await step6({me(b)}, 7)  # the last roster only
    assert sorted(group) == sorted([me(a), me(b)]) and took < 3.0, (group, took)


@trio_test()
async def test_a_peer_past_the_step_is_not_waited_for_and_a_retry_leaves_its_old_record_out():
    """Rule E9: b's state is at step 3, so at step 2 it is not coming: expected (our last
    roster), it does not hold the step; and in a retry of step 2 its old ready record is
    stale (it committed step 2 and moved on), so the retry does not elect it. A first try
    still counts such a record for the deal (the other groups' members commit before a late
    closer closes). Before: a peer partitioned away retried a step the others had long
    committed, elected them all from their old records, and waited for them (the simulator)."""
    a, b, c, *_ = await swarm(6)
    await elect.publish_state(b, RUN, records.State(3, "p" * 64, "c" * 64), CFG.window)
    await ready_later(b, 2, 0.0)  # its record from when it trained step 2
    await ready_later(a, 2, 0.0)
    t0 = trio.current_time()
    group = await elect.elect(a, RUN, 2, me(a), CFG, set(), {me(b), me(c)} - {me(c)}, retry=True)
    # closed at the deadline of a's own record (its window), not held up to two windows for b
    assert group == [me(a)] and trio.current_time() - t0 < CFG.window + 2, trio.current_time() - t0
    group = await elect.elect(a, RUN, 2, me(a), CFG, set(), set())  # a first try: b is dealt
    assert sorted(group) == sorted([me(a), me(b)])


@trio_test()
async def test_only_newcomers_ready_gives_up_after_the_bound():
    a, b, *_ = await swarm(5)
    t0 = trio.current_time()
    await elect.publish_ready(b, RUN, 7, [], True, CFG.window)  # joining: never starts the clock
    group = await elect.elect(a, RUN, 7, me(a), CFG, set(), set())
    assert group == []
    assert CFG.give_up <= trio.current_time() - t0 <= CFG.give_up + 1


@trio_test()
async def test_ignored_and_malformed_ready_records_are_left_out(caplog):
    a, b, c, d, *_ = await swarm(6)
    for node in (a, b, c):
        await elect.publish_ready(node, RUN, 1, [], False, CFG.window)
    await d.store(keys.ready(RUN, 1), b"\xc1not msgpack", ttl=60)  # hostile value: dropped, logged
    recs = await elect.read_ready(a, RUN, 1, CFG.window)
    assert {r.peer for r in recs} == {me(a), me(b), me(c)}
    group = await elect.elect(a, RUN, 1, me(a), CFG, {me(c)}, set())
    assert sorted(group) == sorted([me(a), me(b)])


@trio_test()
async def test_state_records_say_who_trains_which_step():
    nodes = await swarm(6)
    for i, node in enumerate(nodes[:5]):
        step, ckpt = (5, "x" * 64) if i < 2 else (5, "y" * 64) if i < 3 else (4, "z" * 64)
        await RunRecords(node, RUN).publish_state(records.State(step, "p" * 64, ckpt, loss=1.5,
                                                                addrs=("/ip4/1.2.3.4/tcp/9",)))
    assert await states.peers_at_step(nodes[5], RUN, 4) == {me(nodes[3]), me(nodes[4])}
    view = await RunRecords(nodes[5], RUN).state_view()
    assert view[me(nodes[0])]["loss"] == 1.5 and view[me(nodes[0])]["addrs"] == ["/ip4/1.2.3.4/tcp/9"]


# -- the pure rule ------------------------------------------------------------------------
def R(peer, at, joining=False):
    return election.Ready(peer, at, (), joining)


def test_deadline_ignores_newcomers():
    assert election.deadline([], 10) is None
    assert election.deadline([R("a", 5.0, True)], 10) is None
    # the upper median of the trained peers' times (7.0), not the earliest: one liar moves nothing
    assert election.deadline([R("a", 5.0, True), R("b", 7.0), R("c", 6.0)], 10) == 17.0


def test_candidates_are_those_ready_by_the_deadline_minus_excluded():
    recs = [R("a", 0.0), R("b", 1.0), R("c", 2.0), R("d", 12.5), R("e", 13.0), R("n", 3.0, True)]
    assert [r.peer for r in election.candidates(recs, 10, set())] == ["a", "b", "c", "n"]  # 2.0 + 10
    # Excluding a peer moves the deadline: it is computed without them (12.5 + 10).
    assert [r.peer for r in election.candidates(recs, 10, {"a"})] == ["b", "c", "d", "e", "n"]
    assert election.candidates([R("n", 0.0, True)], 10) == []


@pytest.mark.parametrize("n,g", [(1, 4), (4, 4), (5, 4), (9, 4), (10, 3)])
def test_groups_partition_everyone_with_near_equal_sizes(n, g):
    peers = [f"p{i}" for i in range(n)]
    gs = election.groups(RUN, 1, peers, g)
    assert sorted(p for grp in gs for p in grp) == sorted(peers)
    assert max(map(len, gs)) <= g and max(map(len, gs)) - min(map(len, gs)) <= 1
    for p in peers:  # every member computes the same group for itself, in ring order
        mine = election.my_group(RUN, 1, list(reversed(peers)), g, p)
        assert p in mine and mine == election.ring_order(RUN, 1, mine) and sorted(mine) in [sorted(x) for x in gs]
    assert election.my_group(RUN, 1, peers, g, "stranger") == []
    with pytest.raises(ValueError):
        election.groups(RUN, 1, peers, 0)


def test_groups_are_redrawn_every_step():
    peers = [f"p{i}" for i in range(12)]
    assert election.groups(RUN, 1, peers, 4) != election.groups(RUN, 2, peers, 4)


def test_roster_hash_binds_run_step_attempt_and_order():
    h = election.roster_hash(RUN, 3, 0, ["a", "b"])
    assert len(h) == 64 and h == election.roster_hash(RUN, 3, 0, ["a", "b"])
    others = {election.roster_hash(RUN, 3, 1, ["a", "b"]), election.roster_hash(RUN, 4, 0, ["a", "b"]),
              election.roster_hash(RUN, 3, 0, ["b", "a"]), election.roster_hash("cd" * 32, 3, 0, ["a", "b"]),
              election.roster_hash(RUN, 3, 0, ["a"])}
    assert h not in others and len(others) == 5


def test_ready_record_codec_bounds_and_rejects():
    rec = records.decode_ready("peer", records.encode_ready(12.5, [f"/ip4/1.1.1.1/tcp/{i}" for i in range(40)], True))
    assert rec.ready_at == 12.5 and rec.joining and len(rec.addrs) == keys.MAX_ADDRS
    for bad in (b"", b"\xc1", msgpack.packb([1]), msgpack.packb({"ready_at": float("nan")}),
                msgpack.packb({"ready_at": "x"}), b"\x00" * (records.MAX_READY_BYTES + 1),
                msgpack.packb({"ready_at": 1.0, "try": -1}), msgpack.packb({"ready_at": 1.0, "try": True}),
                msgpack.packb({"ready_at": 1.0, "try": 2 ** 21}), msgpack.packb({"ready_at": 1.0, "try": "1"})):
        with pytest.raises(records.RecordError):
            records.decode_ready("peer", bad)
    assert rec.tries == 0 and records.decode_ready("p", records.encode_ready(1.0, [], False, 3)).tries == 3
    assert b"try" not in records.encode_ready(1.0, [], False)  # a first try's record is as before
    assert records.decode_ready("p", records.encode_ready(1.0, [], False, 0, "ab" * 8)).boot == "ab" * 8
    for bad in ({"boot": b"\x01"}, {"boot": 7}, {"boot": "x" * 33}):
        with pytest.raises(records.RecordError):
            records.decode_ready("peer", msgpack.packb({"ready_at": 1.0, **bad}))
        with pytest.raises(records.RecordError):
            records.decode_state(msgpack.packb({"step": 1, "params": "p", "ckpt": "c", **bad}))


@trio_test()
async def test_an_expected_peer_that_is_gone_does_not_hold_the_step():
    """As above, but c is checked and found gone (crashed: no connection, no dial): the step
    closes once everyone else posted, not after the window (a peer killed mid-run, issue 17)."""
    a, b, c, *_ = await swarm(6)
    probed = []

    async def gone(peers):
        probed.append(set(peers))
        return set(peers) & {me(c)}

    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(ready_later, a, 4, 0.0)
        nursery.start_soon(ready_later, b, 4, 1.0)
        await trio.sleep(0.1)
        group = await elect.elect(a, RUN, 4, me(a), CFG, set(), {me(b), me(c)}, gone=gone)
        closed = trio.current_time() - t0
    assert closed < 3.0, closed
    assert sorted(group) == sorted([me(a), me(b)])
    assert probed and all(me(a) not in p for p in probed)  # only peers that had not posted


@trio_test()
async def test_an_expected_peer_that_announced_the_next_step_does_not_hold_this_one():
    """c's state record says step 4 (it caught up to it) but c joins step 5 ahead (rule E7):
    the step closes once a and b posted. Before: c counted as ready 'now' until two windows
    after the first record, and the step waited three join windows (a newcomer's catch-up
    stalled a running group for 60 s on a loaded machine)."""
    a, b, c, *_ = await swarm(6)
    for node in (a, b, c):
        await elect.publish_state(node, RUN, records.State(4, "p" * 64, "c" * 64), CFG.window)
    await elect.publish_ready(c, RUN, 5, ["/ip4/127.0.0.1/tcp/1"], True, CFG.window)
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(ready_later, a, 4, 0.0)
        nursery.start_soon(ready_later, b, 4, 1.0)
        await trio.sleep(0.1)
        group = await elect.elect(a, RUN, 4, me(a), CFG, set(), set())
        closed = trio.current_time() - t0
    assert closed < 5.0, closed
    assert sorted(group) == sorted([me(a), me(b)])


@trio_test()
async def test_an_early_closer_waits_for_a_member_that_closes_later():
    """Rule E14. a and b are at step 7 and expect c (their last candidates); c sat out step 6
    (its state is at 6) and announces step 8 as a joiner at 8 s (E7), so a closes then. n, a
    newcomer at 7, expects only the peers at 7 and closes at once on the same group. n's
    first confirmation must still be waiting when a's arrives: the exchange timeout from its
    close (5 s, before E14) was not (CI stop 42: the pair's step took 41 s, not 4)."""
    a, b, c, n, *_ = await swarm(6)
    for node in (a, b, n):
        await elect.publish_state(node, RUN, records.State(7, "p" * 64, "c" * 64), CFG.window)
    await elect.publish_state(c, RUN, records.State(6, "q" * 64, "c" * 64), CFG.window)
    closes, waits = {}, {}

    async def member(node, expected: set[str]) -> None:
        seen = election.Sightings()
        group = await elect.elect(node, RUN, 7, me(node), CFG, set(), expected, sightings=seen)
        closes[me(node)] = trio.current_time()
        waits[me(node)] = election.confirm_wait(seen.deadlines[7], wall_time(), CFG.margin + CFG.poll_max, 5.0, 60.0)
        assert sorted(group) == sorted([me(a), me(b), me(n)])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ready_later, a, 7, 0.0)
        nursery.start_soon(ready_later, b, 7, 0.0)
        nursery.start_soon(ready_later, n, 7, 0.0, True)
        nursery.start_soon(ready_later, c, 8, 8.0, True)
        await trio.sleep(0.1)
        nursery.start_soon(member, a, {me(b), me(c)})
        nursery.start_soon(member, n, set())
    assert closes[me(n)] + 5.0 < closes[me(a)], closes  # the exchange timeout alone misses a
    assert closes[me(n)] + waits[me(n)] > closes[me(a)] + 1.0, (closes, waits)
    # a closed early too (E7), so it waits as long; a reader that closed at the deadline
    # waits the exchange timeout plus the sighting skew, and one past it the timeout alone
    d = 1000.0
    assert election.confirm_wait(d, d + CFG.margin, CFG.margin + CFG.poll_max, 5.0, 60.0) == 5.0 + CFG.poll_max
    assert election.confirm_wait(d, d + 10.0, CFG.margin + CFG.poll_max, 5.0, 60.0) == 5.0
    assert election.confirm_wait(d, d - 200.0, CFG.margin + CFG.poll_max, 5.0, 60.0) == 60.0


@trio_test()
async def test_a_trained_record_for_the_next_step_is_no_sign_a_peer_skips_this_one():
    """Overlapped runs post their ready record for t + 1 (trained) beside round t: b, which
    did so before its record for t reached a, is still expected at t. Counting it as gone
    ahead (E7 as first built) closed step 0 on a alone, and both skipped it."""
    a, b, *_ = await swarm(6)
    for node in (a, b):
        await elect.publish_state(node, RUN, records.State(0, "p" * 64, "c" * 64), CFG.window)
    await elect.publish_ready(b, RUN, 1, ["/ip4/127.0.0.1/tcp/1"], False, CFG.window)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ready_later, a, 0, 0.0)
        nursery.start_soon(ready_later, b, 0, 3.0)
        await trio.sleep(0.1)
        group = await elect.elect(a, RUN, 0, me(a), CFG, set(), set())
    assert sorted(group) == sorted([me(a), me(b)])


@trio_test()
async def test_a_claimed_early_time_and_a_short_expiry_move_nothing():
    """Rule D1 over the DHT: a record claiming to be 10 minutes early, re-stored every 5 s
    with an 8 s expiry (the simulator's `expiry` attack), counts from when we first saw it."""
    a, b, *_ = await swarm(5)
    sightings = election.Sightings()
    await elect.publish_ready(a, RUN, 2, [], False, CFG.window)
    t_first = None
    for _ in range(4):
        await RunRecords(b, RUN).publish_ready(2, trio.current_time() - 600.0, [], False, ttl=8.0)
        recs = {r.peer: r.ready_at for r in await elect.read_ready(a, RUN, 2, CFG.window, sightings)}
        t_first = recs[me(b)] if t_first is None else t_first
        assert recs[me(b)] == t_first  # the first sighting, whatever the writer re-claims
        await trio.sleep(5.0)
    assert election.deadline([election.Ready(me(b), t_first, (), False)], CFG.window) == t_first + CFG.window


def test_cells_nest_and_a_full_cell_is_split():
    peers = [f"p{i}" for i in range(64)]
    for p in peers:
        got = election.cells(RUN, 5, p)
        assert got[0] == (0, 0) and [lvl for lvl, _ in got] == list(range(election.LEVELS))
        for (l1, c1), (l2, c2) in zip(got, got[1:]):
            assert c2 >> 2 == c1 and 0 <= c2 < 4 ** l2  # each cell is a quarter of its parent
    assert election.level_move(0, election.SPLIT - 1) == 0 and election.level_move(0, election.SPLIT) == 1
    assert election.level_move(election.LEVELS - 1, 10_000) == 0  # the finest level holds the rest
    assert election.level_move(2, election.SPLIT // 8 - 1) == -1 and election.level_move(0, 0) == 0


class _Board:
    """The DHT's record interface over one shared dict (many writers, no network): the cell
    rule at hundreds of peers in a unit test. Replies are not capped here; the simulator runs
    the real DHT at 256 and 1,000 peers (`p2ptrain bench sim`)."""

    def __init__(self, records: dict, ident) -> None:
        self.records, self.identity = records, ident
        self.transport = types.SimpleNamespace(learn_addrs=lambda *a: None)

    async def store(self, key, value, ttl):
        rec = make_record(self.identity, key, value, 1e12)
        self.records.setdefault(key, {})[rec.subkey] = rec
        return 1

    async def get(self, key):
        return dict(self.records.get(key, {}))

    def forget(self, key):
        pass


@trio_test()
async def test_every_member_of_a_big_run_computes_its_group_from_its_own_cell_alike():
    ids = [Identity.from_seed(random.Random(i).randbytes(32)) for i in range(2 * election.SPLIT + 40)]
    shared: dict = {}
    boards = [_Board(shared, ident) for ident in ids]
    for bd in boards:
        await elect.publish_ready(bd, RUN, 1, [], False, CFG.window)
    assert len(shared[keys.ready(RUN, 1)]) == len(ids)  # level 0 still holds everyone
    groups = {}
    for bd in boards:
        s = election.Sightings()
        recs = await elect.read_ready(bd, RUN, 1, CFG.window, s)
        assert s.level(1) == 1 and len(recs) < election.SPLIT  # a quarter of the run
        groups[bd.identity.peer_id_str] = election.my_group(RUN, 1, [r.peer for r in recs], 4,
                                                            bd.identity.peer_id_str)
    for p, g in groups.items():
        assert p in g and 3 <= len(g) <= 4
        assert all(groups[q] == g for q in g)  # every member of a group computes the same group


@trio_test()
async def test_a_big_run_s_election_reads_its_cell_s_state_records_not_the_run_s():
    """Rule E10: state records are filed under the writer's cells of its step and the step
    before, and the election reads only its own cell's. In a run of 360 peers, r (reading
    level 1: a quarter of the run) still waits for a same-cell peer that is at the step and
    has not posted, and a retry leaves out the record of one that moved past the step -- and
    r never reads the run's `state` key, which holds every peer's record (O(N) a read; at
    1,000 peers a reply showed a quarter of them). Before: the election read that key every
    probe second."""
    ids = [Identity.from_seed(random.Random(i).randbytes(32)) for i in range(2 * election.SPLIT + 40)]
    shared: dict = {}
    boards = [_Board(shared, ident) for ident in ids]
    r = boards[0]
    mine = election.cell(RUN, 1, me(r), 1)
    late, moved = [b for b in boards[1:] if election.cell(RUN, 1, me(b), 1) == mine][:2]
    for bd in boards:
        await elect.publish_state(bd, RUN, records.State(1, "p" * 64, "c" * 64), CFG.window)
        if bd is not late:
            await elect.publish_ready(bd, RUN, 1, [], False, CFG.window)
    assert len(shared[keys.state(RUN)]) == len(ids)
    read: list[str] = []
    get = r.get
    r.get = lambda key: (read.append(key), get(key))[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ready_later, late, 1, 5.0)
        t0 = trio.current_time()
        recs, _ = await elect.wait_for_deadline(r, RUN, 1, CFG, set(), set(), election.Sightings())
    assert late.identity.peer_id_str in {x.peer for x in recs} and 5.0 <= trio.current_time() - t0 < CFG.window
    assert keys.state(RUN) not in read and keys.state(RUN, 1, 1, mine) in read
    assert len(shared[keys.state(RUN, 1, 1, mine)]) < election.SPLIT
    # `moved` committed step 1: its state record (now step 2) replaces its entry in step 1's cell
    await elect.publish_state(moved, RUN, records.State(2, "p" * 64, "c" * 64), CFG.window)
    recs, _ = await elect.wait_for_deadline(r, RUN, 1, CFG, set(), set(), election.Sightings(), retry=True)
    assert me(moved) not in {x.peer for x in recs} and me(late) in {x.peer for x in recs}


@trio_test()
async def test_a_reader_that_moves_to_a_finer_level_files_its_own_records_there():
    """Rule E5: writers store at the levels they have read (0 .. one finer), and a reader
    that moves to a finer level stores its own records there as it arrives. With 700 peers
    the level-1 cells are full (~175), so step 1's readers move to level 2, where no record
    was stored before anyone read. Before, those cells stayed empty for the whole step:
    every reader waited on an empty cell (the simulator's 1,000-peer world formed no
    group in 30 s)."""
    ids = [Identity.from_seed(random.Random(i).randbytes(32)) for i in range(4 * election.SPLIT + 60)]
    shared: dict = {}
    boards = [_Board(shared, ident) for ident in ids]
    for bd in boards:
        await elect.publish_ready(bd, RUN, 1, [], False, CFG.window)
    assert not [k for k in shared if k.startswith(keys.ready(RUN, 1) + "/2.")]
    sights = {me(bd): election.Sightings() for bd in boards}
    for bd in boards:
        await elect.read_ready(bd, RUN, 1, CFG.window, sights[me(bd)])
    for bd in boards:
        recs = await elect.read_ready(bd, RUN, 1, CFG.window, sights[me(bd)])
        assert sights[me(bd)].level(1) == 2
        mine = election.cell(RUN, 1, me(bd), 2)
        assert {r.peer for r in recs} == {me(b) for b in boards if election.cell(RUN, 1, me(b), 2) == mine}


@trio_test()
async def test_a_retry_leaves_out_the_ready_record_an_earlier_incarnation_left():
    """Rule E11: b posted its ready record for step 0, crashed and started again (a new
    process: a new boot nonce in its records). Its new state record says step 0, but the
    record its earlier incarnation left is stale: that process will never come to the
    round. A retry leaves it out; a first try still deals it (as E9). Before: a peer's
    retry elected a restarted peer from its pre-crash record while it caught up, and waited
    out the retry's first confirmation for it (the simulator, 4 peers, seed 157)."""
    shared: dict = {}
    a, b = (_Board(shared, Identity.from_seed(bytes([i + 1]) * 32)) for i in range(2))
    for bd in (a, b):
        await elect.publish_state(bd, RUN, records.State(0, "p" * 64, "c" * 64), CFG.window)
        await elect.publish_ready(bd, RUN, 0, [], False, CFG.window)
    b_again = _Board(shared, b.identity)  # same identity and workdir, a new process
    await elect.publish_state(b_again, RUN, records.State(0, "p" * 64, "c" * 64), CFG.window)
    recs, _ = await elect.wait_for_deadline(a, RUN, 0, CFG, set(), set(), election.Sightings(), retry=True)
    assert {r.peer for r in recs} == {me(a)}
    recs, _ = await elect.wait_for_deadline(a, RUN, 0, CFG, set(), set(), election.Sightings())
    assert {r.peer for r in recs} == {me(a), me(b)}


@trio_test()
async def test_a_retry_leaves_out_an_earlier_try_s_record_whose_writer_joined_the_next_step_ahead():
    """Rule E15: b and c posted step 2 at try 1; then b announced step 3 as a joiner (it gave
    up on step 2 and waits for state 3), while c still sits out its retry wait. Our retry, at
    try 2, leaves b out and keeps c; a record of our own try stays whatever its writer also
    announced, and a first try still deals b (as E9). Before: the red team's sybil-4 dealt
    the Sybils' try-1 records into every later retry of the honest peers, who then held half
    the group without the tie-break, and no retry could go."""
    shared: dict = {}
    a, b, c, d = (_Board(shared, Identity.from_seed(bytes([i + 1]) * 32)) for i in range(4))
    for bd in (b, c):
        await elect.publish_ready(bd, RUN, 2, [], True, CFG.window, tries=1)
    await elect.publish_ready(a, RUN, 2, [], False, CFG.window, tries=2)
    await elect.publish_ready(d, RUN, 2, [], False, CFG.window, tries=2)
    for bd in (b, d):  # d announced step 3 too, but posted our try of step 2: it is coming
        await elect.publish_ready(bd, RUN, 3, [], True, CFG.window)
    recs, _ = await elect.wait_for_deadline(a, RUN, 2, CFG, set(), set(), election.Sightings(), retry=True)
    assert {r.peer for r in recs} == {me(a), me(c), me(d)}
    recs, _ = await elect.wait_for_deadline(a, RUN, 2, CFG, set(), set(), election.Sightings())
    assert {r.peer for r in recs} == {me(a), me(b), me(c), me(d)}


@trio_test()
async def test_a_peer_that_jumps_ahead_is_past_the_step_it_left_in_that_step_s_cell():
    """Rule E10: b's state was at step 0 and it caught up to step 4 at once; step 0's cell
    must say so (E9: not expected there), not go on saying 0. Before, the state record was
    filed under the new step and the one before only: step 0's readers kept waiting for b
    (the simulator, 4 peers, seed 157)."""
    shared: dict = {}
    a, b = (_Board(shared, Identity.from_seed(bytes([i + 1]) * 32)) for i in range(2))
    await elect.publish_state(b, RUN, records.State(0, "p" * 64, "c" * 64), CFG.window)
    assert (await elect.cell_states(a, RUN, 0, 0))[me(b)].step == 0
    await elect.publish_state(b, RUN, records.State(4, "e" * 64, "c" * 64), CFG.window)
    for t in (0, 3, 4):
        assert (await elect.cell_states(a, RUN, t, 0))[me(b)].step == 4


@trio_test()
async def test_members_at_a_later_try_or_past_the_step_are_away_from_our_try():
    """Rules E13 and T11, as a round's confirmation asks them (`elect.away`): at our try of
    step 2 with round tag 1, b posted try 2 (its try 1 ended uncommitted, or it restarted:
    it never confirms ours), c is past the step, d posted try 1 (ours: awaited). T11 applies
    only while we await every other member: then nobody waits on without us. Before T11
    a member that had moved to a later try was awaited for the whole first confirmation
    (the real Ctrl-C restart test: the survivor waited at try 0 for the restart, which
    waited at try 1 for it)."""
    shared: dict = {}
    a, b, c, d = (_Board(shared, Identity.from_seed(bytes([i + 1]) * 32)) for i in range(4))
    await elect.publish_ready(b, RUN, 2, [], False, CFG.window, tries=2)
    await elect.publish_ready(d, RUN, 2, [], False, CFG.window, tries=1)
    await elect.publish_state(c, RUN, records.State(3, "p" * 64, "c" * 64), CFG.window)
    everyone = {me(b), me(c), me(d)}
    assert await elect.away(a, RUN, 2, 0, everyone, 1, everyone) == {me(c)}  # d may come: wait with it
    assert await elect.away(a, RUN, 2, 0, {me(b), me(c)}, 1, {me(b), me(c)}) == {me(b), me(c)}
    assert await elect.away(a, RUN, 2, 0, {me(b), me(c)}, 2, {me(b), me(c)}) == {me(c)}  # b's try is ours
    # d confirmed and still waits for b: we wait with it (stopping alone sent a member on to
    # its next attempt alone while the others still waited: seed 105209)
    assert await elect.away(a, RUN, 2, 0, {me(b)}, 1, {me(b), me(d)}) == set()
    assert await elect.away(a, RUN, 2, 0, set(), 1, everyone) == set()


@trio_test()
async def test_a_reader_of_a_sparse_child_cell_reads_its_full_parent_once_a_step():
    """A reader whose level-2 cell holds few records yet (early in a step) checks whether
    its parent is still full (a run that shrank moves back up); a step's records only
    accumulate, so once seen full the parent is not read again that step. Before, every
    poll read the parent's ~175-250 records beside its own cell's few."""
    ids = [Identity.from_seed(random.Random(i).randbytes(32)) for i in range(4 * election.SPLIT + 60)]
    shared: dict = {}
    boards = [_Board(shared, ident) for ident in ids]
    for bd in boards:
        await elect.publish_ready(bd, RUN, 1, [], False, CFG.window)
    r, s = boards[0], election.Sightings()
    read: list[str] = []
    get = r.get
    r.get = lambda key: (read.append(key), get(key))[1]
    for _ in range(5):
        await elect.read_ready(r, RUN, 1, CFG.window, s)
    parent = keys.ready(RUN, 1, 1, election.cell(RUN, 1, me(r), 1))
    assert s.level(1) == 2 and read.count(parent) == 1, read.count(parent)


@trio_test()
async def test_an_election_still_waiting_a_window_asks_whether_the_run_moved_on():
    """Rule E16: an election that still waits a join window after it began asks H3 again,
    once a window, and ends (None: the trainer skips the step) when we adopted a later state
    -- a partition that healed while a retry waited for a slow joiner left the run 4 steps
    ahead (simulator seed 111371). One that closes within a window never asks."""
    a, b, *_ = await swarm(5)
    asked: list[float] = []
    t0 = trio.current_time()

    def behind_after(n: int):
        async def behind() -> bool:
            asked.append(trio.current_time() - t0)
            return len(asked) >= n
        return behind

    await elect.publish_ready(b, RUN, 7, [], True, CFG.window)  # a joiner only: the step never closes
    got = await elect.wait_for_deadline(a, RUN, 7, CFG, set(), set(), election.Sightings(), behind=behind_after(2))
    assert got is None
    assert len(asked) == 2 and CFG.window <= asked[0] < asked[1] - CFG.window + 1.0, asked
    assert trio.current_time() - t0 < CFG.give_up
    asked.clear()
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ready_later, a, 8, 0.0)
        nursery.start_soon(ready_later, b, 8, 1.0)
        await trio.sleep(0.1)
        group = await elect.elect(a, RUN, 8, me(a), CFG, set(), {me(b)}, behind=behind_after(1))
    assert sorted(group) == sorted([me(a), me(b)]) and asked == []  # closed early: never asked
