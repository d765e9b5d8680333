"""Ring rounds start their data plane before the contribution headers are in (issue 17:
signing and the header exchange held back the first byte by 0.07-0.45 s), and every frame's
check waits for the verified headers (`contribution.HeldChecker`). Against real libp2p nodes
on 127.0.0.1: a member whose header is forged gets no frame mixed in anywhere, every honest
member rejects it and the retry without it commits the honest mean; and the held check
itself releases, fails or passes exactly as settled."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import trio

from conftest import service_cluster
from p2ptrain.bench.adversary import HostileContributor
from p2ptrain.events import EventSink
from p2ptrain.reduce.service import AllReduceService
from p2ptrain.run import election
from p2ptrain.run.contribution import HeldChecker
from p2ptrain.run.ledger import Ledger
from p2ptrain.run.round import ContributionRound, RoundConfig


class _Spy:
    def __init__(self) -> None:
        self.calls = 0

    def check(self, *a) -> None:
        self.calls += 1


def test_held_check_waits_for_settle_then_passes_or_fails_without_blame():
    held, spy = HeldChecker(5.0), _Spy()
    assert held.pending()  # the ring reads step-0 frames ahead meanwhile
    threading.Timer(0.2, held.settle, (spy,)).start()
    t0 = time.monotonic()
    held.check(0, 0, 0, b"", 0.0)
    assert spy.calls == 1 and time.monotonic() - t0 >= 0.15 and not held.pending()
    held.settle(None, "ignored: the first settle stands")
    held.check(1, 0, 0, b"", 0.0)
    assert spy.calls == 2
    bad = HeldChecker(5.0)
    bad.settle(None, "bad-signature")
    with pytest.raises(ValueError, match="bad-signature") as exc:
        bad.check(0, 0, 0, b"", 0.0)
    assert not getattr(exc.value, "peer", None)  # the ring must not blame its predecessor
    with pytest.raises(TimeoutError):
        HeldChecker(0.05).check(0, 0, 0, b"", 0.0)


@pytest.mark.integration
def test_a_forged_header_aborts_the_pipelined_round_and_the_retry_commits_the_honest_mean():
    n = 300_000
    rng = np.random.default_rng(7)
    ds = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]

    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await service_cluster(nursery, [AllReduceService] * 3, frame_timeout=5.0,
                                                setup_timeout=5.0, commit_timeout=4.0)
            ids = [nd.identity.peer_id_str for nd in nodes]
            rounds = []
            for i, (nd, svc) in enumerate(zip(nodes, svcs)):
                cfg = RoundConfig("int8", svc.config.sub_chunk_bytes, 5.0)
                contributor = HostileContributor("forge") if i == 2 else None
                rounds.append(ContributionRound("run", nd.identity, svc, cfg,
                                                Ledger(ids[i], EventSink(ids[i], False)), contributor))
            group = election.ring_order("run", 1, ids)
            outs = [None] * 3

            async def one(i):
                outs[i] = await rounds[i].run(1, ds[i], group, "ab" * 32, 100, 4)

            with trio.fail_after(90):
                async with trio.open_nursery() as inner:
                    for i in range(3):
                        inner.start_soon(one, i)
            nursery.cancel_scope.cancel()
        return ids, outs, rounds

    ids, outs, rounds = trio.run(main)
    honest = [0, 1]
    for i in honest:
        assert ids[2] in rounds[i].ledger.ignored  # rejected for its header, by every honest member
        assert sorted(outs[i].members) == sorted(ids[:2])
    assert outs[0].result.tobytes() == outs[1].result.tobytes()  # one commit, identical bytes
    exact = (ds[0] + ds[1]) / 2
    assert np.abs(outs[0].result - exact).max() < 0.05 * np.abs(exact).max()


@pytest.mark.integration
def test_a_round_that_fails_before_its_data_plane_releases_the_signer_at_once():
    """A member that never shows up fails our round in setup: the ring never ran, so nothing
    told the signer (waiting for our own frames, `OwnDigests`) that none will come, and it
    waited out its own timeout: 6-8 s of "headers" per attempt after a peer was killed
    (issue 17). The service now ends it with the round."""
    from p2ptrain.reduce.service import RoundFailed
    from p2ptrain.run.contribution import NotEncoded, OwnDigests

    async def main():
        async with trio.open_nursery() as nursery:
            _, svcs = await service_cluster(nursery, [AllReduceService] * 2, setup_timeout=1.0)
            members = [s.identity.peer_id_str for s in svcs]
            own, got = OwnDigests(4, timeout=30.0), {}

            async def signer():
                t0 = trio.current_time()
                try:
                    await trio.to_thread.run_sync(own.wait)
                except NotEncoded:
                    got["released_after"] = trio.current_time() - t0

            nursery.start_soon(signer)
            with pytest.raises(RoundFailed):  # member 1 never joins the round
                await svcs[0].allreduce(np.ones(1 << 12, np.float32), "run", "r1", members, on_own=own)
            with trio.fail_after(5):
                while "released_after" not in got:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        return got

    got = trio.run(main)
    assert got["released_after"] < 5, got


@pytest.mark.parametrize("stranger_first", [True, False])
def test_a_roster_confirmation_answers_a_stranger_over_real_nodes(stranger_first):
    """Real libp2p nodes: newcomer N confirms [A, N] while A's roster is [A, B] (it never
    elected N). A answers N's confirmation with its own whether N wrote first (A answers when
    it starts) or last (A had finished: answered from its recent exchanges), so N hears A's
    view instead of waiting out the timeout for a member it took for silent. A's result never
    holds N's message."""

    async def main():
        async with trio.open_nursery() as nursery:
            _, (a, b, n) = await service_cluster(nursery, [AllReduceService] * 3)
            ia, ib, in_ = (s.identity.peer_id_str for s in (a, b, n))
            got = {}

            async def newcomer():
                got["n"] = await n.exchange("run", "5/0/roster", [ia, in_], b"n's view", 10.0,
                                            answer_strangers=True)

            async def members():
                got["a"], got["b"] = None, None

                async def one(svc, key, payload):
                    got[key] = await svc.exchange("run", "5/0/roster", [ia, ib], payload, 10.0,
                                                  answer_strangers=True)
                async with trio.open_nursery() as inner:
                    inner.start_soon(one, a, "a", b"a's view")
                    inner.start_soon(one, b, "b", b"b's view")

            t0 = trio.current_time()
            if stranger_first:
                nursery.start_soon(newcomer)
                await trio.sleep(0.5)
                await members()
            else:
                await members()
                await newcomer()
            with trio.fail_after(8):
                while "n" not in got:
                    await trio.sleep(0.05)
            took = trio.current_time() - t0
            plain = await n.exchange("run", "5/0/hdr", [ia, in_], b"header", 1.0)
            nursery.cancel_scope.cancel()
        return got, took, plain, ia

    got, took, plain, ia = trio.run(main)
    assert got["n"][ia] == b"a's view" and took < 6, (got, took)
    assert set(got["a"]) == set(got["b"]) and all(v is not None for v in got["a"].values())
    assert b"n's view" not in got["a"].values()
    assert plain[ia] is None  # an exchange A never ran: nothing answers for it
