"""An all-reduce round as training runs it, for benches and tests: each member signs a
contribution header (its norm per chunk and the SHA-256 of every frame it sends first),
the members exchange headers (`AllReduceService.exchange`) and check them
(`verify_headers`), and the data plane holds every frame to them (`FrameChecker`, passed as
`check=`, with `own=` the signed payloads), as `p2ptrain.train.trainer` does; the header
exchange runs beside the data plane, whose checks wait for it (`HeldChecker`).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import trio

from p2ptrain.reduce import ring
from p2ptrain.reduce.service import AllReduceService, RoundFailed, RoundResult
from p2ptrain.run.contribution import Header, HeldChecker, sign_header, sumsq64, verify_headers


async def verified_allreduce(svc: AllReduceService, vec: np.ndarray, run: str, rid: str, members: list[str],
                             timeout: float = 30.0, out: np.ndarray | None = None) -> RoundResult:
    """Average `vec` with `members` on the verified path. Raises RoundFailed."""
    me = svc.identity.peer_id_str
    cfg = ring.RingConfig(svc.config.mode, sub_chunk_bytes=svc.config.sub_chunk_bytes)
    rank, world = members.index(me), len(members)
    roster = hashlib.sha256("\n".join([run, rid, *members]).encode()).hexdigest()
    lay = ring.layout(vec.size, world, cfg)

    def prepare() -> tuple[list, bytes]:  # quantizing and hashing: off the trio loop
        own = ring.own_payloads(vec, rank, world, cfg)
        digests = tuple(hashlib.sha256(p).hexdigest() for p in own)
        # Not np.linalg.norm: its BLAS dot spins OpenBLAS threads (see contribution.sumsq64).
        norms = tuple(math.sqrt(sumsq64(vec[subs[0][0]:subs[-1][1]])) for subs in lay)
        header = Header(run, 0, 0, roster, me, norms, digests, math.sqrt(math.fsum(n * n for n in norms)), 1, 0)
        return own, sign_header(header, svc.identity)

    t0 = trio.current_time()
    own, signed = await trio.to_thread.run_sync(prepare)
    t1 = trio.current_time()
    # As training does (`ContributionRound._attempt`): the data plane starts at once and
    # each frame's check waits for the verified headers.
    held = HeldChecker(timeout + 1.0)
    got: dict = {}

    async def headers() -> None:
        try:
            raw = await svc.exchange(run, rid + "/hdr", members, signed, timeout)
            got["ok"], got["bad"] = verify_headers(raw, run, 0, 0, roster, members, {}, norm_factor=10.0)
        finally:
            got["t"] = trio.current_time()
            held.settle_verified(got.get("ok"), got.get("bad"), members, rank, [len(s) for s in lay])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(headers)
        try:
            res = await svc.allreduce(vec, run, rid, members, own=own, check=held.check, out=out)
        except RoundFailed:
            if got.get("bad"):
                raise RoundFailed(f"contribution headers rejected: {got['bad']}", got["bad"]) from None
            raise
    res.phases.update({"sign": round(t1 - t0, 4), "exchange": round(got["t"] - t1, 4)})
    res.seconds += t1 - t0
    return res
