"""Small all-to-all exchanges (roster confirmation, contribution headers): who may fill
which inbox. Transport-free (trio only): `AllReduceService` sends the messages and feeds
what arrives to `Inbox.put`.

The old inbox was one map of at most 256 tags with the oldest evicted: anyone could flood
257 bogus tags and evict the inbox of an exchange a node was waiting on. Here:
- the inbox of an exchange this node is running takes messages only from its members, one
  per member, and is never evicted;
- a message for an exchange not started here yet (members start a little apart) is kept per
  sender, at most `per_sender` tags each (a flood pushes out only the flooder's own);
- senders in a roster this node announced (`known`) are kept as long as they send; other
  senders ("strangers": a newcomer's first exchange) share `strangers` slots, the oldest
  stranger going first, so a Sybil flood can delay newcomers but never a known member;
- an exchange may answer strangers (`collect(answer=...)`): a peer outside our member list
  that sent us its message for the tag gets ours back, once, whether its message came
  before, during or (for the last `RECENT_ANSWERS` such exchanges) after ours. A newcomer
  lists a member whose own roster lacks it; without the answer that member is silent to the
  newcomer, which then confirms a roster without it while everyone else merges theirs, and
  it misses the step (issue 17, seen in CI).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from p2ptrain.identity import peer_id_to_str

log = logging.getLogger("p2ptrain.reduce.exchange")


@dataclass
class InboxConfig:
    per_sender: int = 64
    """Early tags kept per sender. A control message is at most 4 KiB, so this bounds a
    sender at 256 KiB; 64 covers the sparse collective's 32 exchanges in flight
    (p2ptrain.reduce.sparse.LANES) when a member runs a lane ahead of us."""
    strangers: int = 64
    early_ttl: float = 60.0
    """Seconds a message for an exchange not started here is kept. Older, its sender has
    given up on that exchange (its wait is shorter: `TimeoutsSpec.early_ttl`), and when
    everyone skipped a step and trains it again, the retry reuses the first try's exchange
    ids: a header of the first try, still waiting here, would be held against the retry's
    frames and get an honest member blamed."""

    def __post_init__(self) -> None:
        if self.per_sender < 1 or self.strangers < 0 or not self.early_ttl > 0:
            raise ValueError("per_sender must be >= 1, strangers >= 0 and early_ttl > 0")


RECENT_ANSWERS = 32
"""Finished exchanges whose late strangers are still answered."""


@dataclass
class _Answer:
    payload: bytes
    members: frozenset  # they got it from `send`: never answered again
    sent: set = field(default_factory=set)


@dataclass
class _Waiting:
    ids: frozenset
    box: dict = field(default_factory=dict)
    event: trio.Event = field(default_factory=trio.Event)


class Inbox:
    def __init__(self, known: Callable[[bytes], bool], config: InboxConfig | None = None) -> None:
        self.known = known
        self.config = config or InboxConfig()
        self._waiting: dict[bytes, _Waiting] = {}
        self._early: dict[bytes, dict[bytes, tuple[bytes, float]]] = {}  # sender -> tag -> (payload, when)
        self._answers: OrderedDict[bytes, _Answer] = OrderedDict()  # tag -> our payload for strangers

    def put(self, sender: bytes, tag: bytes, data: bytes) -> bytes | None:
        """File a message; returns our payload when the sender is a stranger to an exchange
        that answers them (the caller sends it back), else None."""
        w = self._waiting.get(tag)
        if w is not None:
            if sender not in w.ids:
                log.info("exchange message from %s dropped: not a member", peer_id_to_str(sender))
                return self._answer(tag, sender)
            w.box.setdefault(sender, data)
            w.event.set()
            return None
        if tag in self._answers:  # a late stranger of a finished exchange: answered, not kept
            return self._answer(tag, sender)
        early = self._early.pop(sender, None)
        if early is None and not self.known(sender):
            strangers = [s for s in self._early if not self.known(s)]
            if len(strangers) >= self.config.strangers:
                if not strangers:
                    return
                del self._early[strangers[0]]
        early = early or {}
        early.pop(tag, None)
        early[tag] = (data, trio.current_time())
        while len(early) > self.config.per_sender:
            early.pop(next(iter(early)))
        self._early[sender] = early  # re-inserted: the most recent sender last
        return None

    def _take_early(self, sender: bytes, tag: bytes) -> bytes | None:
        """`sender`'s early message for `tag`, unless it is older than `early_ttl` (dropped)."""
        item = self._early.get(sender, {}).pop(tag, None)
        if item is None:
            return None
        if trio.current_time() - item[1] > self.config.early_ttl:
            log.info("exchange message from %s dropped: %.0f s old, its exchange is over",
                     peer_id_to_str(sender), trio.current_time() - item[1])
            return None
        return item[0]

    def _answer(self, tag: bytes, sender: bytes) -> bytes | None:
        a = self._answers.get(tag)
        if a is None or sender in a.members or sender in a.sent or len(a.sent) >= self.config.strangers:
            return None
        a.sent.add(sender)
        return a.payload

    async def collect(self, tag: bytes, ids: list[bytes], me: bytes, timeout: float, send,
                      unreachable_silent: bool = False, gone=None, probe: float = 1.0,
                      answer: tuple[bytes, Callable[[list[bytes]], Awaitable]] | None = None,
                      absent: Callable[[set[bytes]], Awaitable[set[bytes]]] | None = None,
                      cut: float | None = None, split: tuple[float, Callable[[bytes], bool]] | None = None,
                      resend: Callable[[list[bytes]], Awaitable] | None = None) -> dict[bytes, bytes]:
        """Run one exchange: `send()` our payload (it returns those it could not open a stream
        to), then wait until every other member's arrived or `timeout`. Returns member ->
        payload for those that arrived. With `unreachable_silent` and `gone(members)` (those
        certainly gone: no connection, no dial), members still awaited are checked at once if
        `send()` could not reach them, then every `probe` seconds; the gone count as silent
        (issue 17). A failed stream alone is not enough: "no valid connections" is often
        transient (CI saw a live member left out of its group). `answer`: (our payload,
        `reply(strangers)`) to answer strangers with (module doc). `absent(awaited)`: those
        that will not come (E13), asked every `probe` seconds; what they sent still counts.
        `cut`: once any payload arrived, wait at most `cut` seconds more (R4a); `split`:
        (seconds, test), the same once a payload passing `test` arrived (R6). `resend(ids)`:
        send again to those `send()` could not reach, every `probe` seconds until it reaches
        them and once more as we leave (R7, R7c: a partition that heals during the wait no
        longer costs all of it), and to every member still awaited every `early_ttl / 2`
        (R7b: a member that has not begun the exchange keeps what we sent it early only
        `early_ttl`, and our wait may be longer)."""
        others = frozenset(p for p in ids if p != me)
        if tag in self._waiting:
            raise ValueError("exchange already running")
        w = self._waiting[tag] = _Waiting(others)
        for p in others:
            data = self._take_early(p, tag)
            if data is not None:
                w.box[p] = data
        early_strangers = []
        if answer is not None:
            self._answers[tag] = _Answer(answer[0], others | {me})
            while len(self._answers) > RECENT_ANSWERS:
                self._answers.popitem(last=False)
            for p in list(self._early):
                if p != me and self._take_early(p, tag) is not None and self._answer(tag, p) is not None:
                    early_strangers.append(p)
        try:
            undelivered = set(await send() or ()) & others
            if early_strangers:
                await answer[1](early_strangers)
            probing = unreachable_silent and gone is not None
            unreachable: set[bytes] = set()
            away: set[bytes] = set()
            ask = trio.current_time() + probe

            async def drop_gone(candidates: set[bytes]) -> None:
                if probing and candidates:
                    unreachable.update(set(await gone(candidates)) & candidates)

            def awaited() -> set[bytes]:
                return set(others - unreachable - away - w.box.keys())

            with trio.move_on_after(timeout) as scope:
                async with trio.open_nursery() as nursery:
                    if resend is not None and undelivered:
                        nursery.start_soon(_send_again, resend, undelivered, lambda: unreachable | away, probe)
                    if resend is not None and timeout > self.config.early_ttl / 2:
                        nursery.start_soon(_keep_fresh, resend, awaited, self.config.early_ttl / 2)
                    await drop_gone(set(undelivered))
                    while awaited():
                        if cut is not None and w.box:
                            scope.deadline, cut = min(scope.deadline, trio.current_time() + cut), None
                        if split is not None and any(split[1](d) for d in w.box.values()):
                            scope.deadline, split = min(scope.deadline, trio.current_time() + split[0]), None
                        w.event = trio.Event()
                        with trio.move_on_after(probe if probing or absent is not None else math.inf):
                            await w.event.wait()
                        await drop_gone(set(others - unreachable - w.box.keys()))
                        if absent is not None and awaited() and trio.current_time() >= ask:
                            away.update(set(await absent(awaited())) & awaited())
                            ask = trio.current_time() + probe
                    if resend is not None and (late := sorted(undelivered & w.box.keys())):
                        # R7c: one whose payload reached us may lack ours: once more as we leave
                        undelivered.intersection_update(set(await resend(late) or ()))
                    nursery.cancel_scope.cancel()
            return {p: d for p, d in w.box.items() if p not in unreachable}
        finally:
            del self._waiting[tag]


async def _send_again(resend, undelivered: set, skip, probe: float) -> None:
    """Rule R7: to members our payload did not reach (`undelivered`, updated in place),
    every `probe` seconds until it reaches them (R7c: whether or not theirs reached us;
    sent only while they were awaited, a member whose payload came in first never got ours:
    simulator seed 127353, a partition healing under a retry's confirmation); never to those
    `skip()` names (found gone, or away: E13)."""
    while undelivered:
        await trio.sleep(probe)
        undelivered -= skip()
        if undelivered:
            undelivered.intersection_update(set(await resend(sorted(undelivered)) or ()))


async def _keep_fresh(resend, awaited, every: float) -> None:
    """Rule R7b: to every member still awaited, every `every` seconds (half the early TTL)."""
    while True:
        await trio.sleep(every)
        if targets := sorted(awaited()):
            await resend(targets)
