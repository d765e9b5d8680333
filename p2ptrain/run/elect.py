"""Election I/O: publishing our `ready` record and waiting out a step's deadline.

The rule itself (deadline, candidates, groups, ring order) is pure and lives in
`p2ptrain.run.election`; this module feeds it the records of our cell (`election`, "Cells"),
each timed by our first sighting of it (D1). A step closes at its deadline (the upper median
of the trained records' times + join window, plus a margin for replication), or
earlier once every peer expected at the step (its state says it trains it, it was in our
last roster, or it was a candidate of our election of the step before) has posted its ready
record. An expected peer that has not posted is checked
every `probe` seconds (`gone`: no connection and no dial succeeds): a crashed one stops
counting as expected, instead of costing everyone the full window (issue 17); one that is
merely slow, or unreachable to us only, still misses nothing it could have made: the
deadline rule is unchanged. A peer that sees only newcomers' records gives up after
`give_up` seconds: nobody trained.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from p2ptrain import entropy
from p2ptrain.clock import wall_time
from p2ptrain.identity import peer_id_to_str
from p2ptrain.records import RunRecords, keys
from p2ptrain.records.codecs import State
from p2ptrain.run import election

log = logging.getLogger("p2ptrain.run.elect")
_stored: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""DHT node -> {run id: `_Ours`}: our election records, and the cells they are stored in."""
Gone = Callable[[set[str]], Awaitable[set[str]]]
"""Which of these peers are certainly not there (`AllReduceService.unreachable`)."""
Behind = Callable[[], Awaitable[bool]]
"""Rule E16: asked once a join window while an election waits; True when the caller adopted
a later state (H3: one two or more steps past the step) and the wait ends."""


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
    """Seconds between reads of the step's records right after something changed..."""
    poll_max: float = 1.0
    """...growing 1.5x per quiet read up to this (O(N) records per read: issue 30)."""
    probe: float = 1.0
    """Seconds between checks that expected peers which have not posted are there at all."""

    def __post_init__(self) -> None:
        if not (self.window > 0 and self.group_size >= 1 and self.margin >= 0 and self.give_up > 0
                and 0 < self.poll <= self.poll_max and self.probe > 0):
            raise ValueError("ElectConfig needs window > 0, group_size >= 1, margin >= 0, give_up > 0, "
                             "0 < poll <= poll_max, probe > 0")


async def publish_ready(dht, run_id: str, step: int, addrs: list[str], joining: bool, window: float,
                        ready_at: float | None = None, tries: int = 0) -> float:
    """Store our ready record for `step` in our cell of each level a reader may need
    (`election.cells`: a reader reads the one level its run's size needs), concurrently. ready_at (now unless
    given) is informational: readers time a record by when they first saw it (D1)."""
    ready_at = wall_time() if ready_at is None else ready_at
    ours = _ours(dht, run_id)
    ours.forget_before(dht, step - 2)
    ours.ready[step] = dict(ready_at=ready_at, addrs=addrs, joining=joining, ttl=election.ready_ttl(window),
                            tries=tries, boot=ours.boot)
    await _file(dht, run_id, step, fresh="ready")
    return ready_at


async def publish_state(dht, run_id: str, state: State, window: float) -> None:
    """Store our state record under the run's `state` key (status, catch-up) and, for the
    election, in our cells of step `state.step` and of the step before (rule E10): a reader
    of step t's cell learns who is at t (expected) and who already moved past it (E9)
    from O(cell) records, where the run's key holds every peer's (O(N) a read; at 1,000
    peers a reply shows a quarter of them)."""
    ours = _ours(dht, run_id)
    # The step we were filed at before too: a peer that jumps (a catch-up from s to s + 4)
    # is past s, and s's readers must see it (else they wait for it at s: seed 157).
    before = ours.state[0].step if ours.state is not None else state.step
    ours.forget_before(dht, min(state.step - 2, before))
    state = dataclasses.replace(state, boot=ours.boot)
    ours.state = (state, election.ready_ttl(window))  # as long as the ready records beside them
    ours.state_steps = {state.step, state.step - 1, before} - {-1}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(RunRecords(dht, run_id).publish_state, state)
        for step in sorted(ours.state_steps):
            nursery.start_soon(functools.partial(_file, dht, run_id, step, fresh="state"))


@dataclass
class _Ours:
    """What one DHT node stored for one run's elections, and where."""
    level: int = 0
    """The level of cells we last read: we store at levels 0 .. one finer than it."""
    keys: dict[int, set[str]] = field(default_factory=dict)
    """step -> the cell keys holding our records of that step."""
    ready: dict[int, dict] = field(default_factory=dict)
    """step -> our ready record's fields (`RunRecords.publish_ready`'s arguments)."""
    state: tuple[State, float] | None = None
    """Our newest state record and its cell TTL."""
    state_steps: set[int] = field(default_factory=set)
    """The steps whose cells file it (E10)."""
    boot: str = field(default_factory=lambda: entropy.rng().randbytes(8).hex())
    """This incarnation (rule E11): records an earlier start of ours left in the DHT say another."""

    def forget_before(self, dht, step: int) -> None:
        # The DHT re-stores our records until told otherwise; a step's records are read only
        # while the step is open, so those of steps well past stop being re-stored.
        for old in [t for t in self.keys if t < step]:
            for k in self.keys.pop(old):
                dht.forget(k)
            self.ready.pop(old, None)


def _ours(dht, run_id: str) -> _Ours:
    return _stored.setdefault(dht, {}).setdefault(run_id, _Ours())


def our_boot(dht, run_id: str) -> str:
    """This incarnation's boot nonce (rule E11) for `run_id`'s records."""
    return _ours(dht, run_id).boot


async def _file(dht, run_id: str, step: int, fresh: str = "") -> None:
    """Store our ready and state records of `step` (those we have: E5, E10) in our cells at
    levels 0 .. one finer than we last read: those of the `fresh` kind ('ready', 'state')
    all again (the record changed), the others only where not stored yet. A reader moves
    one level per read, from a level everyone writes (0) down to ours, so the levels
    nobody reads cost no stores; and a reader that moves to a finer level files its own
    records there as it arrives (rule E12). Before, records stayed where they were first stored:
    at 1,000 peers step 0's readers moved two levels down to cells nobody had written and
    waited there for good (the simulator, seed 1: no group formed in 30 s)."""
    ours = _ours(dht, run_id)
    board = RunRecords(dht, run_id)
    stored = ours.keys.setdefault(step, set())
    state = ours.state if step in ours.state_steps else None
    jobs = []
    for level, cell in election.cells(run_id, step, dht.identity.peer_id_str)[:ours.level + 2]:
        ready_key, state_key = keys.ready(run_id, step, level, cell), keys.state(run_id, step, level, cell)
        if step in ours.ready and (fresh == "ready" or ready_key not in stored):
            stored.add(ready_key)
            jobs.append(functools.partial(board.publish_ready, step, level=level, cell=cell, **ours.ready[step]))
        if state is not None and (fresh == "state" or state_key not in stored):
            stored.add(state_key)
            jobs.append(functools.partial(board.publish_state, state[0], state[1], step, level, cell))
    if jobs:
        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(job)


async def cell_states(dht, run_id: str, step: int, level: int) -> dict[str, State]:
    """peer -> its state record, for the peers filed under our cell of `step` at `level`
    (`publish_state`): those at the step, and those past it."""
    me = dht.identity.peer_id_str
    got = await RunRecords(dht, run_id).read_states(step, level, election.cell(run_id, step, me, level))
    return {peer_id_to_str(sub): st for sub, st in got}


async def past_step(dht, run_id: str, step: int, level: int, peers: set[str]) -> set[str]:
    """Those of `peers` whose state record in our cell of `step` is past it (rule E13): they
    committed the step in another group or caught up past it, and never come to a round of it.
    A state record is its writer's own claim: a liar only leaves itself out."""
    if not peers:
        return set()
    sts = await cell_states(dht, run_id, step, level)
    return {p for p in peers if p in sts and sts[p].step > step}


async def away(dht, run_id: str, step: int, level: int, peers: set[str], tag: int,
               others: set[str] | None = None) -> set[str]:
    """Those of `peers` (the members we still await) that never come to our try of `step`,
    whose round tag is `tag`: past the step (E13, `past_step`), or, when `peers` are all the
    `others` of our roster, each past the step or with a ready record in our cell at a later
    try (rule T11: a member posts try k + 1 only once its try k ended uncommitted, or as a
    restart, J2; since T7 no message of ours can pass for its try's, so we wait for nobody).
    T11 only when nobody else is waiting with us: a member that stopped waiting for one that
    others still awaited went on to the next attempt alone (seed 105209). Each is the
    member's own claim: a liar only leaves itself out."""
    if not peers:
        return set()
    gone = await past_step(dht, run_id, step, level, peers)
    if others is None or peers != others or not peers - gone:
        return gone
    cell = election.cell(run_id, step, dht.identity.peer_id_str, level)
    later = {r.peer for r, _ in await RunRecords(dht, run_id).read_ready(step, level, cell) if r.tries > tag}
    return peers if peers <= gone | later else gone


async def read_ready(dht, run_id: str, step: int, window: float,
                     sightings: election.Sightings | None = None) -> list[election.Ready]:
    """The step's ready records in our cell (the finest level whose cell is not full:
    `election.level_move`; the level is remembered in `sightings`), each timed by when this
    reader first saw it (rule D1: the writer's ready_at and expiry move nothing)."""
    s = sightings if sightings is not None else election.Sightings()
    me = dht.identity.peer_id_str
    board = RunRecords(dht, run_id)
    level = s.level(step)
    got = await board.read_ready(step, level, election.cell(run_id, step, me, level))
    for _ in range(election.LEVELS):  # at most one pass down or up the levels
        move = election.level_move(level, len(got))
        if move > 0:
            s.full.add((step, level))
            level += 1
            got = await board.read_ready(step, level, election.cell(run_id, step, me, level))
        elif move < 0:
            if (step, level - 1) in s.full:
                break
            parent = await board.read_ready(step, level - 1, election.cell(run_id, step, me, level - 1))
            if len(parent) >= election.SPLIT:
                s.full.add((step, level - 1))
                break
            level, got = level - 1, parent
        else:
            break
    s.set_level(step, level)
    _ours(dht, run_id).level = s.last_level
    await _file(dht, run_id, step)  # a no-op unless we moved to a level we have not stored at
    seen = s.observe(step, [r.peer for r, _ in got], wall_time())
    return [dataclasses.replace(r, ready_at=seen[r.peer]) for r, _ in got]


def same_cell(run_id: str, step: int, me: str, level: int, peers: set[str]) -> set[str]:
    """Those of `peers` in our cell at `level` (the only ones our election can see)."""
    if level == 0:
        return set(peers)
    mine = election.cell(run_id, step, me, level)
    return {p for p in peers if election.cell(run_id, step, p, level) == mine}


def _retry_candidates(recs: list[election.Ready], me: str, past: set[str], boots: dict[str, str],
                      ahead_joining: set[str]) -> list[election.Ready]:
    """The records a retry of the step deals from (not a first try: there the other groups'
    members count for the deal even once they committed, and a late closer would deal from
    fewer peers than its group did). Each rule leaves out a record whose writer will not come:
    - E9: its state is already past the step (it committed and moved on). Counted, a peer
      partitioned away that retried a step the others had long committed elected them all
      and waited out its retry's first confirmation (the simulator, seed 13, 4 peers).
    - E11: an earlier incarnation of its writer (a restarted peer whose new state record names
      another boot). A retry elected a peer from the record it posted before its crash, while
      it caught up after its restart, and waited out the first confirmation for it (seed 157).
    - E15: a record of an earlier try than ours whose writer has announced the next step as a
      joiner (E7's evidence): it gave up on this step and waits for its state. The red team's
      sybil-4 (4 honest + 4 Sybils, one group of 8): the Sybils skipped the step's first retry
      as joiners and joined step 3 ahead; every later retry still dealt their try-1 records,
      the honest held half the group without the tie-break (Q1), and no retry could go (0
      commits in 150 s). A record of our try or a later one is its writer's current word.
    Each is its writer's own claim: a liar only leaves itself out."""
    own = max((r.tries for r in recs if r.peer == me), default=0)
    recs = election.current_incarnation([r for r in recs if r.peer not in past], boots)
    return [r for r in recs if not (r.peer in ahead_joining and r.tries < own)]


async def wait_for_deadline(dht, run_id: str, step: int, config: ElectConfig, ignored: set[str],
                            expected: set[str], sightings: election.Sightings | None = None,
                            gone: Gone | None = None, retry: bool = False,
                            behind: Behind | None = None) -> tuple[list[election.Ready], float] | None:
    """(ready records, the deadline waited for) once the step closed (module docstring);
    None on give-up. Expected peers not posted yet count toward the median deadline
    (`election.deadline`): an early peer that sees only itself and a liar does not close the
    step on the others. Polls back off from `poll` to `poll_max` while nothing changes, never
    past the deadline. `behind` (E16): asked a join window after the first; True gives up."""
    sightings = sightings if sightings is not None else election.Sightings()
    me = dht.identity.peer_id_str
    give_up = trio.current_time() + config.give_up
    absent: set[str] = set()
    probe_at = trio.current_time()
    interval, before = config.poll, None
    at_step: set[str] = set()
    past: set[str] = set()
    boots: dict[str, str] = {}
    ahead_joining: set[str] = set()
    states_at = trio.current_time()
    behind_at = trio.current_time() + config.window
    while True:
        recs = [r for r in await read_ready(dht, run_id, step, config.window, sightings) if r.peer not in ignored]
        # Last step's roster is at this step too even if its state record is not out yet. Our
        # cell's state records (E10; O(cell) a read): every `probe` seconds, not every poll, and
        # afresh before closing early (a peer whose state appeared since is expected too).
        fresh = trio.current_time() >= states_at
        if fresh:
            sts = await cell_states(dht, run_id, step, sightings.level(step))
            at_step = {p for p, st in sts.items() if st.step == step}
            past = {p for p, st in sts.items() if st.step > step} - {me}
            boots = {p: st.boot for p, st in sts.items() if st.boot}
            states_at = trio.current_time() + config.probe
            if retry:  # rule E15's evidence, read as E7's
                ahead_joining = {r.peer for r in await read_ready(dht, run_id, step + 1, config.window, sightings)
                                 if r.joining} - {me}
        if behind is not None and trio.current_time() >= behind_at:
            # Rule E16: an election still waiting a join window after it began asks H3 again
            # (a state two or more steps past ours): a partition that healed while we waited
            # shows the run gone on without us, and we adopt its state now rather than after
            # this step's election and round (seed 111371). Once a window: a wait that ends
            # within one costs nothing.
            behind_at = trio.current_time() + config.window
            if await behind():
                return None
        if retry:
            recs = _retry_candidates(recs, me, past, boots, ahead_joining)
        waiting = (at_step | expected) - ignored - absent - past  # past the step: not coming
        waiting = same_cell(run_id, step, me, sightings.level(step), waiting)
        posted = {r.peer for r in recs}
        if trio.current_time() >= probe_at and waiting - posted:
            # Rule E7: a peer that already announced step t + 1 *as a joiner* (it caught up to
            # state t and joins the next step ahead) is not coming to step t, though its state
            # record says t (waiting for it cost two join windows). A trained record for t + 1
            # says nothing: overlapped runs post it beside round t.
            ahead = {r.peer for r in await read_ready(dht, run_id, step + 1, config.window, sightings) if r.joining}
            absent |= (waiting - posted) & ahead
            if gone is not None and waiting - posted - absent:
                absent |= await gone(waiting - posted - absent)
            waiting -= absent
            probe_at = trio.current_time() + config.probe
        missing = len(waiting - posted)
        d = election.deadline(recs, config.window, missing, wall_time())
        early = bool(waiting and not missing)
        if d is not None and early and not fresh and wall_time() < d + config.margin:
            states_at = trio.current_time()
            continue
        if d is not None and (wall_time() >= d + config.margin or early):
            return recs, d
        if d is None and early:  # E19: all we wait for joined, none trains: nothing will time it (E4)
            if fresh:  # afresh (a state read since may name a trainer), not at `give_up` (600 s)
                return None
            states_at = trio.current_time()
            continue
        if d is None and trio.current_time() > give_up:
            return None
        state = (posted, missing)
        interval = config.poll if state != before else min(config.poll_max, interval * 1.5)
        before = state
        await trio.sleep(interval if d is None else max(0.02, min(interval, d + config.margin - wall_time())))


async def elect(dht, run_id: str, step: int, me: str, config: ElectConfig, ignored: set[str],
                expected: set[str], learn_addrs: Callable[[str, list[str]], None] | None = None,
                sightings: election.Sightings | None = None, gone: Gone | None = None,
                retry: bool = False, behind: Behind | None = None) -> list[str]:
    """Our group for `step` in ring order, [] when nobody trained it. Candidates' addresses
    go to `learn_addrs` so the group can dial each other; `gone` and `retry` as in
    `wait_for_deadline`."""
    got = await wait_for_deadline(dht, run_id, step, config, ignored, expected, sightings, gone, retry, behind)
    if got is None:
        return []
    recs, d = got
    cands = election.candidates(recs, config.window, ignored, at=d)
    if sightings is not None:
        sightings.closed[step] = {r.peer: r.tries for r in cands}
        sightings.deadlines[step] = d
    if learn_addrs is not None:
        for r in cands:
            learn_addrs(r.peer, list(r.addrs))
    return election.my_group(run_id, step, [r.peer for r in cands], config.group_size, me)
