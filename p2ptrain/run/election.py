"""Group election for an outer step, without a coordinator (pure logic: no I/O).

Peers ready for outer step t each publish a signed DHT record carrying their `ready_at`
(wall time). Every peer applies the same rule to the records it sees:
  - the step's deadline is the upper-median ready_at of the peers that trained, plus the
    join window (newcomers joining with a zero contribution never start the clock). A
    writer's claim is not taken at face value: `clamp` bounds it by what the reader saw
    (not before the last poll that did not see the record, not after the first poll that
    did) and by the signed record's expiry (a record lives at most the ready TTL). The
    median, not the earliest, so that one liar (or any minority) cannot move the deadline
    into the past and make every honest peer miss its own step (issue 15, hole 2);
  - the candidates are the records with ready_at <= deadline (a later one skips the step);
  - candidates are ordered by SHA-256(run, t, peer id) and dealt into ceil(N / G) groups
    of near-equal size (re-drawn every step, Moshpit-style, so groups mix);
  - within a group the same order is the ring order.
No peer is special: if any one vanishes, the others still compute the same groups from the
records that remain, and members confirm the roster (its hash) before reducing.
"""

from __future__ import annotations

import hashlib
import math
from p2ptrain.records.codecs import Ready  # noqa: F401 - the record the rule reads, re-exported


def ready_ttl(window: float) -> float:
    """TTL of ready records (a protocol constant: readers bound claims with it)."""
    return max(60.0, 20 * window)


def clamp(claimed: float, not_before: float, first_seen: float, expiry: float, ttl: float,
          skew: float = 2.0) -> float:
    """A ready time the reader can defend: at most when it first saw the record, at least
    when it last looked without seeing it, and at least `expiry - ttl - skew` (the record was
    signed with the run's ready TTL, so it was written no earlier than that)."""
    lo = max(not_before, expiry - ttl - skew)
    return min(max(claimed, lo), first_seen)


class Sightings:
    """When this peer first saw each ready record of a step, and the last poll before it
    (pure bookkeeping; the caller supplies wall times)."""

    def __init__(self) -> None:
        self.first: dict[tuple[int, str], tuple[float, float]] = {}  # -> (not_before, first_seen)
        self.last_poll: dict[int, float] = {}

    def observe(self, step: int, peers: list[str], now: float) -> dict[str, tuple[float, float]]:
        prev = self.last_poll.get(step, -math.inf)
        for p in peers:
            self.first.setdefault((step, p), (prev, now))
        self.last_poll[step] = now
        for key in [k for k in self.first if k[0] < step - 2]:  # old steps: forget
            del self.first[key]
        return {p: self.first[(step, p)] for p in peers}


def deadline(records: list[Ready], window: float, missing: int = 0, now: float | None = None) -> float | None:
    """Upper-median ready_at of the peers that trained, plus the window (None: nobody
    trained yet). With n trained records, fewer than n/2 + 1 of them cannot pull it below
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


def roster_hash(run_id: str, step: int, attempt: int, members: list[str]) -> str:
    text = "\0".join([run_id, str(step), str(attempt), *members])
    return hashlib.sha256(text.encode()).hexdigest()
