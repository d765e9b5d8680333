"""Presence: each peer's signed "I am here, reach me at these addresses" record in the DHT.

Every peer writes its own subkey under `/p2ptrain/<namespace>/peers` and keeps it alive by
re-storing it well before it expires. A peer that dies ages out (`ttl`); one that leaves
cleanly replaces its record with a "left" one (a later expiry wins in the DHT), so readers
see it gone at once instead of up to `ttl` later (issue 33). The same record is how `status`
and later the group election see who is around.

A peer in a run also keeps a record in the lobby naming its run, so `status` without
`--run` sees the peers that train and the runs they train in.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import trio

from p2ptrain.dht.node import DHTNode
from p2ptrain.events import EventSink
from p2ptrain.identity import peer_id_to_str
from p2ptrain.run import keys

log = logging.getLogger("p2ptrain.net.presence")
MAX_PRESENCE_BYTES = 4096
MAX_CONNS = 32  # neighbours listed in a record: keeps it well under MAX_PRESENCE_BYTES
CONN_KINDS = ("direct", "hole-punched", "relayed")
LOBBY = "lobby"
_RUN_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")


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


def encode_presence(addrs: list[str], role: str, conns: dict[str, str] | None = None, run: str | None = None,
                    left: bool = False) -> bytes:
    """`conns`: neighbour peer id -> connection kind (p2ptrain.net.nat.connection_kinds);
    `run`: the run a lobby record's peer trains in; `left`: the peer left cleanly."""
    obj: dict = {"addrs": [] if left else addrs[:keys.MAX_ADDRS], "role": role}
    if conns and not left:
        obj["conns"] = dict(sorted(conns.items())[:MAX_CONNS])
    if run:
        obj["run"] = run
    if left:
        obj["left"] = True
    return msgpack.packb(obj, use_bin_type=True)


def decode_presence(value: bytes) -> dict | None:
    if len(value) > MAX_PRESENCE_BYTES:
        return None
    try:
        obj = msgpack.unpackb(value, raw=False, max_array_len=keys.MAX_ADDRS, max_map_len=MAX_CONNS, max_str_len=512)
    except Exception:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("addrs"), list):
        return None
    role, conns = obj.get("role", ""), obj.get("conns", {})
    if not isinstance(role, str) or not isinstance(conns, dict):  # str() made a role of anything
        return None
    run, left = obj.get("run"), obj.get("left", False)
    if run is not None and not (isinstance(run, str) and _RUN_RE.fullmatch(run)):  # `status` prints it
        return None
    if not isinstance(left, bool):
        return None
    return {"addrs": [a for a in obj["addrs"] if isinstance(a, str)], "role": role,
            "conns": {k: v for k, v in conns.items() if isinstance(k, str) and v in CONN_KINDS},
            "run": run, "left": left}


async def read_peers(dht: DHTNode, namespace: str) -> dict[str, dict]:
    """peer id (str) -> {"addrs", "role", "conns", "run"} for every live, verified presence
    record of a peer that has not left."""
    out = {}
    for subkey, rec in (await dht.get(keys.presence(namespace))).items():
        info = decode_presence(rec.value)
        if info is None:
            log.warning("presence of %s dropped: malformed value", peer_id_to_str(subkey))
            continue
        if not info.pop("left"):
            out[peer_id_to_str(subkey)] = info
    return out


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
                await self.dht.store(keys.presence(LOBBY), encode_presence(self.addrs, self.role,
                                                                           run=self.config.namespace), self.config.ttl)
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
                    await self.dht.store(keys.presence(ns), encode_presence([], self.role, run=run, left=True),
                                         self.config.ttl)
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
        await self.dht.store(keys.presence(self.config.namespace), encode_presence(self.addrs, self.role, conns),
                             self.config.ttl)
        self._published = conns

    async def _watch(self) -> None:
        delay = self.config.poll_interval
        own = self.dht.identity.peer_id_str
        while True:
            peers = await read_peers(self.dht, self.config.namespace)
            new = [p for p in peers if p not in self.known and p != own]
            for p in new:
                self.events.emit("peer_discovered", remote=p, addrs=peers[p]["addrs"], role=peers[p]["role"])
            self.known = {p: i for p, i in peers.items() if p != own}
            delay = self.config.poll_interval if new else min(delay * 2, self.config.poll_max)
            if self.conns and self._neighbour_conns() != self._published:
                await self._publish()
            await trio.sleep(delay)
