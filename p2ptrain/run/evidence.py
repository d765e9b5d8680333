"""Evidence for the loss gate's attribution (rule L2, `p2ptrain.run.lossgate`).

L1's aggregate says whether a round's mean lowers the loss, not whose work does. While any
member gates (its roster confirmation says so), each member signs in its header the BLAKE3
of its whole contribution (`Header.evidence`) and serves those bytes for the step through
its blob server (`BlobEvidence`). A gating member fetches, beside the data plane, the
evidence of every member it has no standing with that trained (`fetch_all`). Before it
signs, it checks each piece against the signed digest, size and norm and scores it alone on
the round's batch, and a piece that fails there on `GateConfig.confirm` further batches
(`judge_all`): the refusal names whose work failed, and the next attempt leaves them out.
(In a merge round, only when the mean fails: `lossgate.make_gate`.)

Cost, per member that gates: one fp32 copy of each unvetted member's contribution (4 bytes a
parameter) and one forward pass each, every round it gates (1 + `confirm` for a piece that
fails on the round's batch).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Protocol

import numpy as np
import trio
from blake3 import blake3

from p2ptrain.ckpt.fetch import FetchError, request
from p2ptrain.identity import peer_id_from_str
from p2ptrain.run.contribution import Header
from p2ptrain.run.lossgate import judge_piece

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


def suspects(ok: dict[str, Header], me: str, trusted: frozenset[str]) -> list[str]:
    """Whose work L2 scores alone: members that trained and that we have no standing with."""
    return sorted(p for p, h in ok.items() if p != me and p not in trusted and h.norm > 0)


async def fetch_all(evidence: Evidence, ok: dict[str, Header], who: list[str], n: int,
                    timeout: float) -> dict[str, bytes | None]:
    """Each member's served evidence, fetched at once (None: not served in time)."""
    got: dict[str, bytes | None] = {p: None for p in who}

    async def one(peer: str) -> None:
        if ok[peer].evidence:
            got[peer] = await evidence.fetch(peer, ok[peer].evidence, 4 * n, timeout)

    with trio.move_on_after(timeout + 1.0):
        async with trio.open_nursery() as nursery:
            for p in who:
                nursery.start_soon(one, p)
    return got


def judge_all(score_piece, ok: dict[str, Header], fetched: dict[str, bytes | None], seed: bytes, n: int,
              base_state: bytes | None = None, confirm: int = 0) -> tuple[set[str], dict[str, str]]:
    """(members kept, member -> why not) among `fetched`'s (blocking: forward passes).
    `score_piece(vec, seed, base_state) -> (before, after)`: the scorer's `piece` (rule L2b:
    from the round's starting state, without momentum). A piece
    is kept unless its evidence alone raises the loss (beyond `lossgate.CONVICT_MARGIN`) on
    the round's batch (`seed`) and on each of `confirm` further batches drawn from it (one
    batch is noisy: an honest piece may rise on one). Why not: 'no-evidence',
    'evidence-mismatch', 'evidence-norm' or 'loss-rose' (`lossgate.judge_evidence`)."""
    kept, why = set(), {}
    for peer in sorted(fetched):
        vec = check(fetched[peer], ok[peer], n)
        if isinstance(vec, str):
            why[peer] = vec
            continue
        reason, scores = judge_piece(lambda sd: score_piece(vec, sd, base_state), seed, confirm)
        if reason is None:
            kept.add(peer)
        else:
            why[peer] = reason
        log.info("evidence of %s alone: %s: %s", peer, ", ".join(f"{b:.4f} -> {a:.4f}" for b, a in scores),
                 reason or "kept")
    return kept, why


class Pieces:
    """L2 for one gated attempt: `fetch` (a trio task, once the headers are verified) fetches
    the unvetted members' evidence beside the data plane; calling it with the round's seed
    (the gate, in the service's worker thread, before we sign) judges each piece alone and
    returns {member: why not} (empty: every piece lowers the loss alone). Without an evidence
    source there is nothing to judge (the mean is still gated). `wait`: every gating member
    fetches model-sized pieces at once, so more than an exchange's time, but within what a
    neighbour's vote gather waits for our vote (the gate runs before we vote)."""

    def __init__(self, evidence: Evidence | None, scorer, me: str, trusted: frozenset[str], n: int, got: dict,
                 wait: float, confirm: int = 0) -> None:
        self.evidence, self.scorer, self.me, self.trusted, self.n = evidence, scorer, me, trusted, n
        self.got, self.wait, self.confirm = got, wait, confirm
        self.done = threading.Event()

    async def fetch(self) -> None:
        try:
            if self.evidence is not None:
                ok = self.got["ok"]
                self.got["fetched"] = await fetch_all(self.evidence, ok, suspects(ok, self.me, self.trusted),
                                                      self.n, self.wait)
        finally:
            self.done.set()

    def __call__(self, seed: bytes) -> dict[str, str]:
        if self.evidence is None:
            return {}
        if not self.done.wait(self.wait + 2.0):  # fails closed: nothing judged, nothing signed
            return {"?": "no-evidence"}
        got = self.got
        got["kept"], got["why"] = judge_all(self.scorer.piece, got.get("ok") or {}, got.get("fetched") or {}, seed,
                                            self.n, got.get("base_state"), self.confirm)
        return got["why"]
