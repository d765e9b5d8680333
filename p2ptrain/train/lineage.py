"""A trainer's place in the run's lineage: adopting the head, not running on alone, and the
states a merge round fetches (docs/PROTOCOL.md, rules H1, H2 and M1's fetch).

`Lineage` is the part of `p2ptrain.train.trainer.Trainer` that decides which state the peer
holds apart from the rounds it commits: at start and after a skipped step it adopts the run's
head (H1: the best-attested state others publish, `p2ptrain.ckpt.providers.choose`; never a
vote of records, never its own); before committing alone it checks that nobody it can dial
trains near its step (H2); and as a round's `BaseSource` (`p2ptrain.run.agree`) it serves its
own state and fetches the bases it lacks, chunk by chunk, hash-checked.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading

import trio

from p2ptrain.ckpt import checkpoint
from p2ptrain.ckpt.catchup import adopt, find, own_roster
from p2ptrain.ckpt.download import Resume, download
from p2ptrain.ckpt.providers import Choice
from p2ptrain.identity import peer_id_to_str
from p2ptrain.records import RunRecords
from p2ptrain.run import elect, election, states
from p2ptrain.train.modelside import PhaseLeft
from p2ptrain.train.scorer import checked_load

log = logging.getLogger("p2ptrain.train.trainer")
NEAR = 3
"""Rule H2's reach: a peer whose state is within this many steps of ours holds our lone commits."""


CATCH_UP_WAIT = 120.0
"""Seconds a catch-up waits while no acceptable state is advertised (a fetch under way has
its state's `transfer_budget`, `Lineage.fetch_timeout`)."""


class Lineage:
    """Mixed into `Trainer` (it reads the trainer's node, DHT, spec, ledger, model side and
    round, and sets its `weight` and `last_roster`)."""

    fetch_timeout: float = CATCH_UP_WAIT  # a catch-up's default limit (sized: `roundparts.transfer_budget`)

    async def wait_for_peers(self) -> None:
        with trio.move_on_after(self.config.start_timeout):
            while True:
                head = await self.head()
                if head is not None and head.step > 0:
                    # The run started without us -- if that is more than a claim: only a state we
                    # can adopt ends the wait (Sybil records naming states nobody serves cannot).
                    await self.catch_up(head.step, patience=5.0)
                    if self.local.step > 0:
                        return
                if len(await states.peers_at_step(self.dht, self.run_id, 0)) >= self.config.min_peers:
                    return
                await trio.sleep(0.2)
        log.warning("starting with fewer than %d peers after %.0fs", self.config.min_peers, self.config.start_timeout)

    async def reattest(self) -> str | None:
        """Rule J3: a restarted member names the group it committed our state with again
        (`providers.own_roster`), read before our first provider record replaces that one.
        Returns the params hash it read (the first state record names it too), None at step 0."""
        if self.local.step == 0:
            return None
        params = await trio.to_thread.run_sync(self.local.outer.params_sha256)
        self.last_roster = await own_roster(self.dht, self.run_id, self.local.step, params)
        return params

    async def head(self):
        """The run's head (rule H1, `p2ptrain.ckpt.providers.choose`): the best-attested state
        others publish; our own records are not votes."""
        return await find(self.dht, self.run_id, self.spec.genesis.sha256, 0, self.spec.train.group_size,
                          self.ledger.standing.trusted(), self.ledger.rejected_ckpts, ignore={self.me})

    async def _round_underway(self, t: int) -> bool:
        """Have peers that trained step t posted their ready records? Then its election is
        closing (it closes as soon as every expected peer posted), and a peer that only now
        adopted state t is too late for it. Not when an earlier incarnation of ours posted a
        trained record for t (rule J2): that round counts on a member that is gone, and we
        join the step's next try instead."""
        recs = await elect.read_ready(self.dht, self.run_id, t, self.elect_cfg.window, self.sightings)
        if self._rejoin_left_round(t, recs):
            return False
        return any(not r.joining and r.peer != self.me for r in recs)

    def _rejoin_left_round(self, t: int, recs: list) -> bool:
        """Rule J2: an earlier incarnation of ours posted a trained record for step t (`recs`),
        so the round under way counts on a member that is gone. We take part in the step's
        next try instead (as a joiner, zeros): our record at that try ends the others' wait
        after their skip at once (T8), where a join ahead waited for a state that only came
        after their `retry_wait` (or never, when we held the pair's tie-break: Q1)."""
        boot = elect.our_boot(self.dht, self.run_id)
        if not any(r.peer == self.me and not r.joining and r.boot and r.boot != boot for r in recs):
            return False
        self._tries[t] = max(self._tries.get(t, 0), 1 + max(r.tries for r in recs))
        self.events.emit("rejoining_round", step=t, try_number=self._tries[t])
        return True

    async def _join_ahead(self, ahead: int = 1, and_next: bool = False) -> None:
        """Join step t+1 instead: announce it at once (a joining record starts no clock, and
        the others' election for t+1 finds it), adopt state t+1 when it appears, then join its
        round with zeros. Without this, steps shorter than a catch-up kept a restarted peer
        one step behind for good (seen once evaluation left the critical path). `and_next`
        (overlapped runs): announce the step after it too, as joining. The others elect that
        step beside the round we join, and their election closes as soon as the members of
        their last roster posted, which we are not yet: announced only beside that round, we
        could lose that race (seen in a streaming run's 1 s steps, issue 17), and a lost race
        cost the join window (our group elected us, theirs did not), then another join."""
        for _ in range(3):  # the state we adopt may already be past t+1 (a slow fetch): again
            t1 = self.local.step + ahead
            addrs = self.node.rpc.local_addrs()
            for t, again_joining in ((t1, False), (t1 + 1, True))[:2 if and_next else 1]:
                at = await elect.publish_ready(self.dht, self.run_id, t, addrs, True, self.elect_cfg.window)
                self._ahead[t] = (at, again_joining)
            self.events.emit("joining_ahead", step=t1)
            await self.catch_up(t1)
            if self.local.step <= t1:
                return

    async def sync_with_run(self) -> bool:
        """Adopt the run's head if it is ahead of ours (rule H1: a newcomer and a restarted
        peer alike; never by a vote of state records, where our own stale record and other
        newcomers' genesis records outvoted the peer that had trained, issue 31). Returns
        True when others are already training the current step: we then join it at once
        with a zero pseudo-gradient instead of making everyone wait for our inner steps."""
        head = await self.head()
        if head is None:
            return False
        if head.step > self.local.step:  # a claimed step nobody serves costs 5 s, not the timeout
            await self.catch_up(head.step, patience=5.0)
        return head.step == self.local.step and self.local.step > 0

    async def fell_behind(self, t: int) -> bool | None:
        """Rule H3: before training step t, a peer that sees another (not rejected) two or
        more steps past t adopts the head first (`sync_with_run`). Its lineage can no longer
        meet the run's in a merge (M1 merges states of one step), so what it would train is
        lost anyway, and waiting for its next skip cost a whole phase: after a partition the
        side that fell behind (a 4x slow peer's pair) trained a 40 s step while the other
        side ran 3 steps ahead (simulator seed 116). A state record is a claim: one nobody
        serves costs the catch-up's patience (5 s), once a step.

        The head ranks trusted attesters first, so a pair that committed together behind a
        partition finds its own state there (seed 40287: it trained on, skipped, and met the
        others 4 steps after the partition). It then adopts the best-attested state two or
        more steps ahead whoever attests it, but only one that scores better than ours on
        windows we draw (`checked_load(always=True)`): a planted state does not, and without a
        scorer it does not move. It looks once (no patience): a far-ahead state record that no
        provider record backs (a liar's) then costs one read, not the catch-up's 5 s.

        Returns None when we did not move, else whether others already train our new step
        (we join it with zeros)."""
        if not await self._two_past(t):
            return None
        joining = await self.sync_with_run()
        if self.local.step <= t and self.state_scorer is not None:
            await self.catch_up(t + 2, patience=0.0, scored=True)  # one look: a claim costs no wait
            joining = True  # the state we adopted is the others' newest: they train its step
        return joining if self.local.step > t else None

    async def _wait_reported(self) -> None:
        """Until the last committed step's report (evaluation, state record) is out."""
        if self._reported is not None:
            await self._reported.wait()

    async def _two_past(self, t: int) -> bool:
        """H3's question: does a state record of another peer (not rejected) stand two or
        more steps past step t?"""
        return any(st.step >= t + 2 and peer_id_to_str(sub) not in self.ledger.ignored | {self.me}
                   for sub, st in await RunRecords(self.dht, self.run_id).read_states())

    async def watched_phase(self, t: int) -> tuple[float, int, float] | None:
        """Step t's inner phase, with rule E17 beside it: H3 asked again a join window after
        the phase began, then 2, 4, ... windows after that. A phase the run has left two
        steps behind cannot meet it in a merge (M1 merges states of one step); it ends at its next inner
        step (`modelside.PhaseLeft` from the progress callback; a model side whose ranks
        train in lockstep finishes it) and we adopt the head (H3). A 4.7x slow late joiner one
        step behind trained a 47 s phase while the others ran 4 steps (simulator seed
        113206); checked only before a phase, H3 could not see that coming. Returns (loss,
        tokens, seconds), or None when the phase was left: we then hold the head, or (no
        head we could adopt) our committed state again, untouched by the phase."""
        stop, progress = threading.Event(), self._progress(t)

        def step(i: int, n: int) -> None:
            if stop.is_set():
                raise PhaseLeft
            if progress is not None:
                progress(i, n)

        async def watch(scope: trio.CancelScope) -> None:
            wait = self.elect_cfg.window
            while True:
                await trio.sleep(wait)
                if await self._two_past(t):
                    break
                wait *= 2  # a phase of n windows reads the run's states log2(n) times, not n
            stop.set()
            scope.cancel()  # the simulator's phase is a sleep: it ends here

        out = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            with contextlib.suppress(PhaseLeft):
                out = await trio.to_thread.run_sync(self.local.inner, step)
            nursery.cancel_scope.cancel()
        if out is None:
            self.events.emit("outer_step_skipped", step=t, reason="behind the run: phase left")
            await self._wait_reported()  # a catch-up replaces the state the last report reads
            if await self.fell_behind(t) is None or self.local.step <= t:
                await trio.to_thread.run_sync(lambda: self.local.load_state_at(self.local.state_bytes()))
        return out

    def behind_of(self, t: int, ahead: bool):
        """Rule E18's question for step t's round (`behind`), or None for a round elected
        ahead: sequential loop only, as H3 (the overlapped loop's round runs beside a phase)."""
        return None if ahead else (lambda: self.behind(t))

    async def behind(self, t: int) -> bool:
        """Rule E16 (`elect.Behind`): H3 asked again while step t's election still waits a
        join window after it began, and rule E18 before a round's later attempts; whether we
        moved past t."""
        if self.local.step != t:
            return False
        await self._wait_reported()  # a catch-up replaces the state the last report reads
        return await self.fell_behind(t) is not None and self.local.step > t

    async def _others_near(self, t: int, base: str | None = None) -> bool:
        """Rule H2: whether another peer of the run trains near step t: one with a ready
        record for t, or a state record within `NEAR` steps of ours, whose dial is not
        refused (a crashed one's records outlive it and are no one to fork from; a live one,
        however loaded or partitioned from us, still counts). A peer far behind (a newcomer
        still at the genesis) does not hold us: it adopts our state first (H1) and then
        joins with zeros. Probed 16 at a time, stopping at the first: in a run of many
        groups the others are many, and mostly alive.

        A *follower* does not hold us either: a peer whose state record is our `base` (the
        state we commit from) and that trained nothing for step t (it adopted our state and
        joins, with zeros, the step our commit opens). It is on our lineage and adopts what
        we commit; counting it, we skipped and waited for its commit while it waited for
        ours (the H2 / join-ahead race, docs/PROTOCOL.md)."""
        return await self._any_dialable(await self._peers_at(t, NEAR, joining=True, follow=base))

    async def may_commit_alone(self, t: int, base: str) -> bool:
        """Rule H2, with patience: may a round that committed our delta alone be applied?
        Yes once nobody we can dial is near (`_others_near`). A near peer that only holds an
        older state (a restarted one, a joiner still fetching) usually becomes our follower
        within seconds (it adopts our state); so we re-check for up to `retry_wait` (what a
        skip would wait anyway) rather than skip at once, and stop early when another peer
        posted a *trained* record for step t (a lineage of its own at this step: we skip and
        meet it) or a state past t appears (someone committed t: we adopt it). Before, the skip
        waited `retry_wait` for a commit while the restarted peer, now our follower, waited for
        ours (a join window of patience was 50 ms short once, on a loaded CI machine)."""
        give_up = trio.current_time() + self.spec.timeouts.retry_wait
        while await self._others_near(t, base):
            recs, _ = await self._current_ready(t)
            if any(not r.joining and r.peer != self.me and r.peer not in self.ledger.ignored for r in recs):
                return False
            head = await self.head()
            if trio.current_time() >= give_up or (head is not None and head.step > t):
                return False
            await trio.sleep(1.0)
        return True

    async def _peers_at(self, t: int, reach: int, joining: bool, follow: str | None = None) -> dict[str, list[str]]:
        """Other peers (not rejected) with a ready record for step t (trained, or joining too
        with `joining`) or a state record within `reach` steps of t: their addresses. With
        `follow` (a params hash at step t), less the followers of that state (`_others_near`)."""
        recs, sts = await self._current_ready(t)
        near = {r.peer: list(r.addrs) for r in recs if joining or not r.joining}
        trained = {r.peer for r in recs if not r.joining}
        for peer, st in sts.items():
            if follow is not None and st.step == t and st.params == follow and peer not in trained:
                near.pop(peer, None)
            elif abs(st.step - t) <= reach and peer not in near:
                near[peer] = list(st.addrs)
        return {p: a for p, a in near.items() if p != self.me and p not in self.ledger.ignored}

    async def _states(self) -> dict:
        return {peer_id_to_str(sub): st for sub, st in await RunRecords(self.dht, self.run_id).read_states()}

    async def _current_ready(self, t: int) -> tuple[list, dict]:
        """Step t's ready records, less those a restarted writer posted in an earlier
        incarnation (rule E11: its state record names another boot), and the run's state
        records read for that. A peer that trained t,
        crashed and came back as our follower left a trained record behind; H2 took it for a
        lineage of its own at t, so we skipped, while it and the run's joiners waited for our
        commit: 120 s with no commit after the faults ended (simulator seed 90178)."""
        recs = await elect.read_ready(self.dht, self.run_id, t, self.elect_cfg.window, self.sightings)
        sts = await self._states()
        return election.current_incarnation(recs, {p: st.boot for p, st in sts.items() if st.boot}), sts

    async def someone_trains(self, t: int) -> bool:
        """Is there anyone to join at step t with zeros: another dialable peer whose state is
        at t, or that posted a trained ready record for it? When the others left the run (or
        crashed), a peer that caught up trains the step itself: joiners' records never start
        a step's clock (E4), so two joiners alone waited out `give_up` (600 s)."""
        return await self._any_dialable(await self._peers_at(t, 0, joining=False))

    async def _any_dialable(self, near: dict[str, list[str]]) -> bool:
        others = sorted(near)
        for i in range(0, len(others), 16):
            batch = set(others[i:i + 16])
            for p in batch:
                self._learn(p, near[p])
            if batch - await self.round.svc.unreachable(batch, refused_only=True):
                return True
        return False

    async def catch_up(self, at_least: int, timeout: float | None = None, patience: float | None = None,
                       scored: bool = False) -> None:
        """Within `timeout` (default `fetch_timeout`: the state's bytes at the bulk floor rate,
        at least 120 s; a fixed 120 s needed 27 Mbit/s for a 100M-parameter state and 270 for
        1B, so a newcomer on a slower link never caught up),
        adopt the best-attested state at `at_least` or later (chunks from every provider at
        once; trusted attesters rank first; a checkpoint that hashes right but does not load
        is rejected, not fatal: p2ptrain.ckpt.catchup.adopt; so is one that scores no better
        than the genesis we still hold: `scorer.checked_load`). `scored` (H3): ranked without
        trust, and only a state that scores better than ours is loaded; one that does not is
        passed over by H3b from then on (not fetched again each step), but not rejected: the
        trusted head may still lead to it."""
        load = functools.partial(checked_load, self.state_scorer, self.local, always=scored)
        rejected = self.ledger.rejected_ckpts
        if scored:
            rejected = self.__dict__.setdefault("_passed_over", set())
            rejected |= self.ledger.rejected_ckpts
        timeout = self.fetch_timeout if timeout is None else timeout
        patience = min(timeout, CATCH_UP_WAIT) if patience is None else patience  # nothing advertised
        got = await adopt(self.node, self.run_id, self.spec, self.events, at_least, self.local.step, load,
                          timeout=timeout, patience=patience, rejected=rejected,
                          trusted=frozenset() if scored else self.ledger.standing.trusted(),
                          resume=self.__dict__.setdefault("_resume", Resume()))
        if got is None:
            return
        # A state now loaded is announced whole, even when the wait it ended is cancelled
        # (T8: a member of our roster retried the step meanwhile).
        with trio.CancelScope(shield=True):
            self.weight = 1
            sha = await trio.to_thread.run_sync(self.local.outer.params_sha256)
            self.events.emit("caught_up", step=self.local.step, params_sha256=sha)
            # where we are now, for the others' rule H2 (our old record said a step long gone),
            # and one more provider of the state we adopted (not an attester: we were not in
            # the roster that committed it)
            self.last_roster = set()
            await self.publish_state(params=sha)

    async def wait_for_retry(self, t: int) -> bool:
        """After a skip of step t: adopt a newer state within `retry_wait` (long enough for
        the step's other groups to commit and publish; a retry has its own round ids, T7, so
        nothing of this try can be taken for it). Rule T8: the wait ends early when a member
        of the roster we failed with posts a ready record for t at our next try or later: it
        is retrying now, and we join it (True) rather than come `retry_wait` after our own
        skip (retries that never meet: simulator seed 100182, PROTOCOL.md)."""
        failed_with = set(self.sightings.closed.get(t, {})) - {self.me}
        next_try, joined = self._tries.get(t, 0), False
        async with trio.open_nursery() as nursery:
            async def wait_for_state():
                await self.catch_up(t + 1, timeout=self.spec.timeouts.retry_wait)
                nursery.cancel_scope.cancel()

            async def join_retry():  # polled once a second: one read of our cell of step t
                nonlocal joined
                while True:
                    await trio.sleep(1.0)
                    recs = await elect.read_ready(self.dht, self.run_id, t, self.elect_cfg.window)
                    if any(r.peer in failed_with and r.tries >= next_try for r in recs):
                        self.events.emit("retry_joined", step=t, try_number=next_try)
                        joined = True
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(wait_for_state)
            if failed_with:
                nursery.start_soon(join_retry)
        return joined

    async def own(self) -> bytes:
        return await trio.to_thread.run_sync(self.local.state_bytes)

    async def fetch(self, t: int, base: str, holders: tuple[str, ...], timeout: float) -> bytes:
        """The state of step t whose params hash is `base`, as its holders serve it: their
        provider records name its chunk manifest (published as they committed it, beside
        their next phase: we wait for them within `timeout`); every chunk is hash-checked,
        and `merge.average` checks the params against `base`."""
        with trio.fail_after(timeout):
            while True:
                recs = [r for r in await RunRecords(self.dht, self.run_id).read_providers(t, base)
                        if r.peer in holders and r.step == t and r.params == base]
                if recs:
                    break
                await trio.sleep(0.2)
            for r in recs:
                self._learn(r.peer, list(r.addrs))
            ref = recs[0]
            choice = Choice(t, ref.manifest, ref.sha256, base, tuple(sorted({r.peer for r in recs
                                                                              if r.manifest == ref.manifest})), ())
            data, _ = await download(self.node.host, choice, exclude={self.me},
                                     max_bytes=checkpoint.state_size_limit(self.spec.genesis.bytes))
            return data
