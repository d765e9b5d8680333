"""Election I/O: publishing our `ready` record and waiting out a step's deadline.

The rule itself (deadline, candidates, groups, ring order) is pure and lives in
`p2ptrain.run.election`; this module feeds it the records the DHT holds. A step closes at its
deadline (earliest trained ready_at + join window, plus a margin for replication), or
earlier once every peer expected at the step (its state says it trains it, or it was in our
last roster) has posted its ready record. An expected peer that has not posted is checked
every `probe` seconds (`gone`: no connection and no dial succeeds): a crashed one stops
counting as expected, instead of costing everyone the full window (issue 17); one that is
merely slow, or unreachable to us only, still misses nothing it could have made: the
deadline rule is unchanged. A peer that sees only newcomers' records gives up after
`give_up` seconds: nobody trained.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from p2ptrain.clock import wall_time
from p2ptrain.records import RunRecords
from p2ptrain.run import election, states

log = logging.getLogger("p2ptrain.run.elect")
Gone = Callable[[set[str]], Awaitable[set[str]]]
"""Which of these peers are certainly not there (`AllReduceService.unreachable`)."""


@dataclass(frozen=True)
class ElectConfig:
    window: float
    """The run's join window (manifest timeouts.join_window)."""
    group_size: int
    margin: float = 0.5
    """Records stored just before the deadline need a moment to replicate."""
    give_up: float = 600.0
    """Seconds to wait for a peer that trained the step, when only newcomers showed up."""
    poll: float = 0.2
    probe: float = 1.0
    """Seconds between checks that expected peers which have not posted are there at all."""

    def __post_init__(self) -> None:
        if not (self.window > 0 and self.group_size >= 1 and self.margin >= 0 and self.give_up > 0
                and self.poll > 0 and self.probe > 0):
            raise ValueError("ElectConfig needs window > 0, group_size >= 1, margin >= 0, give_up > 0, "
                             "poll > 0, probe > 0")


async def publish_ready(dht, run_id: str, step: int, addrs: list[str], joining: bool, window: float,
                        ready_at: float | None = None) -> float:
    """Store our ready record for `step` (ready_at: now unless given); returns its ready_at.
    Its TTL is the protocol's (`election.ready_ttl`): readers bound claimed times with it."""
    ready_at = wall_time() if ready_at is None else ready_at
    await RunRecords(dht, run_id).publish_ready(step, ready_at, addrs, joining, election.ready_ttl(window))
    return ready_at


async def read_ready(dht, run_id: str, step: int, window: float,
                     sightings: election.Sightings | None = None) -> list[election.Ready]:
    """The step's ready records, each writer's claimed ready_at clamped to what this reader
    observed (`election.clamp`: not before our last poll without it, not after the first poll
    with it, and within the record's signed TTL), so a claim of 1.0 moves nothing."""
    got = await RunRecords(dht, run_id).read_ready(step)
    now = wall_time()
    seen = (sightings or election.Sightings()).observe(step, [r.peer for r, _ in got], now)
    ttl = election.ready_ttl(window)
    return [dataclasses.replace(r, ready_at=election.clamp(r.ready_at, *seen[r.peer], expiry, ttl))
            for r, expiry in got]


async def wait_for_deadline(dht, run_id: str, step: int, config: ElectConfig, ignored: set[str],
                            expected: set[str], sightings: election.Sightings | None = None,
                            gone: Gone | None = None) -> tuple[list[election.Ready], float] | None:
    """(ready records, the deadline waited for) once the step closed (see the module
    docstring); None on give-up. Expected peers that have not posted yet count toward the
    median deadline (`election.deadline`), so an early peer that sees only itself and a liar
    does not close the step on the others."""
    give_up = trio.current_time() + config.give_up
    absent: set[str] = set()
    probe_at = trio.current_time()
    while True:
        recs = [r for r in await read_ready(dht, run_id, step, config.window, sightings) if r.peer not in ignored]
        # Last step's roster is at this step too even if its state record is not out yet.
        waiting = (await states.peers_at_step(dht, run_id, step) | expected) - ignored - absent
        posted = {r.peer for r in recs}
        if gone is not None and trio.current_time() >= probe_at and waiting - posted:
            absent |= await gone(waiting - posted)
            waiting -= absent
            probe_at = trio.current_time() + config.probe
        missing = len(waiting - posted)
        d = election.deadline(recs, config.window, missing, wall_time())
        if d is not None and (wall_time() >= d + config.margin or (waiting and not missing)):
            return recs, d
        if d is None and trio.current_time() > give_up:
            return None
        await trio.sleep(config.poll if d is None else
                         max(0.02, min(config.poll, d + config.margin - wall_time())))


async def elect(dht, run_id: str, step: int, me: str, config: ElectConfig, ignored: set[str],
                expected: set[str], learn_addrs: Callable[[str, list[str]], None] | None = None,
                sightings: election.Sightings | None = None, gone: Gone | None = None) -> list[str]:
    """Our group for `step` in ring order, [] when nobody trained it. Candidates' addresses
    go to `learn_addrs` so the group can dial each other; `gone` as in `wait_for_deadline`."""
    got = await wait_for_deadline(dht, run_id, step, config, ignored, expected, sightings, gone)
    if got is None:
        return []
    recs, d = got
    cands = election.candidates(recs, config.window, ignored, at=d)
    if learn_addrs is not None:
        for r in cands:
            learn_addrs(r.peer, list(r.addrs))
    return election.my_group(run_id, step, [r.peer for r in cands], config.group_size, me)
