"""An all-reduce round as training runs it, for benches and tests: each member signs a
contribution header (its norm per chunk and the BLAKE3 of every frame it sends first),
the members exchange headers (`AllReduceService.exchange`) and check them
(`verify_headers`), and the data plane holds every frame to them (`FrameChecker`, passed as
`check=`), as `p2ptrain.train.trainer` does; hashing our frames as the ring encodes them,
signing and the header exchange run beside the data plane, whose checks wait for them
(`OwnDigests`, `HeldChecker`).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import trio

from p2ptrain.reduce import ring, roundtrace
from p2ptrain.reduce.service import AllReduceService, RoundFailed, RoundResult
from p2ptrain.run.contribution import Header, HeldChecker, NotEncoded, OwnDigests, sign_header, streamed_material
from p2ptrain.run.influence import verify_headers


async def verified_allreduce(svc: AllReduceService, vec: np.ndarray, run: str, rid: str, members: list[str],
                             timeout: float = 30.0, out: np.ndarray | None = None) -> RoundResult:
    """Average `vec` with `members` on the verified path. Raises RoundFailed."""
    me = svc.identity.peer_id_str
    cfg = ring.RingConfig(svc.config.mode, sub_chunk_bytes=svc.config.sub_chunk_bytes)
    rank, world = members.index(me), len(members)
    roster = hashlib.sha256("\n".join([run, rid, *members]).encode()).hexdigest()
    lay = ring.layout(vec.size, world, cfg)

    own = OwnDigests(len(lay[rank]), timeout + 1.0)

    def sign() -> bytes:  # our frames' digests as the ring encodes them, the norms beside (off the trio loop)
        norms, digests = streamed_material(vec, lay, own)
        header = Header(run, 0, 0, roster, me, norms, digests, math.sqrt(math.fsum(n * n for n in norms)), 1, 0)
        return sign_header(header, svc.identity)

    # As training does (`ContributionRound._attempt`): the data plane starts at once, our
    # frames are hashed as it encodes them, the header signed and exchanged beside it, and
    # each frame's check waits for the verified headers.
    held = HeldChecker(timeout + 1.0)
    got: dict = {}
    t0 = trio.current_time()

    async def headers() -> None:
        try:
            try:
                signed = await trio.to_thread.run_sync(sign)
            except NotEncoded:  # our data plane failed first: it reports why
                return
            got["signed"] = trio.current_time()
            roundtrace.mark("signed")
            raw = await svc.exchange(run, rid + "/hdr", members, signed, timeout)
            got["ok"], got["bad"] = verify_headers(raw, run, 0, 0, roster, members, {}, norm_factor=10.0)
        finally:
            got["t"] = trio.current_time()
            held.settle_verified(got.get("ok"), got.get("bad"), members, rank, [len(s) for s in lay])
            roundtrace.mark("headers")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(headers)
        try:
            res = await svc.allreduce(vec, run, rid, members, check=held, out=out, on_own=own)
        except RoundFailed:
            if got.get("bad"):
                raise RoundFailed(f"contribution headers rejected: {got['bad']}", got["bad"]) from None
            raise
    # Both beside the data plane now: how long after the round's start our header was signed,
    # and the verified headers were in.
    res.phases.update({"sign": round(got.get("signed", got["t"]) - t0, 4),
                       "exchange": round(got["t"] - got.get("signed", got["t"]), 4)})
    return res
