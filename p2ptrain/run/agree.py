"""What a round's members agree on before any data moves (docs/PROTOCOL.md, G1, Q1 and M1).

`Agreement` is the part of `p2ptrain.run.round.ContributionRound` that talks before the data
plane: one roster confirmation per attempt (every member's roster, frame cut, base and base
weight, judged by the pure rules of `p2ptrain.run.roster`), and, when the confirmed members
start from different states, the merge: fetch the bases we lack (`BaseSource`), average them
(`p2ptrain.run.merge`), and check with every member that each computed the same merged state.
Either every member goes on to the data plane from one merged state, or the attempt aborts
for all of them.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from p2ptrain.reduce import ring
from p2ptrain.run import election, merge
from p2ptrain.run import roster as rosters

log = logging.getLogger("p2ptrain.run.round")


class BaseSource(Protocol):
    """Where a merge round gets states (the trainer: its own snapshot, peers' checkpoints)."""

    async def own(self) -> bytes:
        """Our committed state's checkpoint bytes."""

    async def fetch(self, t: int, base: str, holders: tuple[str, ...], timeout: float) -> bytes:
        """The checkpoint of step `t` whose params hash is `base`, from `holders`; raises on failure."""


class Agreement:
    """Mixed into `ContributionRound` (it reads the round's service, run id, config, ring
    config, bases, group size and merge timeout)."""

    async def _confirm(self, t: int, attempt: int, roster: list[str], rh: str, base: str,
                       timeout: float, weight: int, known_silent: frozenset = frozenset(),
                       short: float | None = None) -> rosters.Verdict:
        """Every member's roster and frame size against ours, with its base and weight: one
        that saw another roster, or cuts the tensor differently (another version), is left
        out (`p2ptrain.run.roster`); one with another base is merged with. `short` (rule R4a,
        after an attempt we sat out): once any member answers, the attempt we sat out is over
        for it, so we wait at most `short` seconds more, not that attempt's whole span. Rule R6,
        after a try's first attempt (E14 waits there): once a member confirms another roster,
        this attempt cannot go; we wait at most the exchange timeout more, not the whole wait."""
        mine = rosters.Confirm(rh, base, ring.frame_tag(self.ring_cfg), tuple(roster),
                               max(0, min(int(weight), rosters.MAX_WEIGHT)), int(self.gates_round(roster)))
        # Answering strangers: a member whose roster lists us while ours lacks it hears our
        # confirmation at once, instead of waiting out the timeout for us (`reduce.exchange`).
        # Rule E13: a member whose state moved past the step never comes (a retry's first
        # confirmation otherwise waits up to `early_ttl` for it: simulator seeds 320, 30005);
        # T11: nor, once we waited an exchange timeout for every other member, one that posted
        # a later try of it (it left ours; asked no sooner, so a wait honest members end at
        # once costs no extra read)
        away, tag, others = self.away, attempt // election.ATTEMPTS_PER_TRY, set(roster) - {self.me}
        later_from = trio.current_time() + self.config.exchange_timeout
        absent = {} if away is None else {"absent": lambda peers: away(
            t, peers, tag, others if trio.current_time() >= later_from else None)}
        if short is not None:
            absent["cut"] = short
        if attempt % election.ATTEMPTS_PER_TRY:
            def other(raw: bytes) -> bool:
                c = rosters.decode(raw, self.run_id, t, attempt)
                return c is not None and not c.agrees(mine)

            absent["split"] = (self.config.exchange_timeout, other)
        got = await self.svc.exchange(self.run_id, f"{t}/{attempt}/roster", roster, mine.encode(), timeout,
                                      unreachable_silent=True, answer_strangers=True, **absent)
        replies = {p: rosters.decode(got.get(p), self.run_id, t, attempt) for p in roster}
        if self.bases is None:  # no way to merge: another base cannot share a round with us
            replies = {p: c if c is None or c.base == base else None for p, c in replies.items()}
        verdict = rosters.reconcile(mine, replies, known_silent)
        # L2: anyone gating makes everyone serve evidence (a member that gates alone, e.g.
        # restarted without its standing, found none and refused every round)
        self.evidence_wanted = bool(mine.gates or any(c.gates for c in verdict.confirms.values()))
        return verdict

    def gates_round(self, roster: list[str]) -> bool:
        """Whether we gate a round with `roster` (rules L1, L2); the round decides."""
        return False

    def _without_gone(self, plan: rosters.RosterPlan, roster: list[str]) -> list[str]:
        """Rule G2: the members found gone at this attempt (by the data plane or a merge's
        fetch) leave the roster for the rest of the step."""
        plan.silent |= self._gone
        return [p for p in roster if p not in self._gone]

    async def _merge_bases(self, out, t: int, attempt: int, roster: list[str], base: str,
                           verdict: rosters.Verdict) -> bool:
        """Rule M1: when the confirmed members start from different states, fetch the ones we
        lack, average them (`p2ptrain.run.merge`) and check with every member that each
        computed the same merged state. True when the attempt may reduce (no merge needed,
        or everyone agrees on it: `out.merged`); False aborts the attempt for everyone
        (a member that reports another or no merged state never reaches the data plane)."""
        mp = merge.plan({p: (c.base, c.weight) for p, c in verdict.confirms.items()}, self.group_size)
        if not mp.needed:
            return True
        mine = b"fail"
        self._gone = set()
        try:
            with trio.fail_after(self.merge_timeout):
                states = {base: await self.bases.own()}
                for b, holders in mp.missing(base):
                    # G2 for a merge: holders that crashed since they confirmed (their dial is
                    # refused) serve nothing; when every holder of a base is gone, the attempt
                    # fails at once and the next goes on without them (before: a merge
                    # timeout per attempt, past 180 s, for a holder that had left).
                    others = {h for h in holders if h != self.me}
                    gone = await self.svc.unreachable(others, refused_only=True) if others else set()
                    if others and gone >= others:
                        self._gone = set(gone)
                        raise merge.MergeError(f"every holder of base {b[:12]} is gone")
                    states[b] = await self.bases.fetch(t, b, tuple(h for h in holders if h != self.me),
                                                       self.merge_timeout)
            data, h = await trio.to_thread.run_sync(merge.average, mp, states, t)
            out.merged, mine = (data, h), h.encode()
            out.parents = tuple(b for b, _, _ in mp.bases)
        except (trio.TooSlowError, merge.MergeError, OSError, ValueError) as exc:
            log.info("step %d attempt %d: merge of %d bases failed: %s", t, attempt, len(mp.bases), exc)
        except Exception as exc:  # a fetch failure of any kind: this attempt, not the peer
            log.info("step %d attempt %d: merge fetch failed: %r", t, attempt, exc)
        got = await self.svc.exchange(self.run_id, f"{t}/{attempt}/merge", roster, mine,
                                      self.config.exchange_timeout + self.merge_timeout, unreachable_silent=True)
        if out.merged is None or any(got.get(p) != mine for p in roster):
            log.info("step %d attempt %d: the members did not all reach one merged state", t, attempt)
            out.merged = None
            self._unexplained = True
            return False
        return True
