"""The all-reduce service of a simulated peer: control messages and a message-level data plane.

It implements the interface `p2ptrain.run.round.ReduceService` (plus `unreachable`), so the
real round logic -- roster confirmation and merge, signed headers and their verification,
leave-one-out, the ledger -- runs on top unchanged:

  - `exchange`: each member's payload reaches each other member after the link's latency,
    if the link is up and the sender's policy talks to it; a member that answers strangers
    (`answer_strangers`) answers a sender outside its roster once, as the real `Inbox` does;
    a member certainly gone (its dial refused) is silent at once with `unreachable_silent`.
    As the real `Inbox`, a message that came before its receiver began the exchange and was
    last sent more than `early_ttl` before is dropped, and a long wait sends again to those
    it awaits (R7, R7b).
  - `allreduce`: the ring is modelled as one atomic decision with the real commit semantics
    (`p2ptrain.reduce.commit`: every member commits the same result, or none does). The
    round commits when every member of the same roster joined with the same round id,
    every member's contribution headers verified (its `HeldChecker` settled good), nobody
    aborted, every ring link is up and no member is down; then each member gets the same
    float32 mean, after the ring's transfer time. Otherwise it fails for every member
    (`RoundFailed`, nobody blamed), after the setup timeout or, for a member certainly
    gone, at the next probe. Frames themselves are not modelled: the data plane's checks
    are tested on real sockets (tests/test_ring.py, test_allreduce_integration.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import trio

from p2ptrain.identity import peer_id_from_str
from p2ptrain.reduce import ring
from p2ptrain.reduce.service import AllReduceConfig, RoundFailed
from p2ptrain.sim.net import SimNet


@dataclass
class _Result:
    result: np.ndarray
    sent_bytes: int
    scores: list | None = None


@dataclass
class _Round:
    members: tuple[str, ...]
    started: float
    vecs: dict[str, np.ndarray] = field(default_factory=dict)
    checks: dict[str, object] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    blamed: dict[str, str] = field(default_factory=dict)
    outcome: tuple[bool, float, np.ndarray | None] | None = None  # (committed, at, result)


class Hub:
    """What every simulated service shares: mailboxes and rounds, keyed by run and round id."""

    def __init__(self, net: SimNet, on_round=None) -> None:
        self.net = net
        # (run, rid, to) -> from -> (first arrival, msg, arrivals of its last two sends: R7b)
        self.mail: dict[tuple, dict[str, tuple[float, bytes, tuple[float, ...]]]] = {}
        self.answering: dict[tuple, tuple[bytes, set[str]]] = {}     # (run, rid, me) -> (payload, roster)
        self.rounds: dict[tuple, _Round] = {}
        self.changed = trio.Event()
        self.on_round = on_round
        self.trickled: list[tuple[float, bool]] = []
        """(seconds added, failed) of each decided round with a trickling member."""
        """Called with (run, round id, members, {member: vector}, committed) once a round is decided."""

    def poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def post(self, run: str, rid: str, frm: str, to: str, payload: bytes, first: bool = False) -> bool:
        """File `payload` in `to`'s inbox after the link's latency: False when it cannot get
        there now (a partition, a crash, a refusing policy: the real sender's stream does not
        open), which the sender learns, as the real one does."""
        a, b = peer_id_from_str(frm), peer_id_from_str(to)
        if not self.net.reachable(a, b, rounds=True):
            return False
        box = self.mail.setdefault((run, rid, to), {})
        if first and frm in box:
            return True
        at, old = trio.current_time() + self.net.latency(a, b), box.get(frm)
        # sent again (R7, R7b): as the real inbox, a receiver keeps the first that arrived
        box[frm] = (min(old[0], at), old[1], (old[2][-1], at)) if old is not None else (at, payload, (at,))
        ans = self.answering.get((run, rid, to))
        if ans is not None and frm not in ans[1]:  # the receiver answers a stranger, once
            self.post(run, rid, to, frm, ans[0], first=True)
        self.poke()
        return True

    def arrived(self, run: str, rid: str, to: str, frm: str) -> bytes | None:
        got = self.mail.get((run, rid, to), {}).get(frm)
        return got[1] if got is not None and got[0] <= trio.current_time() else None

    def expire(self, run: str, rid: str, to: str, ttl: float) -> None:
        """`to` begins exchange `rid`: as the real `Inbox`, what arrived before and was last
        sent more than `ttl` ago is dropped (its sender gave up on it); one still on its way
        is kept."""
        box, now = self.mail.get((run, rid, to), {}), trio.current_time()
        for frm, (first, msg, sends) in list(box.items()):
            landed = [t for t in sends if t <= now]
            if first <= now and now - max(landed, default=first) > ttl:
                later = [t for t in sends if t > now]
                if later:
                    box[frm] = (later[0], msg, tuple(later))
                else:
                    del box[frm]

    def next_arrival(self, run: str, rid: str, to: str) -> float:
        now = trio.current_time()
        return min((t for t, _, _ in self.mail.get((run, rid, to), {}).values() if t > now), default=math.inf)

    async def wait(self, until: float) -> None:
        with trio.move_on_at(until):
            await self.changed.wait()

    def forget(self, peer: str) -> None:
        """A crashed peer's inbox is gone with its process."""
        for key in [k for k in self.mail if k[2] == peer]:
            del self.mail[key]
        for key in [k for k in self.answering if k[2] == peer]:
            del self.answering[key]


class SimReduceService:
    """One peer's service (`Parts.service`): built by `p2ptrain.peer.run_peer` like the real one."""

    def __init__(self, hub: Hub, me: str, config: AllReduceConfig) -> None:
        self.hub, self.me, self.config = hub, me, config
        self.net = hub.net
        self.pid = peer_id_from_str(me)
        self.ring_cfg = ring.RingConfig(config.mode, sub_chunk_bytes=config.sub_chunk_bytes)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    def _gone(self, peer: str) -> bool:
        return self.net.refused(self.pid, peer_id_from_str(peer), rounds=True)

    async def exchange(self, run_id: str, round_id: str, members: list[str], payload: bytes, timeout: float,
                       unreachable_silent: bool = False, answer_strangers: bool = False,
                       absent=None, cut=None, split=None) -> dict[str, bytes | None]:
        hub = self.hub
        pol = self.net.policy.get(self.pid)
        if pol is not None and pol.inflate and round_id.endswith("/roster"):
            payload = _inflated(payload, run_id, round_id, pol.inflate)
        if answer_strangers:
            hub.answering[(run_id, round_id, self.me)] = (payload, set(members))
            for frm in list(hub.mail.get((run_id, round_id, self.me), {})):
                if frm not in members:
                    hub.post(run_id, round_id, self.me, frm, payload, first=True)
        hub.expire(run_id, round_id, self.me, self.config.early_ttl)
        others = [p for p in members if p != self.me]
        undelivered = {p for p in others if not hub.post(run_id, round_id, self.me, p, payload)}
        deadline = trio.current_time() + timeout
        away: set[str] = set()  # rule E13, asked once a second as the real inbox does
        ask = trio.current_time() + 1.0
        fresh = trio.current_time() + self.config.early_ttl / 2 if timeout > self.config.early_ttl / 2 else math.inf
        while trio.current_time() < deadline:
            if cut is not None and any(hub.arrived(run_id, round_id, self.me, p) is not None for p in others):
                deadline, cut = min(deadline, trio.current_time() + cut), None  # R4a, as the real inbox
            if split is not None and any(split[1](d) for p in others
                                         if (d := hub.arrived(run_id, round_id, self.me, p)) is not None):
                deadline, split = min(deadline, trio.current_time() + split[0]), None  # R6, as the real inbox
            waiting = [p for p in others if hub.arrived(run_id, round_id, self.me, p) is None
                       and not (unreachable_silent and self._gone(p)) and p not in away]
            if waiting and trio.current_time() >= ask:
                # rules R7, R7c: what did not go is sent again until it goes
                undelivered = {p for p in undelivered if not hub.post(run_id, round_id, self.me, p, payload)}
                if absent is not None:
                    away |= set(await absent(set(waiting)))
                    waiting = [p for p in waiting if p not in away]
                ask = trio.current_time() + 1.0
            if waiting and trio.current_time() >= fresh:  # rule R7b, as the real inbox
                for p in waiting:
                    hub.post(run_id, round_id, self.me, p, payload)
                fresh = trio.current_time() + self.config.early_ttl / 2
            if not waiting:
                for p in undelivered:  # R7c: theirs came in, ours may not have: once more
                    if hub.arrived(run_id, round_id, self.me, p) is not None:
                        hub.post(run_id, round_id, self.me, p, payload)
                break
            await hub.wait(min(deadline, hub.next_arrival(run_id, round_id, self.me), trio.current_time() + 1.0))
        out: dict[str, bytes | None] = {p: hub.arrived(run_id, round_id, self.me, p) for p in others}
        out[self.me] = payload
        return out

    async def abort(self, run_id: str, round_id: str, reason: str) -> None:
        for (run, rid, _), r in self.hub.rounds.items():
            if run == run_id and rid == round_id and self.me in r.members:
                r.aborted.add(self.me)
        self.hub.poke()

    async def unreachable(self, peers: set[str], timeout: float = 3.0, refused_only: bool = False) -> set[str]:
        """As `reach.unreachable`: a refused dial answers in a round trip, a silent one only
        after `timeout` (and never counts with `refused_only`)."""
        gone, slowest = set(), 0.0
        for p in sorted(peers):
            b = peer_id_from_str(p)
            if self.net.refused(self.pid, b, rounds=True):
                gone.add(p)
                slowest = max(slowest, 2 * self.net.latency(self.pid, b))
            elif not (self.net.reachable(self.pid, b, rounds=True) and self.net.reachable(b, self.pid, rounds=True)):
                slowest = timeout
                if not refused_only:
                    gone.add(p)
            else:
                slowest = max(slowest, 2 * self.net.latency(self.pid, b))
        await trio.sleep(slowest)
        return gone

    async def allreduce(self, vec, run_id: str, round_id: str, members: list[str], own=None, check=None,
                        robust=None, on_own=None):
        if robust is not None:
            raise NotImplementedError("the simulator models the mean ring only")
        rank, world = members.index(self.me), len(members)
        if on_own is not None:  # as the ring: our own frames are encoded (and signed) first
            for j, p in enumerate(ring.own_payloads(vec, rank, world, self.ring_cfg)):
                on_own(j, memoryview(p))
            on_own(-1, None)
        # As the real service: a member that never comes fails the bulk setup, one that sends
        # nothing fails the data plane at a frame's timeout or at the round's data budget,
        # whichever comes first (before: setup + frame timeout, twice the budget's 15 s).
        span = min(self.config.setup_timeout + self.config.frame_timeout,
                   self.config.data_budget(vec.nbytes, world))
        pol = self.net.policy.get(self.pid)
        if pol is not None and pol.withhold:  # never sends a frame: the others time out
            await trio.sleep(span)
            raise RoundFailed("withholding", {})
        key = (run_id, round_id, tuple(members))
        r = self.hub.rounds.get(key)
        if r is None:
            r = self.hub.rounds[key] = _Round(tuple(members), trio.current_time())
        r.vecs[self.me] = np.array(vec, np.float32)
        r.checks[self.me] = check
        self.hub.poke()
        deadline = r.started + span
        while r.outcome is None:
            now = trio.current_time()
            verdict = self._verdict(r, now >= deadline)
            if verdict is not None:
                self._decide(r, key, *verdict)
                break
            await self.hub.wait(min(deadline, now + 1.0))
        committed, at, result = r.outcome
        await trio.sleep_until(max(at, trio.current_time()))
        if not committed:  # as the real setup: a member whose dial is refused is named gone
            gone = tuple(m for m in r.members if m != self.me and self.net.refused(self.pid, peer_id_from_str(m)))
            raise RoundFailed("simulated round failed", dict(r.blamed), gone=gone)
        return _Result(result.copy(), int(vec.nbytes * 2 * (world - 1) / world))

    def _verdict(self, r: _Round, timed_out: bool) -> tuple[bool, float] | None:
        """(committed, when) once the round is decided, None while it is open."""
        now = trio.current_time()
        ids = [peer_id_from_str(m) for m in r.members]
        if r.aborted or any(not self.net.alive(p) for p in ids):
            return False, now
        pending = [m for m in r.members if m not in r.vecs or r.checks[m] is not None and r.checks[m].pending()]
        if pending:
            return (False, now) if timed_out else None
        if any(r.checks[m] is not None and not r.checks[m].passed() for m in r.members):
            return False, now  # a member's headers were bad or missing: its checks fail every frame
        ring_links = list(zip(ids, ids[1:] + ids[:1]))
        if len(ids) > 1 and not all(self.net.reachable(a, b, rounds=True) for a, b in ring_links):
            return (False, now) if timed_out else None
        full = next(iter(r.vecs.values())).nbytes
        hop = max((self.net.transfer(a, b, full // max(1, len(ids))) for a, b in ring_links), default=0.0)
        slow, blamed, failed = self._trickled(r)
        took = 2 * (len(ids) - 1) * hop + slow
        budget = self.config.data_budget(full, len(ids))
        if slow:  # (seconds it added, failed) of a round with a trickling member
            self.hub.trickled.append((min(slow, budget), failed or took > budget))
        if failed:
            r.blamed = blamed
            return False, now + slow
        if took > budget:  # as the real data plane: closed at its budget, nobody blamed
            return False, now + budget
        return True, now + took

    def _trickled(self, r: _Round) -> tuple[float, dict[str, str], bool]:
        """Members trickling their frames (`Policy.trickle`): what the real per-frame rules
        make of it (`sim.attacks.trickled_round`): (seconds added, blamed, failed)."""
        from p2ptrain.sim import attacks

        trickles = {}
        nbytes = next(iter(r.vecs.values())).nbytes
        for m in r.members:
            pol = self.net.policy.get(peer_id_from_str(m))
            if pol is not None and pol.trickle:
                trickles[m] = attacks.slowest(self.config, attacks.frames(self.config, nbytes, len(r.members))[1])
        if not trickles:
            return 0.0, {}, False
        return attacks.trickled_round(trickles, self.config, nbytes, len(r.members))

    def _decide(self, r: _Round, key: tuple, committed: bool, at: float) -> None:
        result = None
        if committed:  # every member's copy: the same float32 sum in roster order, over W
            acc = np.zeros_like(r.vecs[r.members[0]])
            for m in r.members:
                acc += r.vecs[m]
            result = acc / np.float32(len(r.members))
        r.outcome = (committed, at, result)
        if self.hub.on_round is not None:
            self.hub.on_round(key[0], key[1], r.members, dict(r.vecs), committed)
        self.hub.poke()


def _inflated(payload: bytes, run_id: str, round_id: str, extra: tuple[str, ...]) -> bytes:
    """A roster confirmation whose view names `extra` peers too, hashed as an honest one."""
    from p2ptrain.run import election
    from p2ptrain.run import roster as rosters

    t, attempt = (int(x) for x in round_id.split("/")[:2])
    c = rosters.decode(payload, run_id, t, attempt)
    if c is None:
        return payload
    view = election.ring_order(run_id, t, sorted(set(c.view) | set(extra)))
    return rosters.Confirm(election.roster_hash(run_id, t, attempt, view), c.base, c.chunk, tuple(view)).encode()
