"""One contribution round: a group's verified reduction of its members' pseudo-gradients.

Attempts, each with a fresh roster (members this peer still trusts):
  1. confirm the roster with every member: its hash and the frame size must agree, and each
     member names its base (the state it starts from) and that base's weight. The roster
     shrinks to the members that confirmed exactly ours, and goes on only while it holds the
     elected group's quorum (`p2ptrain.run.roster`, rules G1 and Q1: never two disjoint
     parts of one group committing). Members with different bases merge them first
     (`p2ptrain.run.merge`, rule M1): each fetches the bases it lacks, averages them, and the
     roster checks that everyone computed the same merged state before any data moves;
  2. encode our contribution (int8 ring payloads, or the butterfly's per-chunk copies), sign
     a header describing it (`p2ptrain.run.contribution`), exchange headers and verify
     them; members with a bad header are rejected (`Ledger.reject`) and we try again (a
     missing header is silence: an unexplained abort, not a rejection);
  3. run the all-reduce with every frame held to those headers; a `RoundFailed` naming
     culprits rejects them and we try again.
Sparse runs (issue 18) replace steps 2-3 with the compressed collective (`reduce.sparse`).
Alone (every other member dropped out) a trainer may commit its own step only while its
roster still holds the quorum (a group of one, or the tie-breaking half of a pair) and it is
no newcomer; the trainer then applies rule H2 (no lone lineage) before committing it.
The service is reached through `ReduceService` (tests drive this logic with a fake in
memory); what this peer sends and signs is a `Contributor` (hostile-peer tests subclass it).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import trio

from p2ptrain.reduce import butterfly, ring
from p2ptrain.reduce.service import RoundFailed
from p2ptrain.run import election, evidence as evid, lossgate
from p2ptrain.run.agree import Agreement, BaseSource  # noqa: F401 - BaseSource: the seam, re-exported
from p2ptrain.run import roster as rosters
from p2ptrain.run.contribution import (Header, HeldChecker, NotEncoded, OwnDigests,
                                       streamed_material, trained_scale)
from p2ptrain.run.influence import Verdict, judge_headers, leave_out
from p2ptrain.run.ledger import Ledger
from p2ptrain.run.roundparts import (Contributor, Outcome, ReduceService, RoundConfig,  # noqa: F401 - re-exported
                                     attempt_waits, prepare)

log = logging.getLogger("p2ptrain.run.round")


class ContributionRound(Agreement):
    def __init__(self, run_id: str, identity, service: ReduceService, config: RoundConfig, ledger: Ledger,
                 contributor: Contributor | None = None, sparse=None, bases: BaseSource | None = None,
                 group_size: int = 4, merge_timeout: float = 60.0, scorer=None,
                 gate: lossgate.GateConfig | None = None, evidence: evid.Evidence | None = None,
                 away=None) -> None:
        self.run_id = run_id
        self.identity = identity
        self.me = identity.peer_id_str
        self.svc = service
        self.config = config
        self.ledger = ledger
        self.contributor = contributor or Contributor()
        self.ring_cfg = ring.RingConfig(config.ring_mode, sub_chunk_bytes=config.sub_chunk_bytes)
        self.sparse = sparse
        """A `p2ptrain.reduce.sparse.SparseReducer` in sparse runs (it holds our error feedback)."""
        self.bases = bases
        """Merge rounds get states here; None: a member with another base is left out (tests
        that drive one round in memory)."""
        self.group_size, self.merge_timeout = group_size, merge_timeout
        self.scorer, self.gate = scorer, gate or lossgate.GateConfig()
        """Rule L1 (`p2ptrain.run.lossgate`): `scorer(avg, seed) -> (before, after)`; None: no gate."""
        self.away = away
        """Rules E13, T11: `away(t, peers, tag, others)` -> those of `peers` known never to come
        to our try of step t with round tag `tag` (past the step, or, while we await all
        `others` of the roster, posting a later try), not waited for at a roster confirmation;
        None: every member is waited for."""
        self._refused = False
        self.evidence_wanted = False  # some member's confirmation said it gates (L2)
        self.evidence = evidence
        """Where our contribution is served for L2's attribution (`p2ptrain.run.evidence`)."""
        self._ev_src: np.ndarray | None = None
        self._ev_key: str | None = None
        self._refusal: tuple[dict, str] | None = None  # the refused attempt's (got, round id)
        self._convicted: set[str] = set()  # Q2: members whose evidence raised the loss this step
        self._unexplained = False
        self._gone: set[str] = set()
        self.silent_seen: set[str] = set()
        """Members found silent or gone at some attempt of the last `run` (G2)."""
        self.refused_own: int | None = None
        """The step at which a norm bound refused our own contribution (rule T9: not offered again)."""

    async def run(self, t: int, delta: np.ndarray, group: list[str], base: str, tokens: int, inner_steps: int,
                  joining: bool = False, first_wait: float | None = None, weight: int = 1, tag: int = 0,
                  first_cut: float | None = None, behind=None) -> Outcome:
        """`_run`; the evidence we served for it (L2) is withdrawn when it ends. `behind`
        (rule E18): awaited before every attempt after the first; True (we adopted a state
        past step t) ends the round with nothing committed."""
        self._ev_src, self._ev_key, self._refusal = None, None, None
        self._convicted = set()
        self.ledger.new_try(t)  # T9: each run is a try of its own
        try:
            return await self._run(t, delta, group, base, tokens, inner_steps, joining, first_wait, weight, tag,
                                   first_cut, behind)
        finally:
            if self._ev_key is not None and self.evidence is not None:
                self.evidence.withdraw(self._ev_key)

    async def _run(self, t: int, delta: np.ndarray, group: list[str], base: str, tokens: int, inner_steps: int,
                   joining: bool, first_wait: float | None, weight: int, tag: int, first_cut: float | None,
                   behind) -> Outcome:
        """Reduce `delta` with `group` (ring order, as elected), starting from params hash
        `base`, whose merge weight is `weight`. `first_wait`: seconds the first roster
        confirmation waits for members (later attempts wait the exchange timeout), and
        `first_cut`, at most this much more once any member confirmed (the trainer's
        `_first_wait`: rules T5, E14). `tag`: the round tag (T7), which numbers our attempts from
        tag x `election.ATTEMPTS_PER_TRY`: no message of another try can pass for this one's."""
        out = Outcome(None, list(group))
        roster, elected = list(group), list(group)
        plan, probe = rosters.RosterPlan(elected, self.me), rosters.LeaveOneOut(self.run_id, t)
        self.silent_seen = plan.silent  # live: the trainer probes these when elected again
        if self.sparse is not None:  # compress once per step; error feedback moves only on commit
            await trio.to_thread.run_sync(self.sparse.prepare, self.contributor.payload(delta))
        attempt, sat_out = (first := tag * election.ATTEMPTS_PER_TRY) - 1, False
        while (attempt := attempt + 1) - first < self.config.max_attempts + (probe.extra_attempts if probe.fails else 0):
            if attempt > first and behind is not None and await behind():
                # E18: the run went two steps past t while our attempts failed (a trickler fails
                # each at its data budget): this round can no longer meet the run in a merge
                log.info("step %d attempt %d: the run moved two steps past us: round left", t, attempt)
                return out
            if probe.left == self.me:  # we sit this attempt out and wait at the next one, as long as it may run
                roster, sat_out = probe.failed(roster), True
                if roster is None:
                    return out
                continue
            left_out = self.ledger.left_out(t)
            if self.me in left_out:  # our own header was an outlier: skip, catch up
                return out
            roster = [p for p in roster if p not in left_out]
            out.members = roster
            if not rosters.quorum(roster, [p for p in elected if p not in self._convicted]):  # Q1, Q2
                log.info("step %d attempt %d: %d of the %d elected are no quorum", t, attempt, len(roster), len(elected))
                return out
            if roster == [self.me]:
                # Alone, and still the group's quorum (a group of one, or the tie-breaking
                # member of a pair whose partner dropped out). A newcomer must not commit
                # alone: its zero step would only move its params (momentum) away from the
                # run's. The trainer applies H2 (no lone lineage) to the rest.
                if not joining:
                    out.result, out.alone = delta.copy(), True
                return out
            rh = election.roster_hash(self.run_id, t, attempt, roster)
            t0 = trio.current_time()
            (wait, short), sat_out = attempt_waits(self.config, attempt - first, first_wait, sat_out, first_cut), False
            verdict = await self._confirm(t, attempt, roster, rh, base, wait, weight, frozenset(plan.silent), short)
            out.took("roster", t0)
            action, nxt = plan.after(roster, verdict)
            if action != "go":
                log.info("step %d attempt %d: roster not confirmed by %s: %s", t, attempt,
                         sorted(set(roster) - set(verdict.agreeing)), action)
                if action == "skip":  # the other side may commit; never both (p2ptrain.run.roster)
                    return out
                roster = nxt
                continue
            t0 = trio.current_time()
            out.merged = None
            merged_ok = await self._merge_bases(out, t, attempt, roster, base, verdict)
            out.took("merge", t0)
            if not merged_ok and self._gone:  # a base's holders crashed (G2): on without them
                roster = self._without_gone(plan, roster)
                continue
            if not merged_ok:  # nobody is named: as an unexplained abort (leave-one-out)
                roster = probe.failed(roster)
                if roster is None:
                    return out
                continue
            attempt_fn = self._attempt if self.sparse is None else self._sparse_attempt
            self._unexplained, self._gone, self._refused = False, set(), False
            if await attempt_fn(out, t, attempt, roster, rh, delta, tokens, inner_steps):
                if probe.left is not None:  # its absence made the difference
                    self.ledger.strike(t, probe.left, "rounds abort whenever it is a member")
                return out
            out.merged = None
            if (roster := self._next_roster(t, roster, plan, probe, elected)) is None:
                return out
        return out

    def _next_roster(self, t: int, roster: list[str], plan, probe, elected: list[str]) -> list[str] | None:
        """The roster of the attempt after a failed one; None: leave-one-out is done."""
        if self._refused:  # L1/L2: on without those whose work failed; Q2: they count no more
            nxt = self._after_refusal(t, roster)
            plan.elected = [p for p in elected if p not in self._convicted]
            return nxt
        if self._gone:  # G2: crashed after it confirmed; a view still naming it is behind
            return self._without_gone(plan, roster)
        if self._unexplained:
            return probe.failed(roster)
        probe.left = None  # someone was caught: a later commit says nothing about who we left out
        return roster

    async def _attempt(self, out: Outcome, t: int, attempt: int, roster: list[str], rh: str, delta: np.ndarray,
                       tokens: int, inner_steps: int) -> bool:
        """Headers, then the reduction; True once a round committed (filled into `out`).
        Ring rounds encode, sign and exchange headers while the data plane already runs
        (`OwnDigests`, `HeldChecker`)."""
        rid, rank, world = f"{t}/{attempt}", roster.index(self.me), len(roster)
        robust = self.config.robust is not None
        send = self._ev_src = self.contributor.payload(delta)
        lay = ring.layout(delta.size, world, self.ring_cfg)
        subs = [len(s) for s in lay]

        def sign(digests: tuple[str, ...], norms: tuple[float, ...]) -> bytes:
            header = self.header(t, attempt, rh, roster, norms, digests, inner_steps, tokens)
            return self.contributor.sign(header, self.identity)

        def sign_streamed() -> bytes:  # blocking: our frames' digests as the ring encodes them, beside the norms
            norms, own_digests = streamed_material(delta, lay, digests)
            return sign(own_digests, norms)

        t0 = trio.current_time()
        own = digests = signed = None
        if robust:  # the butterfly's Checker needs every header before any data moves
            prep = await trio.to_thread.run_sync(prepare, delta, send, rank, world, self.ring_cfg, robust)
            own, signed = prep.own, await trio.to_thread.run_sync(sign, prep.digests, prep.norms)
            t0 = out.took("prepare", t0)
        else:
            digests = OwnDigests(len(lay[rank]), self.config.exchange_timeout + 1.0)
        held = None if robust else HeldChecker(self.config.exchange_timeout + 1.0)
        got: dict = {"base_state": out.merged[0] if out.merged is not None else None}
        trusted = self.ledger.standing.trusted()
        gated = self.gates_round(roster)
        pieces = evid.Pieces(self.evidence, self.scorer, self.me, trusted, delta.size, got,
                             self.config.exchange_timeout + self.config.abort_skew / 2,
                             self.gate.confirm) if gated else None

        async def headers() -> None:
            h0 = trio.current_time()
            try:
                raw_signed = signed
                if raw_signed is None:  # ring: beside the data plane, which encodes our frames
                    try:
                        raw_signed = await trio.to_thread.run_sync(sign_streamed)
                    except NotEncoded as exc:  # our data plane failed first: it reports why
                        log.info("step %d attempt %d: no header sent: %s", t, attempt, exc)
                        return
                    h0 = out.took("prepare", h0)
                # A member found gone (killed mid-round) is silent at once: its missing header
                # aborts the round in ~1 s instead of holding every frame check for the timeout.
                raw = await self.svc.exchange(self.run_id, rid + "/hdr", roster, raw_signed,
                                              self.config.exchange_timeout, unreachable_silent=True)
                got["raw"], got["verdict"] = raw, (v := self._verify(raw, t, attempt, rh, roster))
                got["ok"], got["bad"] = v.ok, v.bad
            finally:
                out.took("headers", h0)
                if held is not None:
                    held.settle_verified(got.get("ok"), got.get("bad"), roster, rank, subs)
            if held is not None and got["bad"]:  # no frame can pass: stop waiting for the data plane
                await self.svc.abort(self.run_id, rid, "contribution headers")
            elif pieces is not None:  # L2: beside the data plane, before we sign
                await pieces.fetch()

        failed: RoundFailed | None = None
        res = None
        async with trio.open_nursery() as nursery:
            if held is None:  # robust: the Checker needs every header before any data moves
                await headers()
            else:
                nursery.start_soon(headers)
            if held is not None or not got["bad"]:
                checker = held if held is not None else butterfly.Checker(roster, got["ok"], subs)
                kw = {"gate": lossgate.make_gate(self.scorer, self.gate, self.run_id, rid, got, world, pieces)
                      } if gated else {}
                try:
                    res = await self.svc.allreduce(send, self.run_id, rid, roster, own=own, check=checker,
                                                   robust=self.config.robust, on_own=digests, **kw)
                except RoundFailed as exc:
                    failed = exc
                finally:
                    out.took("reduce", t0)
        return self._conclude(out, t, attempt, rank, lay, got, res, failed)

    def header(self, t: int, attempt: int, rh: str, roster: list[str], norms: tuple[float, ...],
               digests: tuple[str, ...], inner_steps: int, tokens: int) -> Header:
        """Our header for this attempt: our norms and digests, and our anchor (issue 32): the
        roster positions of the members we trust (standing: verified work with us) and our
        own reference norm. Signed, they let every member apply our bound as we would."""
        norm = math.sqrt(math.fsum(x * x for x in norms))
        trusted = self.ledger.standing.trusted()
        trusts = tuple(i for i, p in enumerate(roster) if p in trusted and p != self.me)
        if self.evidence is not None and self._ev_src is not None and self.evidence_wanted:
            if self._ev_key is None:  # L2: what others may score alone if a gate refuses this round
                self._ev_key = evid.digest(self._ev_src)
                self.evidence.publish(self._ev_key, self._ev_src)
        return Header(self.run_id, t, attempt, rh, self.me, norms, digests, norm, inner_steps, tokens,
                      trusts, self.ledger.own_reference(), self._ev_key or "")

    def _verify(self, raw: dict[str, bytes | None], t: int, attempt: int, rh: str, roster: list[str]) -> Verdict:
        # Robust runs bound every member's influence whatever its norm: no norm rule.
        robust = self.config.robust is not None
        return judge_headers(raw, self.run_id, t, attempt, rh, roster, self.ledger.history,
                             norm_factor=math.inf if robust else 10.0,
                             probation_factor=math.inf if robust else self.ledger.standing.config.probation_factor)

    def _conclude(self, out: Outcome, t: int, attempt: int, rank: int, lay: list, got: dict, res,
                  failed: RoundFailed | None) -> bool:
        """An attempt's verdict from its headers (`got`) and its data plane (`res` or
        `failed`): rejections, and on a commit `out` filled in. True once it committed."""
        bad = got.get("bad", {})
        # A missing header is silence, not a lie: a member that did not go on with this
        # roster (it heard another confirmation than we did) or crashed. Rejecting it, as
        # before, shut an honest member out of the run for good (issue 17, a peer killed
        # mid-run). A member that confirms and then withholds its header is an unexplained
        # abort like a withheld vote: left out, struck, rejected (`rosters.LeaveOneOut`).
        for peer, reason in bad.items():
            if reason not in ("missing-header", "norm-over-anchor"):
                self.ledger.convict(t, peer, reason)
        if bad.get(self.me, "").startswith("norm-"):
            self.refused_own = t
        verdict = got.get("verdict")
        if verdict is not None and verdict.objections:  # whom we leave out: `influence.leave_out`
            convicted, sitting = leave_out(self.me, verdict.objections)
            for peer in sorted(convicted):
                self.ledger.outlier(t, peer, "norm-over-anchor")
            for peer in sorted(sitting):
                self.ledger.sit_out(t, peer, "norm-over-anchor")
        if bad:  # their headers, not the data plane, decided this attempt
            self._unexplained = all(r == "missing-header" for r in bad.values())
            return False
        if failed is not None or res is None:
            self._refusal = (got, f"{t}/{attempt}")
            self._failed(t, attempt, failed or RoundFailed("no result"))
            return False
        ok = got["ok"]
        out.bytes_sent += res.sent_bytes
        # What the ring schedule delivered to us (the ring counts only what it sends).
        out.bytes_recv += sum(ring.wire_bytes(lay[c][j][1] - lay[c][j][0], self.ring_cfg)
                              for _, c, j in ring.schedule(rank, len(lay), lay)[1])
        self.ledger.remember(t, ok)
        out.result, out.headers, out.scores = res.result, ok, res.scores
        out.weight = max(1, sum(1 for h in ok.values() if h.tokens > 0))
        out.scale = 1.0 if self.config.robust is not None else trained_scale((h.norm for h in ok.values()), len(lay))
        return True

    def gates_round(self, roster: list[str]) -> bool:
        return (self.config.robust is None and self.sparse is None and self.scorer is not None and self.gate.enabled
                and lossgate.needs_gate(roster, self.me, self.ledger.standing.trusted()))

    def _after_refusal(self, t: int, roster: list[str]) -> list[str]:
        """The next roster after our gate refused (L2): ourselves, the members we have standing
        with, the joiners (zeros move nothing) and, when the refusal named members whose work
        failed alone, those whose work passed; those named sit the step out, and the ones
        whose work raised the loss no longer count toward the quorum (Q2). A refusal of the
        mean alone (every piece passed) leaves only the first three."""
        got = self._refusal[0] if self._refusal else {}
        ok, why = got.get("ok") or {}, got.get("why") or {}
        keep = {p for p, h in ok.items() if h.norm == 0} | (set(got.get("kept") or ()) if why else set())
        self._convicted |= {p for p, r in why.items() if r == "loss-rose"}
        for peer, reason in sorted(why.items()):
            if peer in ok:
                self.ledger.sit_out(t, peer, reason)
        trusted = self.ledger.standing.trusted()
        return [p for p in roster if p == self.me or p in trusted or p in keep]

    def _failed(self, t: int, attempt: int, exc: RoundFailed) -> None:
        log.info("step %d attempt %d failed: %s", t, attempt, exc)
        # Nobody named: a crash, a transient, or a member withholding its vote (leave-one-out).
        self._gone = set(getattr(exc, "gone", ())) - {self.me}
        self._refused = bool(getattr(exc, "refused", ""))
        self._unexplained = not exc.blamed and not getattr(exc, "suspects", {}) and not self._gone and not self._refused
        for peer, reason in exc.blamed.items():
            self.ledger.reject(t, peer, reason)
        # A member whose accusations nobody corroborates is aborting rounds on purpose.
        for peer in getattr(exc, "suspects", {}):
            self.ledger.reject(t, peer, "uncorroborated-blames")

    async def _sparse_attempt(self, out: Outcome, t: int, attempt: int, roster: list[str], rh: str,
                              delta: np.ndarray, tokens: int, inner_steps: int) -> bool:
        """The sparse collective instead of headers + ring (p2ptrain.reduce.sparse): True once
        it committed; senders whose payload failed verification are rejected either way."""
        try:
            res = await self.sparse.attempt(self.svc, self.identity, self.run_id, t, attempt, rh, roster,
                                            self.config.exchange_timeout, robust=self.config.robust is not None)
        except RoundFailed as exc:
            self._failed(t, attempt, exc)
            return False
        for peer, reason in res.excluded.items():
            self.ledger.convict(t, peer, reason)
        self.sparse.commit()
        out.bytes_sent += res.bytes_sent
        out.bytes_recv += res.bytes_recv
        out.members, out.result, out.payload_bytes = res.members, res.result, res.payload_bytes
        out.weight = max(1, len(res.members))
        return True
