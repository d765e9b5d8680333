"""Rounds between real libp2p nodes in one process (127.0.0.1): persistent links are made by
the first round, reused by the next, and replaced when one side dropped them. Every round's
digest is compared with a fresh-session round on the same inputs: reuse changes no bit."""

from __future__ import annotations


import numpy as np
import pytest
import trio

from conftest import each_member, service_cluster
from p2ptrain.reduce.service import AllReduceConfig, AllReduceService, RoundFailed

pytestmark = pytest.mark.integration


async def _cluster(nursery, world: int, **cfg):
    return await service_cluster(nursery, [AllReduceService] * world, **cfg)


async def _round(svcs, vecs, members, rid: str):
    return await each_member(len(svcs), lambda i: svcs[i].allreduce(vecs[i], "run", rid, members))


def test_links_are_reused_and_replaced_without_changing_a_bit():
    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await _cluster(nursery, 3, sub_chunk_bytes=256 * 1024)
            members = [n.identity.peer_id_str for n in nodes]
            rng = np.random.default_rng(3)
            vecs = [rng.standard_normal(700_001).astype(np.float32) for _ in range(3)]
            first = await _round(svcs, vecs, members, "r0")
            assert all(r.path == "direct" and not r.reused for r in first), first
            digest = first[0].digest
            assert {r.digest for r in first} == {digest}
            assert [len(s.sessions.out_links) for s in svcs] == [1, 1, 1]
            again = await _round(svcs, vecs, members, "r1")
            assert all(r.reused for r in again), again
            assert {r.digest for r in again} == {digest}
            assert all(np.array_equal(a.result, b.result) for a, b in zip(first, again))
            assert max(r.phases["setup"] for r in again) < min(r.phases["setup"] for r in first)
            # Member 1 drops its idle inbound link (as after a restart or an eviction): its
            # predecessor sees the closed socket and opens a fresh session; the rest reuse.
            svcs[1].sessions.in_links.close_all()
            await trio.sleep(0.1)
            third = await _round(svcs, vecs, members, "r2")
            assert {r.digest for r in third} == {digest}, third
            assert [r.reused for r in third] == [False, False, True]
            assert [len(s.sessions.out_links) for s in svcs] == [1, 1, 1]
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_failed_round_closes_its_links_and_the_retry_opens_new_ones():
    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await _cluster(nursery, 3, frame_timeout=3.0, setup_timeout=5.0)
            members = [n.identity.peer_id_str for n in nodes]
            vecs = [np.full(100_000, float(i + 1), np.float32) for i in range(3)]
            ok = await _round(svcs, vecs, members, "r0")
            assert all(not isinstance(r, RoundFailed) for r in ok), ok
            # Member 2 is missing from the next round: the other two fail it, and nothing of
            # that round survives in their link tables.
            out = await _round(svcs[:2], vecs[:2], members, "r1")
            assert all(isinstance(r, RoundFailed) for r in out), out
            assert len(svcs[0].sessions.out_links) == 0 and len(svcs[1].sessions.in_links) == 0
            retry = await _round(svcs, vecs, members, "r2")
            assert len({r.digest for r in retry}) == 1, retry
            assert np.allclose(retry[0].result, 2.0, atol=0.02)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_round_of_one_returns_its_own_vector():
    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await _cluster(nursery, 1)
            vec = np.arange(10, dtype=np.float32)
            res = await svcs[0].allreduce(vec, "run", "solo", [nodes[0].identity.peer_id_str])
            assert np.array_equal(res.result, vec) and res.result is not vec and res.sent_bytes == 0
            nursery.cancel_scope.cancel()

    trio.run(main)


from p2ptrain.bench.trickle import TricklingService  # noqa: E402  (the red-team bench's slowloris part)


async def _timed_round(svcs, vecs, members, timeout: float):
    """Every member's round "r0" at once: (results in member order, seconds each took)."""
    t0, took = trio.current_time(), {}

    async def member(i):
        try:
            return await svcs[i].allreduce(vecs[i], "run", "r0", members)
        finally:
            took[i] = trio.current_time() - t0

    return await each_member(len(svcs), member, timeout=timeout), took


@pytest.mark.parametrize("world, direct", [(2, True), (3, True), (2, False)],
                         ids=["pair", "ring-of-3", "pair-libp2p-fallback"])
def test_a_member_that_trickles_its_frames_fails_the_round_within_the_bound_and_is_blamed(world, direct):
    """Slowloris (issue 32): the last member sends its frames a byte every 0.1 s, below any
    per-read timeout (3 s here). Before, its successor waited as long as the trickle lasted
    (~1,000 s for these 10 KB frames), and nobody was blamed. Now the frame's budget (1 s +
    its size at 1 MB/s) runs out: the round fails at its successor, which blames the
    trickler, and every honest member reports that blame."""
    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await service_cluster(nursery, [AllReduceService] * (world - 1) + [TricklingService],
                                                frame_timeout=3.0, setup_timeout=5.0, frame_allowance=1.0,
                                                frame_min_rate_mbps=1.0, direct=direct)
            # The Sybil itself waits as long as it likes (its own send timeout would end its round).
            svcs[-1].config = AllReduceConfig(frame_timeout=600.0, setup_timeout=5.0, direct=direct)
            members = [n.identity.peer_id_str for n in nodes]
            sybil = members[-1]
            vecs = [np.full(20_000, float(i + 1), np.float32) for i in range(world)]
            out, took = await _timed_round(svcs, vecs, members, 30)
            out = out[:-1]
            assert all(isinstance(r, RoundFailed) for r in out), out
            took = max(took[i] for i in range(world - 1))
            assert all(sybil in r.blamed and "slow frame" in r.blamed[sybil] for r in out), [r.blamed for r in out]
            assert took < 5.0, took  # setup, a ~1 s budget, the abort votes
            nursery.cancel_scope.cancel()

    trio.run(main)


from p2ptrain.bench.trickle import PausingService  # noqa: E402


def test_a_member_silent_just_under_the_frame_timeout_before_each_frame_fails_the_round_within_its_budget():
    """The simulator's `trickle` on the real data plane: the last member of a ring of 3 is
    silent 2.5 s before each of its frames (the frame timeout is 3 s), then sends it whole.
    No frame is late, so nothing blames it; before the round's data budget, each ring step
    waited its pause and the round took ~15 s (8 frames and votes), every round it was in.
    Now the data plane closes at its budget (2 s + its bytes at 1 MB/s here): the round fails
    for the honest members, nobody blamed (rule R4 finds whose absence lets rounds finish)."""
    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await service_cluster(nursery, [AllReduceService] * 2 + [PausingService],
                                                frame_timeout=3.0, setup_timeout=5.0, frame_allowance=1.0,
                                                frame_min_rate_mbps=1.0, round_allowance=2.0)
            svcs[-1].every = 2.5  # read as each session opens
            members = [n.identity.peer_id_str for n in nodes]
            vecs = [np.full(20_000, float(i + 1), np.float32) for i in range(3)]
            out, took = await _timed_round(svcs, vecs, members, 60)
            out = out[:-1]
            assert all(isinstance(r, RoundFailed) and not r.blamed for r in out), out
            assert max(took[0], took[1]) < 9.0, took  # setup + the ~2.1 s budget + the abort
            assert any("overran its budget" in str(r) for r in out), [str(r) for r in out]
            nursery.cancel_scope.cancel()

    trio.run(main)
