"""Presence: each peer's signed "I am here, reach me at these addresses" record in the DHT.

Every peer writes its own subkey under `/p2ptrain/<namespace>/peers` and keeps it alive by
re-storing it well before it expires; peers that leave or die simply age out. The same
record is how `status` and later the group election see who is around. Its codec and I/O
are `p2ptrain.records` (`RunRecords.publish_presence`, `read_presence`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from p2ptrain.dht.node import DHTNode
from p2ptrain.events import EventSink
from p2ptrain.records import RunRecords

log = logging.getLogger("p2ptrain.net.presence")


@dataclass
class PresenceConfig:
    namespace: str = "lobby"
    """Whose peers to meet: a run id, or 'lobby' before joining a run."""
    ttl: float = 90.0
    """Seconds a presence record lives; the DHT re-stores it while a third is left."""
    poll_interval: float = 1.0
    """Seconds between reads of everyone's presence (doubling up to poll_max while quiet)."""
    poll_max: float = 8.0

    def __post_init__(self) -> None:
        if not self.namespace or "/" in self.namespace:
            raise ValueError("namespace must be a non-empty string without '/'")
        if self.ttl < 3 or self.poll_interval <= 0 or self.poll_max < self.poll_interval:
            raise ValueError("need ttl >= 3 and 0 < poll_interval <= poll_max")


class Presence:
    def __init__(self, dht: DHTNode, addrs: list[str], events: EventSink, config: PresenceConfig,
                 role: str = "peer", conns: Callable[[], dict[str, str]] | None = None) -> None:
        """`conns`, when given, is read every poll; the record is re-stored when it changed,
        so `status` can show how each peer reaches its neighbours."""
        self.dht = dht
        self.conns = conns
        self._published: dict[str, str] | None = None
        self.addrs = addrs
        self.events = events
        self.config = config
        self.role = role
        self.known: dict[str, dict] = {}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await self._publish()
        task_status.started()
        await self._watch()

    def _neighbour_conns(self) -> dict[str, str] | None:
        # Only peers of this namespace: DHT contacts come and go and would churn the record.
        return {p: k for p, k in self.conns().items() if p in self.known} if self.conns else None

    async def _publish(self) -> None:
        conns = self._neighbour_conns()
        await RunRecords(self.dht, self.config.namespace).publish_presence(self.addrs, self.role, conns,
                                                                           self.config.ttl)
        self._published = conns

    async def _watch(self) -> None:
        delay = self.config.poll_interval
        own = self.dht.identity.peer_id_str
        while True:
            peers = await RunRecords(self.dht, self.config.namespace).read_presence()
            new = [p for p in peers if p not in self.known and p != own]
            for p in new:
                self.events.emit("peer_discovered", remote=p, addrs=peers[p]["addrs"], role=peers[p]["role"])
            self.known = {p: i for p, i in peers.items() if p != own}
            delay = self.config.poll_interval if new else min(delay * 2, self.config.poll_max)
            if self.conns and self._neighbour_conns() != self._published:
                await self._publish()
            await trio.sleep(delay)
