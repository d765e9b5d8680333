"""Roster agreement for one contribution round (pure logic: no I/O). docs/PROTOCOL.md, G1 and Q1.

Members elect their group from the ready records each of them saw; a record that arrives
near the deadline can be in one member's election and not in another's. Each member then
confirms the roster it elected (less the members it already left out), and:

  G1. the roster is the elected group less the members that did not confirm exactly our
      roster: nobody is ever *added* from another member's claimed view (before, members
      moved to the union of the views they heard, and one Sybil that named its whole pool
      grew a group of 4 to 8 members, issue 31);
  Q1. a roster commits only while it holds a strict majority of the group as elected, or
      exactly half of it including the group's first member in ring order (the tie-break
      every member of the elected group computes alike). Two disjoint rosters drawn from
      one elected group can then never both go on: at most one side holds that quorum,
      and the other skips the step and catches up. Before, the bar was a majority of
      whoever *answered*, which selective answering splits at will (two Sybils in a group
      of 4 made two committing pairs: a fork).

Members that start from different states no longer leave each other out (rule R1 is gone):
their round merges the states (`p2ptrain.run.merge`, rule M1), so a confirmation carries the
sender's base, and the weight its base carries in a merge. A member that cuts frames
differently (another layout version) or names a base at another step is incompatible, not
mergeable: it counts as silent.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.run import election

MAX_VIEW = 512
"""Largest view a member may send (groups are far smaller; a longer one is malformed)."""
MAX_BYTES = MAX_VIEW * 64 + 256
MAX_WEIGHT = 1 << 16


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
    weight: int = 1
    """The weight the sender's base claims in a merge: the members that trained the round
    that produced it (`p2ptrain.run.merge.weights` caps it)."""
    gates: int = 0
    """1: the sender has no standing with some member of the view, so it gates the round
    (rule L1) and judges unvetted work alone (L2): every member then serves its evidence."""

    def encode(self) -> bytes:
        return "/".join([self.rh, self.base, str(self.chunk), str(self.weight), str(self.gates),
                         ",".join(self.view)]).encode()

    def agrees(self, other: "Confirm") -> bool:
        """Same roster and frame cut: the two can run one round (their bases may differ)."""
        return self.rh == other.rh and self.chunk == other.chunk and self.view == other.view


def _small_int(text: str) -> int | None:
    if not (text.isascii() and text.isdigit()) or len(text) > 12:  # int() takes " 7", "+7", "1_0"
        return None
    return int(text)


def decode(raw: bytes | None, run_id: str, step: int, attempt: int) -> Confirm | None:
    """A member's confirmation, or None when absent or malformed (a hash that does not
    match the view it claims, an oversized view, a weight out of range): such a member
    counts as silent."""
    if raw is None or len(raw) > MAX_BYTES:
        return None
    try:
        rh, base, chunk, weight, gates, view = raw.decode().split("/", 5)
    except (UnicodeDecodeError, ValueError):
        return None
    c_chunk, c_weight = _small_int(chunk), _small_int(weight)
    if c_chunk is None or c_weight is None or c_weight > MAX_WEIGHT or len(base) != 64 or gates not in ("0", "1"):
        return None
    c = Confirm(rh, base, c_chunk, tuple(v for v in view.split(",") if v), c_weight, int(gates))
    if not c.view or len(c.view) > MAX_VIEW or len(set(c.view)) != len(c.view):
        return None
    if c.rh != election.roster_hash(run_id, step, attempt, list(c.view)):
        return None
    return c


@dataclass(frozen=True)
class Verdict:
    agreeing: list[str]
    """Roster members that confirmed exactly our roster and frame cut (us included), in
    roster order."""
    confirms: dict
    """member -> its Confirm, for the agreeing members (their bases and weights: the merge)."""
    silent: frozenset[str] = frozenset()
    """Roster members we heard nothing (valid) from."""
    backed: tuple[str, ...] = ()
    """Our roster's members (in its order) that a strict majority of the views we heard
    (ours included) name: the next roster when views differ."""
    lagging: frozenset[str] = frozenset()
    """Dissenters whose view is our roster plus only members we already found silent or
    gone at this step: they are an attempt behind us (they have not found out yet), and
    will confirm our roster at the next attempt."""
    behind: frozenset[str] = frozenset()
    """Dissenters whose view is our roster plus only members no strict majority of the views
    we heard names (each extra member's own view counted for it): by the count that made
    `backed`, they will drop those members and confirm our roster at the next attempt (rule
    R5). A claim: `RosterPlan` waits for each such member once a step."""


def reconcile(mine: Confirm, replies: dict[str, Confirm | None], known_silent: frozenset = frozenset()) -> Verdict:
    """Judge one round of confirmations (`replies` maps each roster member, us included, to
    its decoded message). `known_silent`: members already silent or gone at an earlier
    attempt of this step (what tells a lagging view from another one)."""
    agreeing = [p for p in mine.view if replies.get(p) is not None and replies[p].agrees(mine)]
    silent = {p for p in mine.view if replies.get(p) is None}
    views = [c.view for p, c in replies.items() if c is not None and c.chunk == mine.chunk]
    backed = tuple(p for p in mine.view if p not in silent and 2 * sum(p in v for v in views) > len(views))
    ours = set(mine.view)
    supersets = {p: set(c.view) - ours for p, c in replies.items() if c is not None and p in ours
                 and p not in agreeing and c.chunk == mine.chunk and ours < set(c.view)}
    lagging = frozenset(p for p, extra in supersets.items() if extra <= known_silent)
    behind = frozenset(p for p, extra in supersets.items() if p not in lagging
                       and all(2 * (sum(q in v for v in views) + 1) <= len(views) + 1 for q in extra - known_silent))
    return Verdict(agreeing, {p: replies[p] for p in agreeing}, frozenset(silent), backed, lagging, behind)


def quorum(roster: list[str], elected: list[str]) -> bool:
    """Q1: may `roster` commit for the group `elected` (ring order)? A strict majority, or
    exactly half holding the elected group's first member."""
    held = len(set(roster) & set(elected))
    return 2 * held > len(elected) or (2 * held == len(elected) and bool(elected) and elected[0] in roster)


class RosterPlan:
    """What a member does after each confirmation of one step (pure; see the module doc):
    ('go', roster) reduce now; ('retry', roster) confirm that smaller roster next; ('skip',
    None) skip the step (the rest of the group may commit it: we catch up)."""

    def __init__(self, elected: list[str], me: str | None = None) -> None:
        self.elected, self.me = list(elected), me
        self.silent: set[str] = set()
        """Members found silent (or gone, by a refused dial) at an earlier attempt of this step."""
        self.waited: set[str] = set()
        """Members we waited an attempt for as `Verdict.behind` (R5: once a step each)."""

    def after(self, roster: list[str], v: Verdict) -> tuple[str, list[str] | None]:
        self.silent |= v.silent
        if v.agreeing == roster:
            return "go", roster
        behind = v.behind - self.waited
        if (v.lagging or behind) and set(v.agreeing) | v.lagging | behind == set(roster):
            # R5: the rest name only members that most views do not: they drop them by the
            # count below and confirm our roster next. Once each: a Sybil naming its pool
            # every attempt is then a dissenter like any other.
            self.waited |= behind
            # Every dissenter still names a member we found silent or gone (it left an attempt
            # later than we did, say after the data plane found a killed member): it will drop
            # that member too. Skipping here, as for a real disagreement, left it alone at its
            # next attempt and stalled both (seen in a 3-peer run, one killed mid-round).
            return "retry", list(roster)
        # Views differ: go on with the members most views name (a member's view is a claim:
        # it can drop the claimant's own support, never add a member, G1). Members that
        # heard the same confirmations compute the same roster, so the next attempt agrees.
        # When every member is backed, the dissenters named members we lack (a record that
        # reached them before the deadline and us after it, or a Sybil naming its pool):
        # they will not run our roster, and we go on without them.
        nxt = list(v.backed) if len(v.backed) < len(roster) else list(v.agreeing)
        if (self.me is None or self.me in nxt) and len(nxt) < len(roster) and quorum(nxt, self.elected):
            return "retry", nxt
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
