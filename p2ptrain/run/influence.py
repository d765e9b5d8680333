"""The shared verdict on a round's signed headers, and the influence bound (pure logic).

Every member of a round runs `judge_headers` on the same signed headers (and its replay
history) and reaches the same verdict: who is malformed, replayed, off-roster, an outlier of
the median rule, or over another member's signed anchor (`objections`, issue 32); whom it
then leaves out is `leave_out`. Split from `p2ptrain.run.contribution`, which owns the
header codec and the per-frame checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from p2ptrain.run.contribution import BadContribution, Header, consistent, decode_header

@dataclass(frozen=True)
class Verdict:
    """`judge_headers`' result: a pure function of the signed headers (and the replay
    history), so every member of a round that holds the same headers computes the same."""
    ok: dict[str, Header]
    bad: dict[str, str]
    objections: frozenset[tuple[str, str]] = frozenset()
    """(i, j): member i's signed anchor bounds j's norm and j's norm exceeds it. Those j are
    in `bad` as 'norm-over-anchor'; whom each member then leaves out is `leave_out`."""


def objections(ok: dict[str, Header], members: list[str], norm_factor: float,
               probation_factor: float) -> frozenset[tuple[str, str]]:
    """Every (i, j) where j's norm exceeds what i's signed header allows it: `norm_factor` x
    i's anchor if i trusts j (lists its roster position in `trusts`), `probation_factor` x
    otherwise. Read from the headers alone, so every member finds the same pairs, whatever
    its own standing. Sybils control their own anchors, never an honest member's: an honest
    trainer's anchor is its own norm this round, which no history can raise."""
    pos = {p: i for i, p in enumerate(members)}
    out = set()
    for i, hi in ok.items():
        a = hi.anchor
        if not a > 0:
            continue
        trusts = set(hi.trusts)
        for j, hj in ok.items():
            if j != i and hj.norm > (norm_factor if pos[j] in trusts else probation_factor) * a:
                out.add((i, j))
    return frozenset(out)


def leave_out(me: str, pairs: frozenset[tuple[str, str]]) -> tuple[set[str], set[str]]:
    """Whom `me` leaves out of the step after a verdict with objections: (convicted, sitting
    out). Nobody can tell from the headers which side of a pair lies (a Sybil can sign a
    huge norm, or a tiny anchor that objects to an honest norm), so:
      - members we object to: our own bound says no; a conviction (`Ledger.outlier`:
        forgiven once, the second rejects), as for the median rule;
      - members that object to us: we do not commit with them this step (no conviction: an
        honest member that does not trust us yet objects rightly);
      - a pair that does not involve us, where we are compatible with both ends: the member
        objected to sits out the step (no conviction). That keeps every bound in every
        round we commit; a Sybil with a tiny anchor can cost an honest member that step.
    Never `me`. The round never commits with a pair in it: `verify_headers` rejects the
    objected member for everyone, and a commit needs every member's vote."""
    against_me = {i for i, j in pairs if j == me}
    mine = {j for i, j in pairs if i == me}
    incompatible = against_me | mine
    third = {j for i, j in pairs if me not in (i, j) and i not in incompatible and j not in incompatible}
    return mine - {me}, (against_me | third) - mine - {me}


def judge_headers(raw: dict[str, bytes | None], run: str, step: int, attempt: int, roster: str,
                  members: list[str], history: dict[str, set[tuple[str, ...]]],
                  norm_factor: float = 10.0, probation_factor: float = 3.0) -> Verdict:
    """The verdict on the group `members`' headers. Nothing in it depends on the caller's
    own state except `history` (replays): the trust that decides each bound is signed in
    the headers (`Header.trusts`, `Header.ref`), so members with different standing reach
    the same verdict (issue 32).

    Two norm rules, in this order:
      1. groups where 3 or more trained (norm > 0): a norm over `norm_factor` x their median
         is a 'norm-outlier' (a clear outlier among mostly honest members);
      2. anchors (`objections`): each member bounds every other member's norm by its own
         anchor, x `norm_factor` if it trusts that member, else x `probation_factor`; an
         objected member is 'norm-over-anchor'. This is the bound Sybils cannot move: it
         holds for an honest member alone with any number of them, and in a pair (no
         history: the anchor is this round's own norm, so it cannot ratchet)."""
    ok: dict[str, Header] = {}
    bad: dict[str, str] = {}
    for peer in members:
        data = raw.get(peer)
        if data is None:
            bad[peer] = "missing-header"
            continue
        try:
            h = decode_header(data)
        except BadContribution as exc:
            bad[peer] = exc.reason
            continue
        if h.peer != peer:
            bad[peer] = "header-for-another-peer"
        elif (h.run, h.step, h.attempt) != (run, step, attempt):
            bad[peer] = "wrong-step"
        elif h.roster != roster:
            bad[peer] = "wrong-roster"
        elif len(h.chunk_norms) != len(members):
            bad[peer] = "wrong-chunk-count"
        elif not all(math.isfinite(x) and x >= 0 for x in (*h.chunk_norms, h.norm, h.ref)):
            bad[peer] = "non-finite"
        elif len(set(h.trusts)) != len(h.trusts) or not all(0 <= x < len(members) for x in h.trusts):
            bad[peer] = "malformed-trusts"
        elif not consistent(h):
            bad[peer] = "chunk-norms-inconsistent"
        elif h.norm > 0 and h.own_digests in history.get(peer, set()):
            # zeros (a joiner's contribution) hash the same every time: sending them again
            # replays nothing, and an honest peer that joins twice must not be excluded
            bad[peer] = "replay"
        else:
            ok[peer] = h
    trained = [h.norm for h in ok.values() if h.norm > 0]
    if len(trained) >= 3:  # joiners' zeros are no norm to judge by (they only pulled the median down)
        limit = norm_factor * float(np.median(trained))
        for peer, h in list(ok.items()):
            if h.norm > limit:
                bad[peer] = "norm-outlier"
                del ok[peer]
    pairs = objections(ok, members, norm_factor, probation_factor)
    for _, j in pairs:
        bad[j] = "norm-over-anchor"
        ok.pop(j, None)
    return Verdict(ok, bad, pairs)


def verify_headers(raw: dict[str, bytes | None], run: str, step: int, attempt: int, roster: str,
                   members: list[str], history: dict[str, set[tuple[str, ...]]],
                   norm_factor: float = 10.0, probation_factor: float = 3.0,
                   ) -> tuple[dict[str, Header], dict[str, str]]:
    """(accepted headers, rejected peer -> reason) for the group `members`: `judge_headers`."""
    v = judge_headers(raw, run, step, attempt, roster, members, history, norm_factor, probation_factor)
    return v.ok, v.bad
