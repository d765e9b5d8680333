"""The ring's frames and schedule (pure: no I/O, no threads): config, how a tensor is cut
into chunks and sub-chunks, a frame's wire size and encoding, and which frame each rank sends
and receives at each step. `p2ptrain.reduce.ring` runs it; the trainer and the benches use
`layout`, `own_payloads`, `schedule` and `wire_bytes` to sign and count frames.

Schedule for world W, rank r (ring order is the caller's), tensor split into W chunks, each
into k sub-chunks on super-block boundaries (plus a small one at each end, `layout`):
  reduce-scatter step s = 0..W-2: send chunk (r-s) mod W, receive chunk (r-s-1) mod W.
  all-gather step s = 0..W-2 (FrameId step W-1+s): send chunk (r+1-s) mod W, receive chunk
  (r-s) mod W.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from p2ptrain import kernels as K


class RingError(Exception):
    """The data plane failed (peer gone, timeout, too many bad frames); nothing was changed.

    `blame` names a member caught sending bad data (by the caller's frame check)."""

    def __init__(self, message: str, blame: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.blame = blame
        self.reason = reason


@dataclass(frozen=True)
class FrameId:
    step: int
    """0..W-2 reduce-scatter, W-1..2W-3 all-gather."""
    chunk: int
    """chunk index * k + sub-chunk index."""


class Channel(Protocol):
    """One direction of an authenticated, encrypted frame pipe (see p2ptrain/reduce/bulk.py)."""

    def send(self, fid: FrameId, payload: memoryview) -> None: ...

    def recv(self, fid: FrameId, out: memoryview) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RingConfig:
    mode: str = "int8"
    """'int8' (quantized wire, fp32 accumulation) or 'fp32' (exact, 4x the bytes)."""
    block: int = K.DEFAULT_BLOCK
    """Quantization sub-block size (see p2ptrain.kernels)."""
    sub_chunk_bytes: int = 4 << 20
    """Target fp32 bytes per pipelined sub-chunk (one frame); larger where a chunk would
    need more than MAX_FRAMES_PER_CHUNK frames. Every member must use the same."""
    kernel_threads: int = 1
    """numba threads per kernel call. One is right: the ring already overlaps compute with
    two I/O threads, a serial kernel outruns any internet link, and parallel regions stall
    badly when cores are oversubscribed (measured: 4 ring peers on 2 cores ran ~5x slower)."""

    def __post_init__(self) -> None:
        if self.mode not in ("int8", "fp32"):
            raise ValueError("mode must be 'int8' or 'fp32'")
        if self.sub_chunk_bytes < 4096:
            raise ValueError("sub_chunk_bytes must be >= 4096")


EDGE_DIVISOR = 8
"""A chunk's first and last frames carry 1/EDGE_DIVISOR of a sub-chunk (see `layout`)."""
MAX_FRAMES_PER_CHUNK = 40
"""A ring member's signed contribution header lists the digest of every frame of its own
chunk, and a header travels as one control message of at most 4 KiB
(`reduce.control.MAX_CONTROL_MSG`): ~55 digests. A chunk that would need more frames gets
larger ones instead. Before, a header of a model past ~110M parameters (2 members; ~220M
with 4) was dropped as oversize at every receiver, and no verified round could commit."""
LAYOUT_VERSION = 2
"""How `layout` cuts a tensor: 1 = equal sub-chunks, 2 = plus a small frame at each end, and
at most MAX_FRAMES_PER_CHUNK frames a chunk."""


def frame_tag(cfg: RingConfig) -> int:
    """What members confirm of their frame cut before a round (`p2ptrain.run.roster.Confirm`):
    the sub-chunk size and the layout version. Members that cut differently would exchange
    frames that match no digest (blaming each other for a version skew); with unequal tags
    they are left out at confirmation instead. A version-1 peer confirmed the bare size,
    which equals no tag of the same size."""
    return cfg.sub_chunk_bytes * 16 + LAYOUT_VERSION


def layout(n: int, world: int, cfg: RingConfig) -> list[list[tuple[int, int]]]:
    """[chunk][sub] -> (start, end) element ranges; identical on every member.

    A chunk of k >= 2 sub-chunks also gets a small frame at each end, so the pipeline fills
    and drains faster: every member's first frame is the first of its own chunk, and the
    link idles until that frame is encoded and sealed (~1 ms for a 4 MiB sub-chunk, ~0.1 ms
    for 1/8 of it); the round's last frame is the last of a chunk, and after its last byte
    the member still opens, checks and decodes it before it can vote. Every boundary stays
    on a super-block multiple, as the chunks' own."""
    bounds = K.split_bounds(n, world, cfg.block)
    sup = K.SUBS_PER_SUPER * cfg.block
    edge = max(sup, cfg.sub_chunk_bytes // 4 // EDGE_DIVISOR // sup * sup)
    out = []
    for c in range(world):
        lo, hi = bounds[c], bounds[c + 1]
        k = max(1, -(-(hi - lo) * 4 // cfg.sub_chunk_bytes))
        if k < 2:
            out.append([(lo, hi)])
            continue
        k = min(k, MAX_FRAMES_PER_CHUNK - 2)
        tail = (hi - edge) // sup * sup  # where the last small frame starts
        inner = K.split_bounds(tail - lo - edge, k, cfg.block)
        cuts = [lo] + [lo + edge + x for x in inner] + [hi]
        out.append([(cuts[j], cuts[j + 1]) for j in range(len(cuts) - 1)])
    return out


def wire_bytes(n_elems: int, cfg: RingConfig) -> int:
    return n_elems * 4 if cfg.mode == "fp32" else K.quantized_nbytes(n_elems, cfg.block)


def payload_views(m: int, cfg: RingConfig) -> tuple[bytearray, np.ndarray, np.ndarray | None]:
    """A fresh frame payload and the array views kernels write into (no copies)."""
    buf = bytearray(wire_bytes(m, cfg))
    if cfg.mode == "fp32":
        return buf, np.frombuffer(buf, np.float32), None
    return buf, np.frombuffer(buf, np.int8, count=m), np.frombuffer(buf, np.uint8, offset=m)


def encode_payload(x: np.ndarray, cfg: RingConfig) -> bytearray:
    buf, a, meta = payload_views(x.size, cfg)
    if cfg.mode == "fp32":
        a[:] = x
    else:
        K.quantize(x, cfg.block, q=a, meta=meta)
    return buf


def own_payloads(vec: np.ndarray, rank: int, world: int, cfg: RingConfig) -> list[bytearray]:
    """This rank's step-0 frames: its own chunk, encoded sub-chunk by sub-chunk."""
    vec = np.ascontiguousarray(vec, dtype=np.float32).ravel()
    return [encode_payload(vec[lo:hi], cfg) for lo, hi in layout(vec.size, world, cfg)[rank]]


def schedule(rank: int, world: int, lay: list[list[tuple[int, int]]]):
    """(sends, recvs): ordered lists of (FrameId, chunk, sub) for this rank."""
    sends, recvs = [], []
    for s in range(world - 1):
        c_send, c_recv = (rank - s) % world, (rank - s - 1) % world
        sends += [(FrameId(s, c_send * 1000 + j), c_send, j) for j in range(len(lay[c_send]))]
        recvs += [(FrameId(s, c_recv * 1000 + j), c_recv, j) for j in range(len(lay[c_recv]))]
    for s in range(world - 1):
        c_send, c_recv = (rank + 1 - s) % world, (rank - s) % world
        step = world - 1 + s
        sends += [(FrameId(step, c_send * 1000 + j), c_send, j) for j in range(len(lay[c_send]))]
        recvs += [(FrameId(step, c_recv * 1000 + j), c_recv, j) for j in range(len(lay[c_recv]))]
    return sends, recvs
