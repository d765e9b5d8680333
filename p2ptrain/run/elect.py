"""Election I/O: publishing our `ready` record and waiting out a step's deadline.

The rule itself (deadline, candidates, groups, ring order) is pure and lives in
`p2ptrain.run.election`; this module feeds it the records the DHT holds. A step closes at its
deadline (earliest trained ready_at + join window, plus a margin for replication), or
earlier once every peer expected at the step (its state says it trains it, or it was in our
last roster) has posted its ready record: a dead peer then costs one full window, once. A
peer that sees only newcomers' records gives up after `give_up` seconds: nobody trained.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from p2ptrain.clock import wall_time
from p2ptrain.identity import peer_id_to_str
from p2ptrain.run import election, keys, records, states

log = logging.getLogger("p2ptrain.run.elect")


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

    def __post_init__(self) -> None:
        if not (self.window > 0 and self.group_size >= 1 and self.margin >= 0 and self.give_up > 0
                and self.poll > 0):
            raise ValueError("ElectConfig needs window > 0, group_size >= 1, margin >= 0, give_up > 0, poll > 0")


async def publish_ready(dht, run_id: str, step: int, addrs: list[str], joining: bool, window: float) -> float:
    """Store our ready record for `step`; returns its ready_at (wall time)."""
    ready_at = wall_time()
    await dht.store(keys.ready(run_id, step), records.encode_ready(ready_at, addrs, joining),
                    ttl=max(60.0, 20 * window))
    return ready_at


async def read_ready(dht, run_id: str, step: int) -> list[election.Ready]:
    out = []
    for sub, rec in (await dht.get(keys.ready(run_id, step))).items():
        try:
            out.append(records.decode_ready(peer_id_to_str(sub), rec.value))
        except records.RecordError as exc:
            log.info("ready record of %s dropped: %s", peer_id_to_str(sub), exc)
    return out


async def wait_for_deadline(dht, run_id: str, step: int, config: ElectConfig, ignored: set[str],
                            expected: set[str]) -> list[election.Ready] | None:
    """The ready records once the step closed (see the module docstring); None on give-up."""
    give_up = trio.current_time() + config.give_up
    while True:
        recs = [r for r in await read_ready(dht, run_id, step) if r.peer not in ignored]
        d = election.deadline(recs, config.window)
        if d is not None and wall_time() >= d + config.margin:
            return recs
        if d is not None:
            # Last step's roster is at this step too even if its state record is not out yet.
            waiting = (await states.peers_at_step(dht, run_id, step) | expected) - ignored
            if waiting and waiting <= {r.peer for r in recs}:
                return recs
        if d is None and trio.current_time() > give_up:
            return None
        await trio.sleep(config.poll if d is None else
                         max(0.02, min(config.poll, d + config.margin - wall_time())))


async def elect(dht, run_id: str, step: int, me: str, config: ElectConfig, ignored: set[str],
                expected: set[str], learn_addrs: Callable[[str, list[str]], None] | None = None) -> list[str]:
    """Our group for `step` in ring order, [] when nobody trained it. Candidates' addresses
    go to `learn_addrs` so the group can dial each other."""
    recs = await wait_for_deadline(dht, run_id, step, config, ignored, expected)
    if recs is None:
        return []
    cands = election.candidates(recs, config.window, ignored)
    if learn_addrs is not None:
        for r in cands:
            learn_addrs(r.peer, list(r.addrs))
    return election.my_group(run_id, step, [r.peer for r in cands], config.group_size, me)
