"""A run's DHT records behind one typed object: `RunRecords(dht, run_id)`.

Each record type has a typed publish and read method here; the keys are
`p2ptrain.records.keys`, the value codecs `p2ptrain.records.codecs` and
`p2ptrain.records.manifest`. Every read decodes each writer's entry once, drops a malformed one
with a logged reason (the codec's `RecordError`) and never raises for one peer's bad record;
addresses a record carries go to the DHT's address book, so the peer can be dialled.

The rules that use these records stay with their owners: the election (`p2ptrain.run.elect`
times ready records by its own sightings, `p2ptrain.run.states` picks the run's state), the checkpoint quorum
(`p2ptrain.ckpt.providers`), the reputation verdict (`p2ptrain.run.reputation`). This layer
imports only the DHT's record layer and pure codecs -- neither trio, libp2p, torch, numba nor
the all-reduce (the DHT node is passed in) -- so `net/`, `ckpt/`, `run/`, `train/`, `p2ptrain status` and the dashboard
all read records through it without importing each other. `dht` is anything with the
DHT node's `store(key, value, ttl)`, `get(key)` and `transport.learn_addrs`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from p2ptrain.identity import peer_id_to_str
from p2ptrain.records import codecs, keys
from p2ptrain.records import manifest as mf
from p2ptrain.records.codecs import DataRecord, Provider, Ready, RecordError, State

log = logging.getLogger("p2ptrain.records")
DECODED_CACHE = 1 << 16
_decoded: OrderedDict[tuple[bytes, str], object] = OrderedDict()
"""(record signature, record type) -> the decoded value (least recently stored out)."""

STATE_TTL = 600.0
PROVIDER_TTL = 600.0
REPUTATION_TTL = 3600.0
DATA_TTL = 3600.0
MANIFEST_TTL = 3600.0


class RunRecords:
    """The records of run `run_id` (or, for presence only, of the namespace 'lobby')."""

    def __init__(self, dht, run_id: str) -> None:
        self.dht = dht
        self.run_id = run_id

    async def _read(self, key: str, decode, what: str, cache: bool = False) -> list[tuple[bytes, object, float]]:
        """(writer's peer id, decoded value, signed expiry) of every entry that decodes;
        `cache` for decoders that return immutable values."""
        out = []
        for sub, rec in (await self.dht.get(key)).items():
            # Decoded once per record: a reader polls the same records every 0.2-1 s (2.9 M
            # decodes in 30 simulated seconds of 1,000 peers, issue 30). The signature, which
            # the DHT verified, binds the key, writer and value; decoders are pure.
            tag = (rec.signature, what)
            got = _decoded.get(tag) if cache else None
            if got is None:
                try:
                    got = decode(sub, rec.value)
                except RecordError as exc:
                    log.info("%s record of %s dropped: %s", what, peer_id_to_str(sub), exc)
                    continue
                if cache:
                    _decoded[tag] = got
                    if len(_decoded) > DECODED_CACHE:
                        _decoded.popitem(last=False)
            out.append((sub, got, rec.expiry))
        return out

    def _learn(self, sub: bytes, addrs) -> None:
        self.dht.transport.learn_addrs(sub, list(addrs))

    # -- ready/<t> ------------------------------------------------------------------------
    async def publish_ready(self, step: int, ready_at: float, addrs: list[str], joining: bool, ttl: float,
                            level: int = 0, cell: int = 0, tries: int = 0, boot: str = "") -> int:
        """Store our ready record for `step` in one cell (its TTL: `p2ptrain.run.election.ready_ttl`;
        a writer stores it in every level's cell: `p2ptrain.run.elect.publish_ready`)."""
        return await self.dht.store(keys.ready(self.run_id, step, level, cell),
                                    codecs.encode_ready(ready_at, addrs, joining, tries, boot), ttl=ttl)

    async def read_ready(self, step: int, level: int = 0, cell: int = 0) -> list[tuple[Ready, float]]:
        """Every writer's ready record for `step` in one cell, with its signed expiry, as
        written (`p2ptrain.run.elect.read_ready` times them by the reader's sightings)."""
        got = await self._read(keys.ready(self.run_id, step, level, cell),
                               lambda sub, v: codecs.decode_ready(peer_id_to_str(sub), v), "ready", cache=True)
        return [(r, expiry) for _, r, expiry in got]

    # -- state ----------------------------------------------------------------------------
    async def publish_state(self, state: State, ttl: float = STATE_TTL, step: int | None = None,
                            level: int = 0, cell: int = 0) -> int:
        """Our state under the run's `state` key, or with `step` under one cell of that step
        (`keys.state`; which cells: `p2ptrain.run.elect.publish_state`)."""
        return await self.dht.store(keys.state(self.run_id, step, level, cell), codecs.encode_state(state), ttl=ttl)

    async def read_states(self, step: int | None = None, level: int = 0, cell: int = 0) -> list[tuple[bytes, State]]:
        """Every peer's published state (with `step`: those filed under that cell of the
        step): (peer id bytes, state)."""
        out = []
        for sub, st, _ in await self._read(keys.state(self.run_id, step, level, cell),
                                           lambda _, v: codecs.decode_state(v), "state", cache=True):
            self._learn(sub, st.addrs)
            out.append((sub, st))
        return out

    async def state_view(self) -> dict[str, dict]:
        """peer id -> its published state as a dict (what `status` and the dashboard show)."""
        return {peer_id_to_str(sub): st.to_dict() for sub, st in await self.read_states()}

    # -- providers ------------------------------------------------------------------------
    async def publish_provider(self, step: int, manifest: str, sha256: str, params: str, members: list[str],
                               addrs: list[str], ttl: float = PROVIDER_TTL, by_state: bool = False) -> int:
        """Under the run's `providers` key, or with `by_state` under the state's own
        (`keys.providers`; the writer stores both: `p2ptrain.ckpt.download.CheckpointServer.publish`)."""
        value = codecs.encode_provider(step, manifest, sha256, params, members, addrs)
        key = keys.providers(self.run_id, step, params) if by_state else keys.providers(self.run_id)
        return await self.dht.store(key, value, ttl=ttl)

    async def read_providers(self, step: int | None = None, params: str | None = None) -> list[Provider]:
        """Every member's provider record, or with `step` and `params` those of one state."""
        out = []
        for sub, p, _ in await self._read(keys.providers(self.run_id, step, params),
                                          lambda sub, v: codecs.decode_provider(peer_id_to_str(sub), v), "provider",
                                          cache=True):
            self._learn(sub, p.addrs)
            out.append(p)
        return out

    # -- reputation -----------------------------------------------------------------------
    async def publish_reputation(self, flagged: dict[str, int], ttl: float = REPUTATION_TTL) -> int:
        """Store our report (signed by the DHT with our key); returns the replicas that acked."""
        return await self.dht.store(keys.reputation(self.run_id), codecs.encode_report(flagged), ttl=ttl)

    async def read_reputation(self) -> dict[str, dict[str, int]]:
        """Every reporter's entry: {reporter: {peer: step}}."""
        got = await self._read(keys.reputation(self.run_id), lambda _, v: codecs.decode_report(v), "reputation")
        return {peer_id_to_str(sub): flagged for sub, flagged, _ in got}

    # -- data -----------------------------------------------------------------------------
    async def publish_data(self, rec: DataRecord, ttl: float = DATA_TTL) -> int:
        return await self.dht.store(keys.data(self.run_id), codecs.encode_data(rec), ttl=ttl)

    async def read_data(self) -> list[tuple[bytes, DataRecord]]:
        out = []
        for sub, d, _ in await self._read(keys.data(self.run_id), lambda _, v: codecs.decode_data(v), "data"):
            self._learn(sub, d.addrs)
            out.append((sub, d))
        return out

    # -- manifest -------------------------------------------------------------------------
    async def publish_manifest(self, manifest: dict, ttl: float = MANIFEST_TTL) -> int:
        return await self.dht.store(keys.manifest(self.run_id), mf.encode(manifest), ttl=ttl)

    async def read_manifest(self) -> tuple[dict | None, int]:
        """(the run's manifest, checked against the run id: any peer may serve it, or None;
        how many copies the DHT returned, valid or not)."""
        got = await self.dht.get(keys.manifest(self.run_id))
        for sub, rec in got.items():
            try:
                m = mf.decode(rec.value)
                mf.verify_manifest(m, self.run_id)
                return m, len(got)
            except RecordError as exc:
                log.warning("manifest from %s rejected: %s", peer_id_to_str(sub), exc)
        return None, len(got)

    # -- peers (presence) -----------------------------------------------------------------
    async def publish_presence(self, addrs: list[str], role: str, conns: dict[str, str] | None,
                               ttl: float, run: str | None = None, left: bool = False) -> int:
        """`run`: in the lobby, the run we train in; `left`: we left cleanly (replaces our
        record, so readers see us gone at once instead of when it expires)."""
        return await self.dht.store(keys.presence(self.run_id),
                                    codecs.encode_presence(addrs, role, conns, run=run, left=left), ttl)

    async def read_presence(self) -> dict[str, dict]:
        """peer id (str) -> {"addrs", "role", "conns", "run"} for every live, verified presence
        record of a peer that has not left."""
        got = await self._read(keys.presence(self.run_id), lambda _, v: codecs.decode_presence(v), "presence")
        return {peer_id_to_str(sub): info for sub, info, _ in got if not info.pop("left")}
