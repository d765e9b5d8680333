"""Whom this peer no longer trusts in a run, and why.

A member caught cheating (a bad header, a blamed frame, a robust-rule outlier) is rejected:
logged (`contribution_rejected`), ignored for the rest of the run, and its standing lost. The
ledger also keeps every member's signed digests (a replayed header is caught by
`verify_headers`), its accepted norms (ours make the reference we sign: `own_reference`), its
standing (verified work: `p2ptrain.run.standing`), the checkpoints that did not load, and the
peers the robust rule flagged, which it reports in our DHT reputation entry; peers enough
others report are left out of our groups (`p2ptrain.run.reputation`).
"""

from __future__ import annotations

import logging

import numpy as np

from p2ptrain.records import RunRecords
from p2ptrain.run import reputation
from p2ptrain.run.standing import Standing

log = logging.getLogger("p2ptrain.run.ledger")

STRIKE_MEMORY = 16
"""Outer steps a strike counts towards rejection (rule R4d, docs/PROTOCOL.md): a member that
sabotages its rounds is struck at every step it is in, an honest one only by a transient."""


class Ledger:
    def __init__(self, me: str, events) -> None:
        self.me = me
        self.events = events
        self.ignored: set[str] = set()
        self.history: dict[str, set[tuple[str, ...]]] = {}
        self.flagged: dict[str, int] = {}  # peers the robust rule flagged -> step (our report)
        self.norm_history: dict[str, list[float]] = {}  # our own committed norms (last 16): own_reference
        self.standing = Standing(me)
        self.rejected_ckpts: set[str] = set()  # checkpoint hashes that hashed right but did not load
        self.strikes: dict[str, list[int]] = {}  # steps whose round committed only once it was left out
        self.outliers: dict[str, int] = {}  # headers each peer signed that the norm rule held too large
        self.sitting_out: dict[str, tuple[int, str]] = {}  # peer -> (the step it sits out, why)
        self.reputed: dict[str, list[str]] = {}  # peers ignored only on others' reports -> reporters

    def reject(self, t: int, peer: str, reason: str) -> None:
        if peer == self.me or (peer in self.ignored and peer not in self.reputed):
            return
        self.reputed.pop(peer, None)  # our own verdict now: it no longer expires with the reports
        self.ignored.add(peer)
        self.standing.forget(peer)
        log.warning("contribution rejected: step=%d peer=%s reason=%s", t, peer, reason)
        self.events.emit("contribution_rejected", step=t, remote=peer, reason=reason)

    def strike(self, t: int, peer: str, reason: str) -> None:
        """A round committed only once `peer` was left out (`p2ptrain.run.roster.LeaveOneOut`).
        One strike can be bad luck (a transient on its side); a second within `STRIKE_MEMORY`
        outer steps rejects it (R4d)."""
        recent = [s for s in self.strikes.get(peer, []) if s > t - STRIKE_MEMORY] + [t]
        self.strikes[peer] = recent
        self.events.emit("member_struck", step=t, remote=peer, strikes=len(recent), reason=reason)
        if len(recent) >= 2:
            self.reject(t, peer, "withholds-votes")

    def convict(self, t: int, peer: str, reason: str) -> None:
        """A contribution of `peer` failed verification: rejected, except a norm outlier,
        a verdict rather than proof, which is forgiven once (`outlier`)."""
        if reason == "norm-outlier":
            self.outlier(t, peer)
        else:
            self.reject(t, peer, reason)

    def outlier(self, t: int, peer: str, reason: str = "norm-outlier") -> None:
        """`peer` signed a norm the group's rule holds too large (`verify_headers`): a
        statistical verdict, not proof. An honest newcomer can earn it once (its fresh AdamW
        state makes its first deltas larger than the others'), and rejecting it, as before,
        shut it out of the run for good. So the first time its contribution is dropped and
        it sits out step `t` (we retry without it; it catches up to what we commit), and the
        second time it is rejected. Every member reaches the same verdict from the same
        headers, the peer itself included, so it sits out too instead of waiting for us."""
        if peer in self.ignored:
            return
        self.outliers[peer] = self.outliers.get(peer, 0) + 1
        if self.outliers[peer] >= 2 and peer != self.me:
            self.reject(t, peer, reason)
            return
        self.sitting_out[peer] = (t, reason)
        log.warning("contribution dropped: step=%d peer=%s reason=%s (first time)", t, peer, reason)
        self.events.emit("contribution_dropped", step=t, remote=peer, reason=reason,
                         outliers=self.outliers[peer])

    def sit_out(self, t: int, peer: str, reason: str) -> None:
        """Leave `peer` out of step `t` without holding anything against it: a verdict that
        cannot say which of two members lied (`influence.leave_out`)."""
        if peer == self.me or peer in self.ignored or self.sitting_out.get(peer, (None,))[0] == t:
            return
        self.sitting_out[peer] = (t, reason)
        log.info("member sits out: step=%d peer=%s reason=%s", t, peer, reason)
        self.events.emit("member_sits_out", step=t, remote=peer, reason=reason)

    def own_reference(self) -> float:
        """The median of the norms we signed in our last committed steps (0.0: none): our
        anchor in a round where we did not train (`Header.ref`). Only our own norms, which
        we know to be honest, so nobody else can move it."""
        past = [x for x in self.norm_history.get(self.me, []) if x > 0]
        return float(np.median(past)) if past else 0.0

    def left_out(self, t: int) -> set[str]:
        """Peers out of step `t`'s rounds: those we ignore and those sitting it out."""
        return self.ignored | {p for p, (s, _) in self.sitting_out.items() if s == t}

    def new_try(self, t: int) -> None:
        """A try of step `t` starts (rule T9): the norm verdicts of its earlier tries judged
        contributions their authors do not offer again (a member whose norm a bound refused
        retries with zeros), so they end. So does the loss gate's `loss-rose` (rule L2a): a
        statistical verdict on batches of one try, which the retry draws anew; held for the
        step, it stalled an honest pair for good (the real-process planted-checkpoint test:
        an honest piece rose on its 3 batches at step 1, the pair had no standing yet, and
        every retry left it out). L2's proofs (evidence missing or not the signed one) stand."""
        for peer in [p for p, (s, why) in self.sitting_out.items()
                     if s == t and (why.startswith("norm-") or why == "loss-rose")]:
            del self.sitting_out[peer]

    def remember(self, t: int, headers: dict) -> None:
        """A committed round of step `t`: its signed digests (the same header again is a
        replay), its norms, and a unit of verified work for each member that contributed
        (a joiner's zeros do not count)."""
        for peer, h in headers.items():
            self.history.setdefault(peer, set()).add(h.own_digests)
            if h.norm > 0 and peer == self.me:
                self.norm_history[peer] = [*self.norm_history.get(peer, [])[-15:], h.norm]
        self.standing.committed(t, [p for p, h in headers.items() if h.norm > 0])

    async def note_outliers(self, dht, run_id: str, t: int, roster: list[str], headers: dict, scores: list) -> None:
        """Members the robust rule threw away far more than the others, by the committed scores
        (the same on every member): ignored from now on and reported in our DHT record."""
        out = [p for p in reputation.outliers(roster, headers, scores) if p != self.me]
        for peer in out:
            self.reject(t, peer, "robust-outlier")
            self.flagged[peer] = t
        if out:
            acked = await RunRecords(dht, run_id).publish_reputation(self.flagged)
            self.events.emit("reputation_published", step=t, flagged=sorted(self.flagged), replicas=acked)

    async def apply_reputation(self, dht, run_id: str, t: int) -> None:
        """Leave out of our groups the peers that enough reporters with standing reported
        (`reputation.excluded`), and take back those whose reports aged out or whose
        reporters lost standing: an exclusion by reputation is never our own verdict."""
        self.reputation_verdict(t, await RunRecords(dht, run_id).read_reputation())

    def reputation_verdict(self, t: int, reports: dict[str, dict[str, int]]) -> None:
        """`apply_reputation` on reports already read (pure bookkeeping)."""
        now = reputation.excluded(reports, t, self.standing.trusted())
        for peer in [p for p in self.reputed if p not in now]:
            del self.reputed[peer]
            self.ignored.discard(peer)
            self.events.emit("peer_readmitted", step=t, remote=peer, reason="reputation")
        for peer, reporters in now.items():
            if peer != self.me and peer not in self.ignored:
                self.ignored.add(peer)
                self.reputed[peer] = reporters
                self.events.emit("peer_excluded", step=t, remote=peer, reason="reputation", reporters=reporters)
