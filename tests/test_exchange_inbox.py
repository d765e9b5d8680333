"""`p2ptrain.reduce.exchange.Inbox.collect` in memory under trio's autojump clock: who an
exchange stops waiting for (issue 17: a peer killed mid-run cost its group the whole wait)."""

from __future__ import annotations

import trio
import trio.testing

from p2ptrain.reduce.exchange import Inbox, InboxConfig

ME, A, B = b"me", b"a", b"b"


def _collect(undelivered=(), gone_after=None, silent=True, timeout=20.0, b_answers_at=None, cut=None, a_at=None):
    """A answers at once; B at `b_answers_at` seconds, or never. `gone` finds B gone from its
    `gone_after`-th call on. Returns ((result, fake seconds taken), the probes made)."""
    inbox = Inbox(known=lambda p: True)
    calls = []

    async def send():
        if a_at is None:
            inbox.put(A, b"tag", b"from a")
        return set(undelivered)

    async def late_a():
        await trio.sleep(a_at)
        inbox.put(A, b"tag", b"from a")

    async def gone(peers):
        calls.append(set(peers))
        return {B} & peers if gone_after is not None and len(calls) >= gone_after else set()

    async def late_b():
        await trio.sleep(b_answers_at)
        inbox.put(B, b"tag", b"from b")

    async def main():
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            if b_answers_at is not None:
                nursery.start_soon(late_b)
            if a_at is not None:
                nursery.start_soon(late_a)
            got = await inbox.collect(b"tag", [ME, A, B], ME, timeout, send, silent, gone=gone, cut=cut)
        return got, trio.current_time() - t0

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)), calls


def test_a_member_no_stream_opened_to_is_probed_at_once_and_silent_if_gone():
    (got, took), calls = _collect(undelivered={B}, gone_after=1)
    assert got == {A: b"from a"} and took < 0.5 and calls == [{B}]


def test_a_member_whose_stream_failed_but_is_there_is_still_waited_for():
    """A failed stream open ("no valid connections") is often transient: CI caught an honest
    member left out of its group when that alone counted it silent."""
    (got, took), _ = _collect(undelivered={B}, b_answers_at=3.0)
    assert got == {A: b"from a", B: b"from b"} and 3.0 <= took < 3.5


def test_a_member_that_died_after_our_message_is_dropped_at_the_next_probe():
    (got, took), calls = _collect(gone_after=3)
    assert got == {A: b"from a"} and 2.5 < took < 4.0, took
    assert all(c == {B} for c in calls)  # only members still awaited are probed


def test_without_unreachable_silent_the_exchange_waits_out_its_timeout():
    (got, took), calls = _collect(undelivered={B}, gone_after=1, silent=False)
    assert got == {A: b"from a"} and took >= 20.0 and calls == []


def test_a_cut_exchange_waits_at_most_cut_seconds_after_the_first_answer():
    """Rule R4a: a member left out of an attempt waits the attempt's whole span at the next
    confirmation, for the others still in it; once one answers, that attempt is over, and a
    silent member is waited for `cut` seconds more, not the span. Before, a real red-team
    run's member waited 139 s for a withholder the others had given up on long before."""
    (got, took), _ = _collect(timeout=300.0, cut=20.0, a_at=50.0)
    assert got == {A: b"from a"} and took == 70.0, took
    (got, took), _ = _collect(timeout=300.0, cut=20.0, a_at=50.0, b_answers_at=60.0)
    assert got == {A: b"from a", B: b"from b"} and took == 60.0, took  # nothing is cut short
    (got, took), _ = _collect(timeout=300.0, cut=20.0)  # answered before we started: 20 s from the start
    assert got == {A: b"from a"} and took == 20.0, took
    (got, took), _ = _collect(timeout=300.0)
    assert took == 300.0, took


def test_an_exchange_that_answers_strangers_answers_each_once_before_during_and_after():
    """Roster confirmation answers strangers (`collect(answer=...)`): a newcomer N lists us
    while our roster lacks it; without our answer it takes us for silent and misses the step.
    N wrote before we started (answered when we start), S during, L after we finished (one of
    the last RECENT_ANSWERS exchanges): each gets our payload once; members never do, and an
    exchange that does not answer strangers answers nobody."""
    from p2ptrain.reduce.exchange import RECENT_ANSWERS, InboxConfig

    inbox = Inbox(known=lambda p: p in (A, B), config=InboxConfig(strangers=3))
    N, S, L, X = b"n", b"s", b"l", b"x"
    replied: list[bytes] = []

    async def reply(strangers):
        replied.extend(strangers)

    async def main():
        assert inbox.put(N, b"tag", b"from n") is None  # before: kept as an early message
        assert inbox.put(N, b"other", b"n elsewhere") is None

        async def send():
            assert inbox.put(A, b"tag", b"from a") is None
            assert inbox.put(S, b"tag", b"from s") == b"mine"  # during: the caller sends it
            assert inbox.put(S, b"tag", b"again") is None  # once
            assert inbox.put(B, b"tag", b"from b") is None
            return set()

        got = await inbox.collect(b"tag", [ME, A, B], ME, 5.0, send, answer=(b"mine", reply))
        assert got == {A: b"from a", B: b"from b"} and replied == [N]
        assert inbox.put(L, b"tag", b"late") == b"mine"  # after: still answered, not kept
        assert inbox.put(A, b"tag", b"a again") is None  # a member: it had ours from send()
        assert inbox.put(X, b"tag", b"fourth") is None  # strangers bounded (InboxConfig.strangers)
        assert {t: d for t, (d, _) in inbox._early[N].items()} == {b"other": b"n elsewhere"}  # only that tag's went

        async def send_plain():
            inbox.put(A, b"plain", b"from a")
            inbox.put(B, b"plain", b"from b")
            return set()

        await inbox.collect(b"plain", [ME, A, B], ME, 5.0, send_plain)
        assert inbox.put(L, b"plain", b"stranger") is None  # kept early, never answered
        for k in range(RECENT_ANSWERS):
            await inbox.collect(b"t%d" % k, [ME], ME, 1.0, send_plain, answer=(b"x", reply))
        assert inbox.put(b"z", b"tag", b"too late") is None  # "tag" fell out of the recent ones

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_early_message_older_than_early_ttl_is_not_taken():
    # When everyone skipped a step and trains it again, the retry reuses the first try's
    # exchange ids: a first-try header still waiting here would be held against the retry's
    # frames (and its honest sender blamed). Older than early_ttl, its exchange is over.
    inbox = Inbox(known=lambda p: True, config=InboxConfig(early_ttl=60.0))

    async def main():
        inbox.put(A, b"retried", b"first try")
        await trio.sleep(61.0)
        inbox.put(A, b"fresh", b"a in time")

        async def send():
            return set()

        stale = await inbox.collect(b"retried", [ME, A], ME, 5.0, send)
        await trio.sleep(50.0)  # A's message for "fresh" is 55 s old now (the first collect waited 5 s)
        kept = await inbox.collect(b"fresh", [ME, A], ME, 5.0, send)
        return stale, kept

    stale, kept = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert stale == {} and kept == {A: b"a in time"}


def test_a_member_our_message_did_not_reach_is_sent_it_again_until_it_answers():
    """Rule R7: a member we could not open a stream to (a partition, a transient "no valid
    connections") never had our payload, and waits for it as we wait for its own. Before,
    nobody sent again: a retry's roster confirmation begun during a partition that healed 8 s
    later waited out its whole 60 s for nothing (simulator seed 105209). Now it goes again
    every probe second while that member is awaited, and the exchange ends when it answers."""

    def run(with_resend: bool):
        inbox = Inbox(known=lambda p: True)
        tries: list[float] = []

        async def main():
            t0 = trio.current_time()

            async def send():
                inbox.put(A, b"tag", b"from a")
                return {B}  # B's side of a partition that heals at t0 + 4.5

            async def resend(targets):
                tries.append(trio.current_time() - t0)
                if trio.current_time() - t0 < 4.5:
                    return set(targets)
                inbox.put(B, b"tag", b"from b")  # B had ours at last and answers
                return set()

            got = await inbox.collect(b"tag", [ME, A, B], ME, 60.0, send,
                                      resend=resend if with_resend else None)
            return got, trio.current_time() - t0

        return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)), tries

    (got, took), tries = run(True)
    assert got == {A: b"from a", B: b"from b"} and took == 5.0 and tries == [1.0, 2.0, 3.0, 4.0, 5.0], (took, tries)
    (got, took), tries = run(False)
    assert got == {A: b"from a"} and took == 60.0 and tries == []


def test_our_message_goes_again_to_a_member_whose_own_came_in_first():
    """Rule R7c: B's payload reaches us as a partition heals, while ours to B had failed.
    Ours went again only while B was awaited, so once B's came in nobody sent ours again,
    and B waited out its whole confirmation for it (simulator seed 127353: two of three
    members each lacked one confirmation for 60 s, then the step was skipped). Now it goes
    again each probe second until it reaches B, and once more as we leave."""

    def run(a_at: float, b_at: float):
        inbox = Inbox(known=lambda p: True)
        reached_b: list[float] = []

        async def main():
            t0 = trio.current_time()

            async def send():
                return {B}  # our stream to B did not open: B is across a partition

            async def resend(targets):
                if trio.current_time() - t0 < 2.5:  # healed at 2.5 s
                    return set(targets)
                reached_b.extend(trio.current_time() - t0 for p in targets if p == B)
                return set()

            async def later(who, at):
                await trio.sleep(at)
                inbox.put(who, b"tag", b"from " + who)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(later, A, a_at)
                nursery.start_soon(later, B, b_at)
                got = await inbox.collect(b"tag", [ME, A, B], ME, 60.0, send, resend=resend)
            return got, trio.current_time() - t0

        return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)), reached_b

    # B's came in at 1.5 s, A's at 5 s: ours reaches B at the probe after the heal
    (got, took), reached = run(5.0, 1.5)
    assert got == {A: b"from a", B: b"from b"} and took == 5.0 and reached == [3.0], (took, reached)
    # B's came in last, at 2.7 s, after the heal and before the next probe: once more as we leave
    (got, took), reached = run(0.5, 2.7)
    assert got == {A: b"from a", B: b"from b"} and took == 2.7 and reached == [2.7], (took, reached)


def test_a_long_wait_keeps_what_it_sent_early_fresh_at_members_that_have_not_begun():
    """Rule R7b. A member R4's probe left out goes straight to the next confirmation and
    waits there as long as the attempt it sat out may run (R4a); the others come when that
    attempt fails at its data budget. They keep a message for an exchange they have not begun
    only `early_ttl`: in a real red-team run (`trickle`, early_ttl 10 s) the left-out member's
    confirmation, sent 26 s before the others came, was dropped as stale, so they retried
    without it while it, holding all of theirs, went on to the bulk setup alone. Now it sends
    again to every member it still awaits every `early_ttl / 2`."""

    def run(with_resend: bool):
        cfg = InboxConfig(early_ttl=10.0)
        left_out, member = Inbox(known=lambda p: True, config=cfg), Inbox(known=lambda p: True, config=cfg)
        sends: list[float] = []

        async def main():
            t0 = trio.current_time()
            got = {}

            async def put_at_member(targets=None):
                sends.append(trio.current_time() - t0)
                member.put(A, b"tag", b"from a")
                return set()

            async def wait_long():  # the member left out: waits its span
                got["left_out"] = await left_out.collect(b"tag", [A, B], A, 100.0, put_at_member,
                                                         resend=put_at_member if with_resend else None)

            async def come_late():  # its attempt failed at the budget 26 s later
                await trio.sleep(26.0)

                async def send():
                    left_out.put(B, b"tag", b"from b")
                got["member"] = await member.collect(b"tag", [A, B], B, 5.0, send)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_long)
                nursery.start_soon(come_late)
            return got

        return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)), sends

    got, sends = run(True)
    assert got == {"left_out": {B: b"from b"}, "member": {A: b"from a"}}, got
    assert sends == [0.0, 5.0, 10.0, 15.0, 20.0, 25.0], sends
    got, sends = run(False)  # as before: the member drops it (26 s old) and goes on without A
    assert got == {"left_out": {B: b"from b"}, "member": {}}, got
