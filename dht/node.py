"""The DHT node: Kademlia lookups, replicated multi-writer records, and their validation.

Why not py-libp2p's KadDHT: it stores one value per key (we need one entry per writer
under a key, e.g. every peer's presence under the run's key), has no bootstrap routine,
answers get_value(quorum=N) from its local cache, and measured 173 ms per put and 234 ms
per get on 10 loopback nodes (FACTS.md). This node keeps Kademlia's routing and iterative
lookups, runs over persistent libp2p streams (dht/libp2p_rpc.py) and validates every record
it stores, serves or receives (dht/record.py).
"""

from __future__ import annotations

import functools
import logging
import random

import trio

from p2ptrain.clock import wall_time
from p2ptrain.dht import protocol
from p2ptrain.dht.config import DHTConfig, DHTStats  # noqa: F401 - DHTConfig: re-exported
from p2ptrain.dht.record import (check_live, MAX_ADDRS, Record, RecordError, SignatureCache, decode, make_record,
                                 validate)
from p2ptrain.dht.routing import RoutingTable, dht_id, distance
from p2ptrain.dht.storage import RecordStore
from p2ptrain.dht.transport import RpcError, RpcReject, RpcTransport
from p2ptrain import entropy
from p2ptrain.identity import Identity, peer_id_to_str

log = logging.getLogger("p2ptrain.dht")


class DHTNode:
    def __init__(self, identity: Identity, transport: RpcTransport, config: DHTConfig | None = None,
                 server: bool = True, store_gate=None) -> None:
        self.identity, self.transport, self.config, self.server = identity, transport, config or DHTConfig(), server
        # store_gate(sender, n_records) -> bool: per-peer write limits (p2ptrain.net.peerguard).
        self.store_gate = store_gate
        self.routing = RoutingTable(identity.peer_id, self.config.bucket_size)
        self.store_ = RecordStore(limits=self.config.store_limits(), rng=entropy.rng())
        self.sigcache = SignatureCache(self.config.signature_cache)
        self.stats = DHTStats()
        # key -> (value, ttl, when to republish): own records outlive the nodes holding them.
        self._own: dict[str, tuple[bytes, float, float]] = {}
        self._rng = random.Random(identity.peer_id)
        self._limits: dict[str, tuple[float, float, int]] = {}
        self._joined = trio.Event()
        """Set by each bootstrap: `run` then fills the farther buckets."""
        if server:
            transport.serve(self._handle)

    # -- service -----------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Republish own records and keep the routing table filled until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_routing)
            task_status.started()
            while True:
                # Own records are re-stored when a third of their lifetime is left.
                await trio.sleep_until(min([d for _, _, d in self._own.values()] + [trio.current_time() + 1.0]))
                now = trio.current_time()
                for key, (value, ttl, when) in list(self._own.items()):
                    if when <= now:
                        await self._republish(key, value, ttl)

    async def _keep_routing(self) -> None:
        """After each bootstrap, one lookup into every bucket above our nearest neighbour's
        (Kademlia's join: the bootstrap's self-lookup meets only our own neighbourhood;
        `RoutingTable.stale_bucket_targets` says why the others matter); then a refresh
        every `refresh_interval`. Apart from the republishing loop, so that neither waits
        for the other's lookups, and off the bootstrap's path, which stays one lookup."""
        next_refresh = trio.current_time() + self.config.refresh_interval
        while True:
            with trio.move_on_at(next_refresh):
                await self._joined.wait()
            if self._joined.is_set():
                self._joined = trio.Event()
                await self._fill(self.routing.bucket_targets(self._rng))
            if trio.current_time() >= next_refresh:
                await self.refresh()
                next_refresh = trio.current_time() + self.config.refresh_interval

    async def _fill(self, targets: list[int]) -> None:
        async with trio.open_nursery() as nursery:
            for target in targets:
                nursery.start_soon(functools.partial(self.lookup, target, fill=True))

    async def _republish(self, key: str, value: bytes, ttl: float) -> None:
        try:
            await self.store(key, value, ttl)
        except RpcError as exc:
            log.info("republish of %s failed: %s", key, exc)

    async def refresh(self) -> None:
        """Expire old records and re-run lookups that keep the routing table current."""
        self.store_.expire(wall_time())
        targets = self.routing.stale_bucket_targets(trio.current_time(), self.config.refresh_interval, self._rng)
        await self.lookup(self.routing.local_id)
        await self._fill(targets[:8])

    async def bootstrap(self, peers: list[tuple[bytes, list[str]]]) -> int:
        """Meet the given entry points, then look ourselves up to fill the routing table
        (`run` then looks up the farther buckets). Returns how many entry points answered."""
        answered = 0
        for peer, addrs in peers:
            self.transport.learn_addrs(peer, addrs)
            try:
                await self._call(peer, "ping", {})
                answered += 1
            except RpcError as exc:
                log.info("bootstrap peer %s did not answer: %s", peer_id_to_str(peer), exc)
        if answered:
            await self.lookup(self.routing.local_id)
            self._joined.set()
        return answered

    # -- client API ------------------------------------------------------------------
    async def store(self, key: str, value: bytes, ttl: float) -> int:
        """Sign and store our entry under `key` on the closest nodes; returns replicas acked.
        `run` re-stores it while a third of its lifetime is left, until `forget(key)`, so it
        outlives the nodes that hold it now. A `ttl` beyond the key's horizon is cut to it
        (every node would refuse the record)."""
        ttl = min(ttl, self.config.limits_for(key)[0])
        rec = make_record(self.identity, key, value, wall_time() + ttl)
        self._own[key] = (value, ttl, trio.current_time() + ttl * 2 / 3)
        return await self.store_record(rec)

    def forget(self, key: str) -> None:
        self._own.pop(key, None)

    async def store_record(self, rec: Record) -> int:
        """Store an already-signed record (ours, or one we relay) on the closest nodes."""
        if self.server:
            self._accept(rec, self.identity.peer_id)
        target = dht_id(rec.key)
        encoded = rec.encode()
        acked, tried = set(), set()

        async def one(peer: bytes) -> None:
            tried.add(peer)
            try:
                reply = await self._call(peer, "store", {"records": [encoded]})
            except RpcError:
                return
            if reply.get("results") == ["ok"]:
                acked.add(peer)

        # Store on the closest peers we already know while the lookup runs: in a settled
        # swarm they are the right ones and the store costs one round trip, not two.
        with trio.move_on_after(self.config.lookup_timeout):
            async with trio.open_nursery() as nursery:
                for peer in self.routing.closest(target, self.config.replication):
                    nursery.start_soon(one, peer)
                closest = await self.lookup(target)
                for peer in closest[: self.config.replication]:
                    if peer not in tried:
                        nursery.start_soon(one, peer)
        return len(acked)

    async def get(self, key: str, quorum: int | None = None) -> dict[bytes, Record]:
        """Every writer's live, verified entry under `key` (subkey -> record).

        By default the `replication` nearest live nodes must all answer, because different
        replicas may hold different writers' entries. With `quorum`, the read returns as soon
        as that many nodes holding entries have answered (our own store counts): faster, at
        the price of possibly missing a writer whose store reached few replicas. Elections
        read in full; status-style reads may use a quorum."""
        found: dict[bytes, Record] = {}
        holders = 0
        if self.server:
            for rec in self.store_.get(key, wall_time()):
                found[rec.subkey] = rec
            holders = 1 if found else 0
        if quorum is not None and holders >= quorum:
            return found
        await self.lookup(dht_id(key), key=key, found=found,
                          quorum=None if quorum is None else quorum - holders)
        return found

    async def lookup(self, target: int, key: str | None = None,
                     found: dict[bytes, Record] | None = None, quorum: int | None = None,
                     fill: bool = False) -> list[bytes]:
        """Iterative Kademlia lookup; returns the closest answering peers, nearest first.

        With `key`, asks for records too and merges every valid entry into `found`; it
        keeps going until the `replication` nearest live nodes have all answered, or, with
        `quorum`, until that many answered with entries. `fill` (refreshing a bucket of
        ours, `target` inside it): go on past that rule until a peer inside the bucket
        answered, at most `bucket_size` queries more. A cluster of nodes that knows nobody
        in a range of the id space also finds nobody there by the rule alone: its own
        members are the nearest candidates and none of them knows better, so the lookup
        stops among them while farther peers it knows do (issue 30: at 128 simulated peers
        started at once, 17 of them never saw the 18 nodes nearest a key)."""
        cfg = self.config
        bucket = self.routing.bucket_of(target) if fill else None
        budget = cfg.bucket_size
        holders = 0
        queried: set[bytes] = set()
        answered: list[bytes] = []
        candidates = set(self.routing.closest(target, cfg.bucket_size))
        method = "get" if key is not None else "find"
        body = {"key": key} if key is not None else {"target": target.to_bytes(32, "big")}

        def nearest_pending() -> list[bytes]:
            ranked = sorted(candidates - queried, key=lambda p: distance(dht_id(p), target))
            return ranked

        def done() -> bool:
            best = sorted(answered, key=lambda p: distance(dht_id(p), target))[: cfg.replication]
            pending = nearest_pending()
            if not pending:
                return True
            if len(best) < cfg.replication:
                return False
            # Stop when no unqueried candidate is closer than our k-th best answer.
            if distance(dht_id(pending[0]), target) <= distance(dht_id(best[-1]), target):
                return False
            nonlocal budget
            if bucket is None or any(self.routing.bucket_of(dht_id(p)) == bucket for p in answered):
                return True
            budget -= 1
            return budget < 0

        async def query(peer: bytes) -> None:
            try:
                reply = await self._call(peer, method, body)
            except RpcError:
                return
            answered.append(peer)
            for pid, addrs in protocol.decode_peers(reply.get("peers")):
                if pid != self.identity.peer_id and pid not in queried:
                    self.transport.learn_addrs(pid, addrs)
                    candidates.add(pid)
            if key is not None and found is not None:
                nonlocal holders
                self._merge_records(reply.get("records"), key, peer, found)
                holders += bool(reply.get("records"))
                if quorum is not None and holders >= quorum:
                    scope.cancel()

        with trio.move_on_after(cfg.lookup_timeout) as scope:
            while not done():
                batch = nearest_pending()[: cfg.alpha if answered else cfg.replication]
                queried.update(batch)
                async with trio.open_nursery() as nursery:
                    for peer in batch:
                        nursery.start_soon(query, peer)
        return sorted(answered, key=lambda p: distance(dht_id(p), target))

    # -- internals -------------------------------------------------------------------
    async def _call(self, peer: bytes, method: str, body: dict) -> dict:
        body = dict(body, srv=self.server, addrs=self.transport.local_addrs() if self.server else [])
        self.stats.rpcs += 1
        try:
            reply = await self.transport.call(peer, method, body, self.config.rpc_timeout)
        except RpcError:
            self.routing.failed(peer)
            raise
        self.routing.seen(peer, trio.current_time())
        return reply

    def _merge_records(self, raw: object, key: str, source: bytes, found: dict[bytes, Record]) -> None:
        if not isinstance(raw, list):
            return
        now = wall_time()
        for item in raw[: self.config.max_records_per_get]:
            try:
                if not isinstance(item, bytes):
                    raise RecordError("malformed", "record is not bytes")
                rec = self.sigcache.decoded(item)
                if rec is None:
                    rec = self._validate(decode(item), now)
                    self.sigcache.remember(item, rec)
                else:
                    check_live(rec, now, *self._live_limits(rec.key))
                if rec.key != key:
                    raise RecordError("wrong-key", f"asked for {key}, got {rec.key}")
            except RecordError as exc:
                self._log_reject(exc, source, "received")
                continue
            old = found.get(rec.subkey)
            if old is None or rec.newer_than(old):
                found[rec.subkey] = rec

    def _log_reject(self, exc: RecordError, source: bytes, where: str) -> None:
        self.stats.reject(exc.reason)
        log.warning("record rejected: reason=%s %s from=%s detail=%s",
                    exc.reason, where, peer_id_to_str(source), exc.detail)

    def _live_limits(self, key: str) -> tuple[float, float, int]:
        # Memoized per key (a node never changes its config): every merged record asks (issue 30).
        if (got := self._limits.get(key)) is None:
            self._limits = {} if len(self._limits) > 1024 else self._limits
            got = self._limits[key] = (*self.config.limits_for(key), self.config.max_clock_skew)
        return got[0], got[2], got[1]

    def _validate(self, rec: Record, now: float) -> Record:
        max_ttl, max_bytes = self.config.limits_for(rec.key)
        return validate(rec, now, max_ttl, self.config.max_clock_skew, max_bytes, self.sigcache)

    def _accept(self, rec: Record, source: bytes) -> None:
        """Our own store of a record we store or relay: invalid ones raise (a caller's
        mistake); a full budget here is logged, and the replicas still get it."""
        self._validate(rec, wall_time())
        try:
            self.store_.put(rec, wall_time(), sender=source)
        except RecordError as exc:
            self._log_reject(exc, source, "local store")

    def _closer_peers(self, target: int, exclude: bytes) -> list[list]:
        peers = self.routing.closest(target, self.config.bucket_size, frozenset({exclude}))
        return protocol.encode_peers([(p, self.transport.addrs_of(p)) for p in peers])

    async def _handle(self, sender: bytes, method: str, body: dict) -> dict:
        if body.get("srv") is True:
            addrs = body.get("addrs")
            if isinstance(addrs, list):
                self.transport.learn_addrs(sender, [a for a in addrs[:MAX_ADDRS] if isinstance(a, str)])
            self.routing.seen(sender, trio.current_time())
        if method == "ping":
            return {}
        if method == "find":
            target = body.get("target")
            if not (isinstance(target, bytes) and len(target) == 32):
                raise RpcReject("bad-target")
            return {"peers": self._closer_peers(int.from_bytes(target, "big"), sender)}
        if method == "get":
            key = body.get("key")
            if not isinstance(key, str):
                raise RpcReject("bad-key")
            # Stored records were verified on the way in, and `select` serves only live ones
            # in an order no writer can game (see `RecordStore.select`). The salt is fresh
            # per request: a key too big for one reply shows each reader another sample.
            chosen = self.store_.select(key, wall_time(), self.config.max_records_per_get,
                                        self.config.max_reply_bytes, entropy.source.randbytes(16))
            return {"records": [rec.encode() for rec in chosen],
                    "peers": self._closer_peers(dht_id(key), sender)}
        if method == "store":
            raw = body.get("records")
            if not isinstance(raw, list) or len(raw) > 16:
                raise RpcReject("bad-records")
            if self.store_gate is not None and not self.store_gate(sender, len(raw)):
                self.stats.reject("rate-limited")
                raise RpcReject("rate-limited")
            results = []
            for item in raw:
                try:
                    if not isinstance(item, bytes):
                        raise RecordError("malformed", "record is not bytes")
                    rec = self._validate(decode(item), wall_time())
                    self.store_.put(rec, wall_time(), sender=sender)
                    results.append("ok")
                except RecordError as exc:
                    self._log_reject(exc, sender, "store")
                    results.append(exc.reason)
            return {"results": results}
        raise RpcReject("unknown-method")
