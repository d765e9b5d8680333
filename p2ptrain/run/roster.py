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
    """The sender's data-plane frame size."""
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
    return Verdict(agreeing, frozenset(same), frozenset(union - silent))
