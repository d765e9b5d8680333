"""The sparse collective (issue 18): signed all-gather of compressed pseudo-gradients.

Sparse payloads do not sum hop by hop as the int8 ring's do (each member keeps other
entries), and at 1-3 % density they are small, so every member sends its whole contribution
to every other member and each one reduces locally:
  1. `prepare` (blocking; once per outer step): compress (pseudo-gradient + error feedback)
     into a tentative error-feedback buffer. It becomes ours only at `commit`, so a step that
     commits nothing leaves the buffer as it was.
  2. `attempt`: send the signed header and the payload fragments to every member through
     `AllReduceService.exchange` (one exchange per message, at most LANES at once); verify
     every sender's signature, header and payload (`sparsecodec.verify`: sizes before
     decoding); decode and sum in roster order (`sparsecodec.aggregate`), identical on every
     member that accepted the same senders.
  3. Commit vote: each member exchanges the digest of its result and the senders it used.
     Every used member must vote the same; a missing or different vote aborts (RoundFailed),
     and nothing is applied. Senders caught with a bad signature or payload are left out of
     the result and reported (`SparseResult.excluded`, or RoundFailed.blamed on abort); a
     sender whose contribution did not arrive is left out without blame.

Wire bytes are counted where they pass: each exchange message as the service frames it
(`control.pack` of tag, kind and data: the bytes written to each member's stream) times the
members it is sent to, and each message that actually arrived, framed the same way. libp2p's
own framing (Noise, Yamux, one stream per message) is not included.

Error feedback is per-peer state and is not in the checkpoint: a restarted peer starts with
an empty buffer (it loses what it had not sent yet, at most a few rounds' residue).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgpack
import numpy as np
import trio

from p2ptrain.kernels import sparse as SK
from p2ptrain.reduce import sparsecodec as codec
from p2ptrain.reduce.bulk import session_tag
from p2ptrain.reduce.control import pack as control_pack
from p2ptrain.reduce.service import RoundFailed

log = logging.getLogger("p2ptrain.reduce.sparse")
LANES = 32
"""Exchanges in flight at once (the service's inbox keeps 256 exchange tags)."""


@dataclass
class SparseResult:
    result: np.ndarray
    members: list[str]
    excluded: dict[str, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_recv: int = 0
    payload_bytes: int = 0
    """One contribution's compressed payload (computed: sparse.payload_nbytes)."""
    digest: str = ""


def framed_nbytes(run_id: str, tag: str, data: bytes) -> int:
    """What the service writes to a member's stream for one exchange message."""
    return len(control_pack({"tag": session_tag(run_id, tag), "kind": "data", "data": data}))


def wire_nbytes(n: int, cfg: codec.SparseConfig, world: int) -> int:
    """Bytes one member's collective writes to one other member per round, as `attempt`
    frames them (header + fragments + vote; a 64-hex run id and fresh peer ids): what the
    bench counts, and what the real-process test measures."""
    from p2ptrain.identity import Identity

    ids = [Identity.generate() for _ in range(world)]
    run, rid, payload = "0" * 64, "999999/0/sparse", b"\0" * SK.payload_nbytes(n, cfg.chunk, cfg.k)
    header = codec.sign_contribution(ids[0], run, 999999, 0, "0" * 64, n, cfg, payload)
    msgs = [header, *codec.fragments(payload)]
    vote = msgpack.packb({"digest": "0" * 64, "used": [i.peer_id_str for i in ids]}, use_bin_type=True)
    return sum(framed_nbytes(run, f"{rid}/{i}", m) for i, m in enumerate(msgs)) + framed_nbytes(run, rid, vote)


class SparseReducer:
    def __init__(self, cfg: codec.SparseConfig, n: int) -> None:
        self.cfg = cfg
        self.n = n
        self.ef = np.zeros(n, np.float32)
        self._next_ef: np.ndarray | None = None
        self.payload = b""

    def prepare(self, delta: np.ndarray) -> None:
        """Compress `delta` + error feedback (blocking: run it in a worker thread)."""
        ef = self.ef.copy()
        parts = SK.compress_ef(np.ascontiguousarray(delta, np.float32), ef, self.cfg.ef_decay, self.cfg.chunk,
                               self.cfg.k)
        self.payload, self._next_ef = SK.pack(*parts, self.n, self.cfg.chunk, self.cfg.k), ef

    def commit(self) -> None:
        if self._next_ef is not None:
            self.ef, self._next_ef = self._next_ef, None

    async def attempt(self, svc, identity, run_id: str, step: int, attempt: int, roster_hash: str,
                      roster: list[str], timeout: float, robust: bool = False) -> SparseResult:
        me = identity.peer_id_str
        rid = f"{step}/{attempt}/sparse"
        header = codec.sign_contribution(identity, run_id, step, attempt, roster_hash, self.n, self.cfg,
                                         self.payload)
        msgs = [header, *codec.fragments(self.payload)]
        others = len(roster) - 1
        got: list[dict] = [{} for _ in msgs]
        stats = SparseResult(np.empty(0, np.float32), [], payload_bytes=len(self.payload))
        limit = trio.CapacityLimiter(LANES)

        async def one(i: int) -> None:
            async with limit:
                got[i] = await svc.exchange(run_id, f"{rid}/{i}", roster, msgs[i], timeout)

        async with trio.open_nursery() as nursery:
            for i in range(len(msgs)):
                nursery.start_soon(one, i)
        for i, m in enumerate(msgs):
            stats.bytes_sent += others * framed_nbytes(run_id, f"{rid}/{i}", m)
            stats.bytes_recv += sum(framed_nbytes(run_id, f"{rid}/{i}", v)
                                    for p, v in got[i].items() if p != me and v is not None)
        mean, used, excluded, missing, digest = await trio.to_thread.run_sync(
            self._reduce, got, run_id, step, attempt, roster_hash, roster, robust)
        for peer, reason in excluded.items():
            log.warning("sparse contribution rejected: step=%d peer=%s reason=%s", step, peer, reason)
        if me not in used:
            raise RoundFailed("our own contribution was not used", excluded)
        vote = msgpack.packb({"digest": digest, "used": used}, use_bin_type=True)
        votes = await svc.exchange(run_id, f"{rid}/vote", used, vote, timeout)
        stats.bytes_sent += (len(used) - 1) * framed_nbytes(run_id, f"{rid}/vote", vote)
        stats.bytes_recv += sum(framed_nbytes(run_id, f"{rid}/vote", v) for p, v in votes.items()
                                if p != me and v is not None)
        differing = sorted(p for p in used if votes.get(p) != vote)
        if differing:
            raise RoundFailed(f"commit vote missing or different from {', '.join(differing)}"
                              + (f" (not received: {', '.join(missing)})" if missing else ""), excluded)
        stats.result, stats.members, stats.excluded, stats.digest = mean, used, excluded, digest
        return stats

    def _reduce(self, got, run_id, step, attempt, roster_hash, roster, robust):
        """Verify every member's contribution and aggregate (worker thread)."""
        decoded, excluded, missing = {}, {}, []
        for peer in roster:
            try:
                decoded[peer] = codec.verify(peer, got[0].get(peer), [g.get(peer) for g in got[1:]], run_id,
                                             step, attempt, roster_hash, self.n, self.cfg)
            except codec.BadSparse as exc:
                if exc.reason == "missing":
                    missing.append(peer)
                else:
                    excluded[peer] = exc.reason
        mean, used, outliers, digest = codec.aggregate(decoded, roster, self.n, self.cfg, robust)
        return mean, used, excluded | outliers, missing, digest
