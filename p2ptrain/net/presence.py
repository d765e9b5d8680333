"""Presence: each peer's signed "I am here, reach me at these addresses" record in the DHT.

Every peer writes its own subkey under `/p2ptrain/<namespace>/peers` and keeps it alive by
re-storing it well before it expires. A peer that dies ages out (`ttl`); one that leaves
cleanly replaces its record with a "left" one (a later expiry wins in the DHT), so readers
see it gone at once instead of up to `ttl` later (issue 33). The same record is how `status`
and later the group election see who is around.

A peer in a run also keeps a record in the lobby naming its run, so `status` without
`--run` sees the peers that train and the runs they train in.
Its codec and I/O are `p2ptrain.records` (`RunRecords.publish_presence`, `read_presence`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from p2ptrain.dht.node import DHTNode
from p2ptrain.events import EventSink
from p2ptrain.records import RunRecords, keys

log = logging.getLogger("p2ptrain.net.presence")
LOBBY = "lobby"


@dataclass
class PresenceConfig:
    namespace: str = "lobby"
    """Whose peers to meet: a run id, or 'lobby' before joining a run."""
    ttl: float = 90.0
    """Seconds a presence record lives; the DHT re-stores it while a third is left."""
    poll_interval: float = 1.0
    """Seconds between reads of everyone's presence (doubling up to poll_max while quiet)."""
    poll_max: float = 8.0
    withdraw_timeout: float = 3.0
    """Seconds a clean exit may spend storing the "left" records."""

    def __post_init__(self) -> None:
        if not self.namespace or "/" in self.namespace:
            raise ValueError("namespace must be a non-empty string without '/'")
        if self.ttl < 3 or self.poll_interval <= 0 or self.poll_max < self.poll_interval:
            raise ValueError("need ttl >= 3 and 0 < poll_interval <= poll_max")
        if self.withdraw_timeout <= 0:
            raise ValueError("withdraw_timeout must be > 0")


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
        self._withdrawn: trio.Event | None = None

    @property
    def _lobby(self) -> bool:
        """Whether we also keep a record in the lobby, naming our run."""
        return self.config.namespace != LOBBY

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._publish()
            if self._lobby:
                await RunRecords(self.dht, LOBBY).publish_presence(self.addrs, self.role, None, self.config.ttl,
                                                                   run=self.config.namespace)
            task_status.started()
            await self._watch()
        finally:
            await self.withdraw()

    async def withdraw(self) -> None:
        """Replace our records with "left" ones and stop re-storing them: a clean exit shows
        offline at once. Shielded (it runs while the node is being cancelled) and bounded by
        `withdraw_timeout`; a second call waits for the first. The node calls this before its
        host closes (`Node.on_leave`): from our own task's `finally` alone the host could
        close under the store."""
        if self._withdrawn is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(self.config.withdraw_timeout):
                await self._withdrawn.wait()
            return
        self._withdrawn = trio.Event()
        spaces = [self.config.namespace] + ([LOBBY] if self._lobby else [])
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(self.config.withdraw_timeout) as scope:
                for ns in spaces:
                    run = self.config.namespace if ns == LOBBY and self._lobby else None
                    await RunRecords(self.dht, ns).publish_presence([], self.role, None, self.config.ttl,
                                                                    run=run, left=True)
            if scope.cancelled_caught:
                log.info("presence not withdrawn within %.0fs: it ages out instead", self.config.withdraw_timeout)
        except Exception as exc:  # leaving must not fail on a network error
            log.info("presence not withdrawn (%s): it ages out instead", exc)
        finally:
            for ns in spaces:
                self.dht.forget(keys.presence(ns))
            self._withdrawn.set()

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
