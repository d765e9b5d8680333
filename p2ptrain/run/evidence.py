"""Evidence for the loss gate's attribution (rule L2, `p2ptrain.run.lossgate`).

A round the gate refused (L1) says that its mean raised the loss, not who pushed it. Each
member whose roster held someone it has no standing with signed, in its header, the BLAKE3
of its whole contribution (`Header.evidence`) and serves those bytes for the step through
its blob server (`BlobEvidence`). A member that refused fetches the evidence of every member
it has no standing with that trained, checks it against the signed digest, size and norm,
and scores each alone on the refused round's batch (`attribute`). Its next attempt keeps
only the members whose evidence alone lowers the loss: attribution chooses whom to try with,
and never admits anything, since that attempt is gated again (L1).

Cost: one fp32 copy of each such member's contribution per member that refused, and one
forward pass each; only after a refusal.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

import numpy as np
import trio
from blake3 import blake3

from p2ptrain.ckpt.fetch import FetchError, request
from p2ptrain.identity import peer_id_from_str
from p2ptrain.run.contribution import Header
from p2ptrain.run.lossgate import judge_evidence

log = logging.getLogger("p2ptrain.run.evidence")


def as_f32(delta: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(delta, dtype="<f4").reshape(-1)


def digest(delta: np.ndarray) -> str:
    """What a header signs of its contribution (blocking: hashes 4 bytes a parameter)."""
    return blake3(memoryview(as_f32(delta)).cast("B")).hexdigest()


class Evidence(Protocol):
    """Where a member's evidence is served from and fetched (tests: an in-memory hub)."""

    def publish(self, key: str, data: np.ndarray) -> None: ...

    def withdraw(self, key: str) -> None: ...

    async def fetch(self, peer: str, key: str, nbytes: int, timeout: float) -> bytes | None: ...


class BlobEvidence:
    """Evidence served and fetched as blobs (`p2ptrain.ckpt.fetch`: per-identity serving
    slots, a size limit before reading, a first-byte deadline)."""

    def __init__(self, blobs) -> None:
        self.blobs, self.host = blobs, blobs.host

    def publish(self, key: str, data: np.ndarray) -> None:
        self.blobs.add_known(key, memoryview(as_f32(data)).cast("B"))

    def withdraw(self, key: str) -> None:
        self.blobs.remove(key)

    async def fetch(self, peer: str, key: str, nbytes: int, timeout: float) -> bytes | None:
        try:
            return await request(self.host, peer_id_from_str(peer), key, nbytes, timeout,
                                 first_byte=min(timeout, 10.0))
        except (FetchError, ValueError) as exc:
            log.info("evidence %s from %s: %s", key[:12], peer, exc)
            return None


def check(data: bytes | None, h: Header, n: int) -> np.ndarray | str:
    """The contribution `data` holds if it is the one `h` signed: its digest, its size and
    its norm (the norm every bound and the frames were held to); else why not."""
    if data is None:
        return "no-evidence"
    if len(data) != 4 * n or blake3(data).hexdigest() != h.evidence:
        return "evidence-mismatch"
    vec = np.frombuffer(data, dtype="<f4")
    sq = float(np.dot(vec.astype(np.float64), vec.astype(np.float64)))
    if not math.isfinite(sq) or abs(math.sqrt(sq) - h.norm) > 1e-3 * max(h.norm, 1e-12) + 1e-6:
        return "evidence-norm"
    return vec


async def attribute(evidence: Evidence, scorer, ok: dict[str, Header], seed: bytes, me: str,
                    trusted: frozenset[str], n: int, timeout: float,
                    base_state: bytes | None = None) -> tuple[set[str], dict[str, str]]:
    """(members kept, member -> why not) among those without our standing that trained: kept
    when its evidence alone lowers the loss on the refused round's batch (`seed`); why not:
    'no-evidence', 'evidence-mismatch', 'evidence-norm', 'loss-flat' or 'loss-rose' (the
    one conviction: `lossgate.judge_evidence`)."""
    suspects = sorted(p for p, h in ok.items() if p != me and p not in trusted and h.norm > 0)
    got: dict[str, bytes | None] = {}

    async def one(peer: str) -> None:
        got[peer] = await evidence.fetch(peer, ok[peer].evidence, 4 * n, timeout) if ok[peer].evidence else None

    with trio.move_on_after(timeout + 1.0):
        async with trio.open_nursery() as nursery:
            for p in suspects:
                nursery.start_soon(one, p)
    kept, why = set(), {}
    for peer in suspects:
        vec = check(got.get(peer), ok[peer], n)
        if isinstance(vec, str):
            why[peer] = vec
            continue
        before, after = await trio.to_thread.run_sync(scorer, vec, seed, base_state)
        reason = judge_evidence(before, after)
        if reason is None:
            kept.add(peer)
        else:
            why[peer] = reason
        log.info("evidence of %s alone: %.4f -> %.4f: %s", peer, before, after, reason or "kept")
    return kept, why
