"""The red team's hostile parts against real libp2p nodes in one process (127.0.0.1):
a member that withholds its commit vote (p2ptrain/bench/adversary.py `WithholdingService`)
makes its round abort on every member, none committing; the members retry without it and
commit. Garbage on every run protocol (p2ptrain/bench/attacker.py `garbage`) is dropped and
the next round still commits."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from conftest import each_member, service_cluster
from p2ptrain.bench.adversary import WithholdingService
from p2ptrain.reduce.service import AllReduceService, RoundFailed

pytestmark = pytest.mark.integration


async def _cluster(nursery, classes, **cfg):
    return await service_cluster(nursery, classes, **cfg)


def test_a_withheld_vote_aborts_the_round_on_every_member_and_the_retry_without_it_commits():
    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await _cluster(nursery, [AllReduceService, AllReduceService, WithholdingService],
                                         frame_timeout=5.0, setup_timeout=5.0, commit_timeout=4.0)
            members = [n.identity.peer_id_str for n in nodes]
            vecs = [np.full(50_000, float(i + 1), np.float32) for i in range(3)]
            t0 = trio.current_time()
            got = await each_member(3, lambda i: svcs[i].allreduce(vecs[i], "run", "1/0", members))
            # no certificate exists: every member aborts, nobody commits (commit-or-abort)
            assert all(isinstance(r, RoundFailed) for r in got), got
            assert svcs[2].withheld == 1
            assert trio.current_time() - t0 < 30  # bounded by commit_timeout, not a hang
            honest = members[:2]
            again = await each_member(2, lambda i: svcs[i].allreduce(vecs[i], "run", "1/1", honest))
            assert all(not isinstance(r, RoundFailed) for r in again), again
            assert again[0].digest == again[1].digest
            assert np.allclose(again[0].result, 1.5, atol=0.05)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_garbage_on_every_run_protocol_is_dropped_and_the_next_round_commits():
    from p2ptrain.bench.attacker import garbage

    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await _cluster(nursery, [AllReduceService, AllReduceService])
            members = [n.identity.peer_id_str for n in nodes]
            vecs = [np.full(50_000, float(i + 1), np.float32) for i in range(2)]
            said = await garbage(nodes[0].full_addrs()[0], 70, 7.0)
            assert said["sent"] >= 15 and said["targets"] >= 1, said
            # it reached the handlers this cluster serves (no blob server or NAT probe here)
            served = ("/p2ptrain/dht/1.0.0", "/p2ptrain/round/1.1.0", "/p2ptrain/bulk/1.0.0")
            assert all(said["by_protocol"][p] > 0 for p in served), said
            got = await each_member(2, lambda i: svcs[i].allreduce(vecs[i], "run", "1/0", members))
            assert all(not isinstance(r, RoundFailed) for r in got), got
            assert got[0].digest == got[1].digest
            nursery.cancel_scope.cancel()

    trio.run(main)
