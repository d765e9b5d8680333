"""Hostile abort votes against real services over real libp2p in one process (127.0.0.1):
an accusation counts only against the accuser's ring predecessor, and an accuser nobody
corroborates becomes a suspect. Failed at commit 5f080d3 (any member's blame was passed on)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from p2ptrain.identity import peer_id_from_str
from p2ptrain.reduce.bulk import session_tag
from p2ptrain.reduce.control import pack
from p2ptrain.reduce.service import RoundFailed
from test_links_service import _cluster

pytestmark = pytest.mark.integration


async def _accused_round(svcs, order: list[str], rid: str, accuser: int, accused: str):
    """Every member but `accuser` runs the round; the accuser, once they started, sends
    abort votes blaming `accused`. Returns each honest member's RoundFailed."""
    honest = [i for i, s in enumerate(svcs) if i != accuser]
    out: dict = {}
    vec = np.ones(50_000, np.float32)

    async def one(i: int) -> None:
        try:
            await svcs[i].allreduce(vec, "run", rid, order)
            out[i] = None
        except RoundFailed as exc:
            out[i] = exc

    async def accuse() -> None:
        await trio.sleep(0.5)
        msg = pack({"tag": session_tag("run", rid), "ok": False, "digest": "", "blame": accused, "reason": "lies"})
        await svcs[accuser]._send_all([peer_id_from_str(m) for m in order], msg)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in honest:
                nursery.start_soon(one, i)
            nursery.start_soon(accuse)
    assert all(isinstance(out[i], RoundFailed) for i in honest), out
    return [out[i] for i in honest]


def test_blame_counts_only_against_the_accusers_predecessor_and_liars_become_suspects():
    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await _cluster(nursery, 3, setup_timeout=20.0)
            a, b, m = (n.identity.peer_id_str for n in nodes)
            # m's predecessor is b: its accusation of a (its successor) is not acted on.
            for exc in await _accused_round(svcs, [a, b, m], "r1", 2, a):
                assert a not in exc.blamed, exc.blamed
            # m's predecessor is a: this one it could judge, so it counts (once).
            for exc in await _accused_round(svcs, [b, a, m], "r2", 2, a):
                assert exc.blamed == {a: "lies"}, exc.blamed
            # A second accusation nobody corroborates: m is a suspect, its blame ignored.
            for exc in await _accused_round(svcs, [a, b, m], "r3", 2, b):
                assert b not in exc.blamed and exc.suspects == {m: 2}, (exc.blamed, exc.suspects)
            nursery.cancel_scope.cancel()

    trio.run(main)
