"""Roster agreement for one contribution round (pure logic: no I/O).

Members elect their group from the ready records each of them saw, and a record that
arrives near the deadline can be in one member's view and not in another's: a newcomer's,
typically. Each member then confirms a different roster. Dropping whoever disagrees (the
old rule) let two halves of one group each confirm itself and commit two different averages
for the same step: a fork (seen in CI: a newcomer and one member committed a step without
the other two, who committed it as a pair).

So a confirmation message carries the sender's whole view, not only its hash:
  1. on the first disagreement every member moves to the union of the views it heard
     from members starting at the same params (peers vouched for by their ready records,
     less members that did not answer us). Members that heard each other compute the same
     union, so the next attempt agrees;
  2. after that, a member drops the dissenters only while the members that agree are a
     strict majority of the members that answered from the same params. Two disjoint
     halves can then not both go on: at most one side holds a majority of the members
     that heard each other, and the other skips the step and catches up to it.
Silent members (crashed, or identities that post a ready record and never answer) count
for nothing, so they cannot block a group.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.run import election

MAX_VIEW = 512
"""Largest view a member may send (groups are far smaller; a longer one is malformed)."""
MAX_BYTES = MAX_VIEW * 64 + 256


@dataclass(frozen=True)
class Confirm:
    rh: str
    """The roster hash (`election.roster_hash` of `view` at this step and attempt)."""
    base: str
    """SHA-256 of the params the sender starts from."""
    chunk: int
    """The sender's frame cut: size and layout version (`p2ptrain.reduce.schedule.frame_tag`)."""
    view: tuple[str, ...]
    """The roster the sender confirms, in ring order."""

    def encode(self) -> bytes:
        return "/".join([self.rh, self.base, str(self.chunk), ",".join(self.view)]).encode()


def decode(raw: bytes | None, run_id: str, step: int, attempt: int) -> Confirm | None:
    """A member's confirmation, or None when absent or malformed (a hash that does not
    match the view it claims, an oversized view): such a member counts as silent."""
    if raw is None or len(raw) > MAX_BYTES:
        return None
    try:
        rh, base, chunk, view = raw.decode().split("/", 3)
        if not (chunk.isascii() and chunk.isdigit()):  # int() takes " 7", "+7", "1_0"
            return None
        c = Confirm(rh, base, int(chunk), tuple(v for v in view.split(",") if v))
    except (UnicodeDecodeError, ValueError):
        return None
    if not c.view or len(c.view) > MAX_VIEW or len(set(c.view)) != len(c.view):
        return None
    if c.rh != election.roster_hash(run_id, step, attempt, list(c.view)):
        return None
    return c


@dataclass(frozen=True)
class Verdict:
    agreeing: list[str]
    """Roster members that confirmed exactly our roster, params and frame size (us included)."""
    responders: frozenset[str]
    """Members that answered from our params and frame size, whatever roster they saw."""
    union: frozenset[str]
    """Our roster and the views of those responders, less the roster members that were silent."""
    silent: frozenset[str] = frozenset()
    """Roster members we heard nothing (valid) from."""

    @property
    def views_differ(self) -> bool:
        """Someone starting where we do saw another roster: a reconcilable split."""
        return bool(self.responders - set(self.agreeing))

    def majority(self) -> bool:
        """May we go on with `agreeing` alone? Only as a strict majority of the responders."""
        return 2 * len(self.agreeing) > len(self.responders)


def reconcile(mine: Confirm, replies: dict[str, Confirm | None]) -> Verdict:
    """Judge one round of confirmations (`replies` maps each roster member, us included, to
    its decoded message)."""
    same = {p: c for p, c in replies.items() if c is not None and c.base == mine.base and c.chunk == mine.chunk}
    agreeing = [p for p in mine.view if same.get(p) == mine]
    silent = {p for p in mine.view if replies.get(p) is None}
    union = set(mine.view) - silent
    for c in same.values():
        union |= set(c.view)
    return Verdict(agreeing, frozenset(same), frozenset(union - silent), frozenset(silent))


class RosterPlan:
    """What a member does after each confirmation of one step (pure; see the module doc):
    ('go', roster) reduce now; ('merge', None) reconcile on the union (the caller vouches for
    new peers: I/O); ('retry', roster) confirm that roster next; ('skip', None) skip the step."""

    def __init__(self) -> None:
        self.merged = False

    def after(self, roster: list[str], v: Verdict) -> tuple[str, list[str] | None]:
        if v.agreeing == roster:
            return "go", roster
        if v.views_differ and not self.merged:  # rule 1, once
            self.merged = True
            return "merge", None
        if v.majority():  # rule 2
            return "retry", list(v.agreeing)
        return "skip", None


class LeaveOneOut:
    """Who to leave out after aborts nobody can explain (pure bookkeeping for one step).

    A member that runs the data plane honestly and then withholds its commit vote (or closes
    its channels in the vote gather) aborts every round it is in, and nothing attributes it:
    its successor sees a closed connection, exactly as for a crash, and an accusation from
    the successor alone cannot be told from a lie. So after an abort with nobody blamed, the
    group first retries the same roster once (a transient), then retries with one member
    left out at a time, in an order every member computes alike (a per-step hash: strike
    counts differ between members, so they cannot order it). The member left out does not
    leave: it goes straight on to the next attempt's confirmation and waits there, so it is
    back in if the attempt without it fails too; if that attempt commits, nobody comes, and
    it skips the step and catches up. The first roster that commits names the member whose
    absence made the difference (a *strike*; `Ledger.strike` rejects at 2). Only that member
    sat out the attempt that committed, so every honest member of the group records the
    same strikes. (A member that was in other groups has not: it keeps the withholder in
    its roster, disagrees, and rule 2 decides.) A group of two
    cannot be helped this way (either member alone is no majority): it skips the step.
    """

    def __init__(self, run_id: str, step: int) -> None:
        self.run_id, self.step = run_id, step
        self.fails = 0
        self.base: list[str] | None = None
        self.order: list[str] = []
        self.left: str | None = None

    @property
    def out(self) -> set[str]:
        return {self.left} if self.left is not None else set()

    def failed(self, roster: list[str]) -> list[str] | None:
        """The roster to try after an unexplained abort of `roster` (or, for the member left
        out, after the attempt it sat out); None when every member was left out once."""
        self.fails += 1
        if self.fails == 1:
            return list(roster)
        if self.base is None:
            self.base = list(roster)
            self.order = sorted(roster, key=lambda p: election.order_key(self.run_id, self.step, f"out/{p}"))
        if not self.order:
            self.left = None
            return None
        self.left = self.order.pop(0)
        return [p for p in self.base if p != self.left]

    @property
    def extra_attempts(self) -> int:
        """Attempts the probe may need beyond the round's usual budget."""
        return 1 + len(self.base or ())
