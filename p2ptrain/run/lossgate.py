"""The loss gate (issue 32 item 9): a round that mixes in work nobody vetted must lower the loss.

Pure logic: no I/O, no torch. The model side (`p2ptrain.train.scorer`) computes the two
losses; the all-reduce service asks the gate after its data plane and before it signs its
commit vote (`p2ptrain.reduce.service`), so a round the gate refuses changes no member.

Rule L1 (loss gate). When our roster holds a member we have no standing with
(`p2ptrain.run.standing`: fewer than `rounds` committed rounds with us), we sign the round's
result only if the outer step it would commit lowers the loss on a batch nobody could choose:
  - the batch is drawn from `round_seed`, a hash of every member's signed header, so it is
    fixed only after each contribution was committed to (a header signs its frames' digests);
  - `before` is the loss of the state the outer step reaches with no work (a zero mean:
    momentum alone), `after` of the state it would commit (what would be applied), on the
    same batch: work is what moves the step away from momentum alone (with 2 inner steps an
    honest step raised the loss against the starting state in 8 of 25 steps, momentum
    overshooting, against momentum alone in 3: `p2ptrain.train.scorer`);
  - `verdict` refuses an `after` that is not below `before` x (1 - `margin`), or not finite.
    The default margin is -`CONVICT_MARGIN` (rule L1a): a mean may rise by L2's noise bound,
    0.1 %, as each piece may. A stricter mean refused honest rounds that rose 0.02-0.04 %
    on their 2 batches (two in one full test run, each a 60 s skip), and it was never the
    defense against anti-updates: the mean with one in it passed in 8-11 of 12 rounds
    (BENCHMARKS.md, `bench lossgate`); L2's per-piece verdict is.
Every member that gates also judges each unvetted member's work alone (rule L2,
`p2ptrain.run.evidence`), before it signs, on every gated round, from the state the round
starts from without momentum (rule L2b, the scorer's `piece`: momentum is the group's past
steps, not the member's work, and at a run's early steps it overshoots): a round whose mean passes
may still hide one anti-update among honest ones (measured: one -2.5x peer among three honest
ones left a descending mean and +45 % val loss after 3 steps). A piece that fails on the
round's batch is judged on `confirm` further batches and convicted only if it fails on each
(one batch is noisy). A merge round's pieces were trained from other lineages than the merged
state they would be applied to, so there they are judged only when the mean fails.
A mean that fails on the round's batch while no piece was convicted is scored on the same
further batches and refused only if it fails on each (rule L1b: one batch is noisy).
A refused round aborts on every member (we never sign: no certificate can exist), and our
next attempt leaves out the members whose work failed alone (L2), or, when only the mean
failed, every member we have no standing with.

Invariant served: no committed round mixed in unvetted work that did not lower the loss, alone
and in the mean, on a batch drawn after that work was signed. A round in which no verified
header carries work (every norm 0: joiners only) mixes nothing in and passes unscored.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass

import numpy as np

from p2ptrain.run.contribution import trained_scale

log = logging.getLogger("p2ptrain.run.lossgate")


CONVICT_MARGIN = 1e-3
"""L2: a member's work judged alone fails (and convicts it for the step, Q2) when, a tenth of
the way along its step, it raises the loss by more than this (relative). One member's work is
noisier than the mean (2 inner steps, tiny preset: honest pieces rose by up to 0.08 % in the
steps where every update, the mean too, went uphill on its batch; the red team's -2.5x pieces
by 0.2-3.8 % in 22 of 25 steps); the mean (L1) must still lower the loss. The margin is also
far above the float differences between machines for the same bytes (~1e-6)."""


@dataclass(frozen=True)
class GateConfig:
    enabled: bool = True
    """Gate rounds that hold a member without standing (rule L1). A per-peer policy: it only
    decides whether this peer signs, so peers with other settings still agree on every commit."""
    margin: float = -CONVICT_MARGIN
    """The candidate's loss must be below `before` x (1 - margin): 0, any decrease passes;
    negative, a rise within the noise passes too (L1a)."""
    batches: int = 2
    """Batches (of the run's batch size) drawn for each score."""
    step_fraction: float = 0.1
    """How far along the step that work makes (from momentum alone towards the committed
    state) the loss is read: a direction test. The whole step overshoots with honest work
    too (2 inner steps: an honest member's step alone raised the loss in 14 of 100 cases, the
    honest mean in 3 of 25); a tenth of it asks whether the work points downhill."""
    confirm: int = 2
    """Further batches (each `batches` long, drawn from the round's seed) a piece that fails
    alone on the round's batch is judged on (L2); it is convicted only if it fails on each.
    The same for a mean that fails when no piece does (L1b). Paid only for what fails."""

    def __post_init__(self) -> None:
        if not (-1.0 < self.margin < 1.0) or self.batches < 1 or not 0.0 < self.step_fraction <= 1.0:
            raise ValueError("margin must be in (-1, 1), batches >= 1 and step_fraction in (0, 1]")
        if not 0 <= self.confirm <= 8:
            raise ValueError("confirm must be in [0, 8]")


def needs_gate(roster: list[str], me: str, trusted: frozenset[str] | set[str]) -> bool:
    """True when the roster holds someone we have no standing with."""
    return any(p != me and p not in trusted for p in roster)


def round_seed(run_id: str, round_id: str, headers: dict[str, bytes]) -> bytes:
    """32 bytes that no member could know before signing its own header: a hash of every
    member's signed header (sorted by member), bound to the run and the round."""
    h = hashlib.sha256(b"p2ptrain/lossgate/1\0" + run_id.encode() + b"\0" + round_id.encode())
    for peer in sorted(headers):
        raw = headers[peer]
        h.update(peer.encode() + b"\0" + len(raw).to_bytes(8, "little") + raw)
    return h.digest()


def verdict(before: float, after: float, margin: float = -CONVICT_MARGIN) -> str | None:
    """None when the candidate lowers the loss enough; otherwise the reason to refuse it."""
    if not (math.isfinite(before) and math.isfinite(after)):
        return f"loss-rose: not finite ({before!r} -> {after!r})"
    if after < before * (1.0 - margin):
        return None
    return f"loss-rose: {before:.4f} -> {after:.4f}"


def confirm_seed(seed: bytes, k: int) -> bytes:
    """The k-th further batch's seed (k >= 1) for L2's confirmation; k = 0 is the round's own."""
    return seed if k == 0 else hashlib.sha256(b"p2ptrain/lossgate/confirm\0" + seed + bytes([k])).digest()


def judge_evidence(before: float, after: float) -> str | None:
    """L2's verdict on one member's work scored alone: None (it passes) or 'loss-rose' (it
    raised the loss beyond `CONVICT_MARGIN`, or is not finite: convicted for the step)."""
    if math.isfinite(before) and math.isfinite(after) and after <= before * (1.0 + CONVICT_MARGIN):
        return None
    return "loss-rose"


def judge_piece(score, seed: bytes, confirm: int) -> tuple[str | None, list[tuple[float, float]]]:
    """L2's verdict on one member's work alone, and the scores it read: `score(seed) ->
    (before, after)` on the round's batch, then on up to `confirm` further batches while it
    keeps failing; convicted ('loss-rose') only if it failed on each."""
    scores: list[tuple[float, float]] = []
    reason = None
    for k in range(1 + confirm):
        scores.append(score(confirm_seed(seed, k)))
        reason = judge_evidence(*scores[-1])
        if reason is None:
            break
    return reason, scores


def make_gate(scorer, config: GateConfig, run_id: str, round_id: str, got: dict, chunks: int, pieces=None):
    """The service's `gate(result)` for one ring attempt: the mean the outer step would apply
    (`Outcome.average`) is scored by `scorer(avg, seed, base_state) -> (before, after)` on
    the batch the round's verified headers (`got['raw']`, `got['ok']`) seed, applied to a
    merge round's merged state where there is one (`got['base_state']`). `pieces(seed) ->
    {member: why}` (L2: each unvetted member's evidence judged alone, `p2ptrain.run.evidence`)
    says whose work to leave out: asked on every gated round, but in a merge round only when
    the mean fails. Fails closed: without verified headers nothing is signed."""
    def gate(result: np.ndarray) -> str | None:
        ok, raw = got.get("ok"), got.get("raw")
        if not ok or not raw or any(p not in raw for p in ok):
            return "loss-rose: no verified headers to seed the batch"
        if not any(h.norm > 0 for h in ok.values()):
            # Nobody trained (joiners' zeros, held to a norm of 0 by the data plane): the step is
            # momentum alone, `before` itself, and no work is mixed in, so there is nothing to
            # vet. Refusing it (after == before) stalled a run whose honest peers had all joined
            # ahead of a lone Sybil's lineage: red team `replay`, 0 of 8 steps in 247 s.
            log.info("round %s: loss gate: no member trained, nothing to vet", round_id)
            return None
        seed = round_seed(run_id, round_id, {p: raw[p] for p in ok})
        scale = trained_scale((h.norm for h in ok.values()), chunks)
        avg = result if scale == 1.0 else result * np.float32(scale)
        before, after = scorer(avg, seed, got.get("base_state"))
        reason = verdict(before, after, config.margin)
        log.info("round %s: loss gate %.4f -> %.4f: %s", round_id, before, after, reason or "passed")
        if reason is None and got.get("base_state") is not None:
            return None  # a merge round's pieces need not descend alone from the merged state
        why = pieces(seed) if pieces is not None else {}
        if why:
            log.info("round %s: %d members' work failed alone: %s", round_id, len(why), sorted(set(why.values())))
            return f"loss-rose: {len(why)} members' work failed alone ({', '.join(sorted(set(why.values())))})"
        if reason is not None:  # L1b: refused only if it fails on each further batch too
            reason = confirm_mean(lambda s: scorer(avg, s, got.get("base_state")), seed, config, reason)
            log.info("round %s: loss gate on %d further batches: %s", round_id, config.confirm, reason or "passed")
        return reason
    return gate


def confirm_mean(score, seed: bytes, config: GateConfig, reason: str) -> str | None:
    """Rule L1b: a mean that failed on the round's batch, when no piece was convicted, is
    scored on `config.confirm` further batches (L2's, `confirm_seed`) and refused only if it
    fails on each. One batch is noisy for the mean as for a piece: the README's honest pair
    refused a mean that rose 0.30 % on its batch while L2 kept both pieces, and both waited
    `retry_wait`. An anti-update in the mean rises on nearly every batch, so it still fails."""
    for k in range(1, 1 + config.confirm):
        reason = verdict(*score(confirm_seed(seed, k)), config.margin)
        if reason is None:
            return None
    return reason
