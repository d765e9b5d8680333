"""Group election for an outer step, without a coordinator (pure logic: no I/O).

Peers ready for outer step t each publish a signed DHT record. Every peer applies the same
rule to the records it sees:
  - a record's time is when this reader first saw it (`Sightings`, rule D1), never the
    time the writer claims nor its expiry: a writer-chosen time or expiry moves nothing,
    and the record's expiry only bounds how long it is read;
  - the step's deadline is the upper median of those times among the peers that trained,
    plus the join window (newcomers joining with a zero contribution never start the
    clock). The median, not the earliest, so that one liar (or any minority) cannot move
    the deadline into the past and make every honest peer miss its own step (issue 15);
  - the candidates are the records seen by the deadline (a later one skips the step);
  - candidates are ordered by SHA-256(run, t, peer id) (the placement hash) and dealt into
    ceil(N / G) groups of near-equal size (re-drawn every step, Moshpit-style);
  - within a group the same order is the ring order.
No peer is special: if any one vanishes, the others still compute the same groups from the
records that remain, and members confirm the roster (its hash) before reducing.

Cells (the scale rule, issue 30). A DHT reply carries at most 256 records, and every peer
reading every record of a step is O(N^2) per step. So each ready record is stored in one
cell per level: at level l the cells are the 4**l ranges of the placement hash (its top 2l
bits); level 0 is the whole run (the key small runs have always used). A reader reads one
cell: the finest level whose cell is not full (< `SPLIT` records), and everything above --
deadline, candidates, groups -- is computed within that cell. A run under `SPLIT` peers is
one cell at level 0: the rule is exactly the one above. A cell's members read the same key,
see the same count and so choose the same level; a run near a split size (160, 640, ...
peers) can disagree for a step, like records seen on either side of a deadline do, and the
roster confirmation catches it.
"""

from __future__ import annotations

import hashlib

from p2ptrain.records.codecs import Ready  # noqa: F401 - the record the rule reads, re-exported


SPLIT = 160
"""A cell holding this many ready records is split into its 4 children (replies carry 256,
so a cell's whole content is visible while it fills). Not a power of two: runs of 128 or
256 peers, common sizes, should not sit on a split."""
LEVELS = 4
"""Levels 0..3: up to 4**3 = 64 cells, so steps of about SPLIT * 64 = 10,240 peers."""


def ready_ttl(window: float) -> float:
    """TTL of ready records (how long a record is read; it moves no reader's clock)."""
    return max(60.0, 20 * window)


def cell(run_id: str, step: int, peer: str, level: int) -> int:
    """The level-`level` cell of `peer` at `step`: the top 2*level bits of its placement hash."""
    if not 0 <= level < LEVELS:
        raise ValueError(f"level must be in 0..{LEVELS - 1}")
    return int.from_bytes(order_key(run_id, step, peer)[:2], "big") >> (16 - 2 * level)


def cells(run_id: str, step: int, peer: str) -> list[tuple[int, int]]:
    """(level, cell) of every key a writer stores its ready record under (`cell` at each
    level, from one hash: every read of the election asks)."""
    top = int.from_bytes(order_key(run_id, step, peer)[:2], "big")
    return [(level, top >> (16 - 2 * level)) for level in range(LEVELS)]


def level_move(level: int, count: int) -> int:
    """+1: the reader's cell is full, read its child; -1: it holds under SPLIT / 8, so the
    parent may no longer be full (the caller reads it, and moves only if it holds < SPLIT);
    0: stay. The level a cell's readers settle on is the finest whose cell is not full."""
    if count >= SPLIT and level + 1 < LEVELS:
        return 1
    if count < SPLIT // 8 and level > 0:
        return -1
    return 0


class Sightings:
    """When this peer first saw each ready record of a step (rule D1: the record's time),
    and which level of cells it reads at each step (pure bookkeeping; the caller supplies
    wall times and counts)."""

    def __init__(self) -> None:
        self.first: dict[tuple[int, str], float] = {}
        self.levels: dict[int, int] = {}
        self.last_level = 0
        """The level of the newest step read: where the next step's reading starts."""
        self.closed: dict[int, dict[str, int]] = {}
        """step -> the candidates this reader's election of that step closed with, each with
        the try it posted (rule E2: the peers expected at the next step; T7: the round tag)."""
        self.deadlines: dict[int, float] = {}
        """step -> the deadline (wall time) this reader's election of that step closed on:
        where the others close at the latest (rule E14)."""
        self.full: set[tuple[int, int]] = set()
        """(step, level) of our cells seen full: a step's records only accumulate, so a full
        cell stays full, and a reader of a child cell that holds few records yet need not
        re-read its parent at every poll (at 1,000 peers, each poll early in a step read
        the ~250 records of level 1 beside its own cell's few)."""

    def level(self, step: int) -> int:
        return self.levels.get(step, self.last_level)

    def set_level(self, step: int, level: int) -> None:
        self.levels[step] = level
        if step >= max(self.levels):
            self.last_level = level

    def forget(self, step: int) -> None:
        """Start `step`'s sightings afresh: a retry of a step nobody committed is a new
        election (rule T6). Kept, the first try's sightings made the retry's deadline the
        first try's, long past: the retry closed at once, and a record first seen after that
        deadline (a member that came back late, or one whose record reached us late) was
        never a candidate again, at any retry (16 real processes: the last four peers
        retried one step every 120 s until stopped, one of them never electing another)."""
        for key in [k for k in self.first if k[0] == step]:
            del self.first[key]

    def observe(self, step: int, peers: list[str], now: float) -> dict[str, float]:
        """peer -> when this reader first saw its record for `step`."""
        for p in peers:
            self.first.setdefault((step, p), now)
        for key in [k for k in self.first if k[0] < step - 2]:  # old steps: forget
            del self.first[key]
        for per_step in (self.levels, self.closed, self.deadlines):
            for st in [st for st in per_step if st < step - 2]:
                del per_step[st]
        self.full = {k for k in self.full if k[0] >= step - 2}
        return {p: self.first[(step, p)] for p in peers}


def deadline(records: list[Ready], window: float, missing: int = 0, now: float | None = None) -> float | None:
    """Upper-median ready time (first sighting, D1) of the peers that trained, plus the
    window (None: nobody trained yet). With n trained records, fewer than n/2 + 1 of them cannot pull it below
    the earliest honest one. `missing` peers we expect at this step (last roster) that have
    not posted yet count as ready `now` -- but never later than two windows after the
    earliest record, so dead peers cost a bounded wait: an early peer that sees only itself
    (and perhaps a liar) does not close the step on the others."""
    trained = sorted(r.ready_at for r in records if not r.joining)
    if not trained:
        return None
    if missing > 0 and now is not None:
        trained = sorted([*trained, *[min(now, trained[0] + 2 * window)] * missing])
    return trained[len(trained) // 2] + window


def confirm_wait(deadline: float | None, now: float, skew: float, exchange: float, cap: float) -> float:
    """Rule E14: how long a first try's first roster confirmation waits for the group, when
    our election closed at wall time `now` on `deadline` (None: unknown). A reader closes
    early once every peer *it* expects posted (E2), but expected sets differ (each reader
    expects its own last candidates), so another member of the group may still wait for a
    peer we never expected, up to the deadline, seen `skew` later (D1's sighting skew plus
    the election's margin). We wait until then, then the exchange timeout, within `cap`
    (what a node keeps of a round it has not started); members found gone or past the step
    still end the wait early."""
    late = 0.0 if deadline is None else deadline + skew - now
    return exchange if late <= 0 else max(exchange, min(cap, late + exchange))


def current_incarnation(records: list[Ready], boots: dict[str, str]) -> list[Ready]:
    """Rule E11: `records` less those an earlier incarnation of their writer left behind (its
    state record, `boots`: peer -> boot, names another boot). Such a writer never comes to
    that round, and its trained record is no lineage at the step."""
    return [r for r in records if not (r.boot and boots.get(r.peer, r.boot) != r.boot)]


def order_key(run_id: str, step: int, peer: str) -> bytes:
    return hashlib.sha256(f"{run_id}\0{step}\0{peer}".encode()).digest()


def candidates(records: list[Ready], window: float, exclude: set[str] = frozenset(),
               at: float | None = None) -> list[Ready]:
    """Records ready by the deadline (`at`: the one the caller waited for, if given)."""
    d = at if at is not None else deadline([r for r in records if r.peer not in exclude], window)
    if d is None:
        return []
    return [r for r in records if r.ready_at <= d and r.peer not in exclude]


def groups(run_id: str, step: int, peers: list[str], group_size: int) -> list[list[str]]:
    """Deterministic partition into groups of at most `group_size`, sizes differing by <= 1."""
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    ordered = sorted(set(peers), key=lambda p: order_key(run_id, step, p))
    if not ordered:
        return []
    n_groups = -(-len(ordered) // group_size)
    return [ordered[i::n_groups] for i in range(n_groups)]


def my_group(run_id: str, step: int, peers: list[str], group_size: int, me: str) -> list[str]:
    for g in groups(run_id, step, peers, group_size):
        if me in g:
            return ring_order(run_id, step, g)
    return []


def ring_order(run_id: str, step: int, members: list[str]) -> list[str]:
    return sorted(members, key=lambda p: order_key(run_id, step, p))


ATTEMPTS_PER_TRY = 1000
"""Round tag k's attempts are numbered from k x this (rule T7): every try of a step has its
own round ids and roster hashes (a round's attempts never reach it)."""


def round_tag(tries: dict[str, int], group: list[str], own: int) -> int:
    """A group's round tag (T7): the largest try its members posted, ours included."""
    return max([own, *(tries.get(p, 0) for p in group)])


def roster_hash(run_id: str, step: int, attempt: int, members: list[str]) -> str:
    text = "\0".join([run_id, str(step), str(attempt), *members])
    return hashlib.sha256(text.encode()).hexdigest()
