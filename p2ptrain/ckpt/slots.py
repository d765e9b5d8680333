"""Who a donor serves next: serving slots shared out per requesting identity (pure logic: no
I/O, no trio; `p2ptrain.ckpt.fetch.BlobServer` does the waiting).

One shared first-come queue let one identity take every slot: it opened more requests than
there are slots and read them slowly, and an honest newcomer's request got its first byte
after its own timeout had passed (issue 32). Here:
  - an identity holds at most `per_peer` slots at once (a downloader asks a donor for 2
    chunks at a time: `DownloadConfig.per_donor`);
  - its further requests wait in a queue of their own, at most `per_peer_waiting` of them,
    and all queues together hold at most `max_waiting` (more are refused at once);
  - a freed slot goes to the identities waiting in turn (round-robin): an identity with one
    request waits behind at most one request of every other identity, however many those
    opened.
How long a granted slot may be held is the server's business (its per-request deadline).
Many identities still each get their turn: this shares slots fairly per identity, it does
not tell an honest identity from a free Sybil one.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable


@dataclass(frozen=True)
class SlotConfig:
    slots: int = 4
    per_peer: int = 2
    per_peer_waiting: int = 4
    max_waiting: int = 64

    def __post_init__(self) -> None:
        if self.slots < 1 or self.per_peer < 1 or self.per_peer_waiting < 0 or self.max_waiting < 0:
            raise ValueError("slots and per_peer must be >= 1, the waiting bounds >= 0")


class FairSlots:
    """Slots granted per identity, in turn. Tickets are the caller's own objects."""

    def __init__(self, config: SlotConfig | None = None) -> None:
        self.config = config or SlotConfig()
        self.active: dict[Hashable, int] = {}
        self._queues: OrderedDict[Hashable, deque] = OrderedDict()  # order = whose turn comes first
        self.waiting = 0

    @property
    def busy(self) -> int:
        return sum(self.active.values())

    def ask(self, peer: Hashable, ticket) -> bool | None:
        """True: `ticket` holds a slot now. False: it waits its turn (a later `release` returns
        it). None: refused (this identity or the queue is full)."""
        if self.busy < self.config.slots and self.active.get(peer, 0) < self.config.per_peer:
            self.active[peer] = self.active.get(peer, 0) + 1
            return True
        queue = self._queues.get(peer)
        if (self.waiting >= self.config.max_waiting
                or (queue is not None and len(queue) >= self.config.per_peer_waiting)
                or self.config.per_peer_waiting == 0):
            return None
        if queue is None:
            queue = self._queues[peer] = deque()
        queue.append(ticket)
        self.waiting += 1
        return False

    def leave(self, peer: Hashable, ticket) -> bool:
        """Take a waiting `ticket` out of its queue (its requester gave up); False if it was
        not waiting (granted meanwhile: the caller then holds a slot to release)."""
        queue = self._queues.get(peer)
        if queue is None or ticket not in queue:
            return False
        queue.remove(ticket)
        self.waiting -= 1
        if not queue:
            del self._queues[peer]
        return True

    def release(self, peer: Hashable) -> list:
        """`peer` is done with a slot: the tickets granted a slot now, in turn."""
        left = self.active.get(peer, 0) - 1
        if left > 0:
            self.active[peer] = left
        else:
            self.active.pop(peer, None)
        if peer in self._queues:
            self._queues.move_to_end(peer)  # it just had its turn
        return self._grant()

    def _grant(self) -> list:
        granted = []
        while self.busy < self.config.slots:
            peer = next((p for p in self._queues if self.active.get(p, 0) < self.config.per_peer), None)
            if peer is None:
                break
            queue = self._queues.pop(peer)
            granted.append(queue.popleft())
            self.waiting -= 1
            self.active[peer] = self.active.get(peer, 0) + 1
            if queue:
                self._queues[peer] = queue  # back of the line: the others go first
        return granted
