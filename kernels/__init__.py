"""Compute kernels of the int8 ring all-reduce (reduce-scatter + all-gather).

Public API (identical on both backends, bit for bit):

    quantize(x, block=16, q=None, meta=None) -> (q, meta)
    dequantize(q, meta, block=16, out=None) -> out
    dequantize_add(q, meta, acc, block=16) -> acc                     # acc += deq(q)
    ring_hop(q_in, meta_in, local, block=16, q_out=None, meta_out=None) -> (q_out, meta_out)
        # quantize(dequantize(q_in) + local), fused: each byte read and written once
    owner_hop(q_in, meta_in, local, mul=1.0, block=16, q_out=None, meta_out=None, out=None)
        -> (q_out, meta_out, out)
        # q_out = quantize((deq(q_in) + local) * float32(mul)); out = dequantize(q_out), so the
        # owner's result is bit-identical to every other peer's decoding of the forwarded bytes
    sumsq(x) -> float               # sum of float64(x_i)^2 in a fixed 8-lane order; non-finite
                                    # iff some x_i is (the verified path's norm checks)
    sumsq_q8(q, meta, block=16) -> float  # sumsq(dequantize(q, meta)) up to summation order,
                                    # from the int8 payload without decoding it
    quantized_nbytes(n, block=16)   # wire bytes: n (int8) + meta_nbytes(n, block)
    meta_nbytes(n, block=16)        # 2 per super-block of 16 sub-blocks + 1 per sub-block
    split_bounds(n, parts, block=16)  # ring chunk boundaries on super-block multiples
    simulate_ring_mean(tensors, block=16, kernels=None, return_all=False)

Arrays are 1-D C-contiguous numpy arrays: x, local, acc, out float32; q int8; meta uint8 (a
bf16 scale per super-block, little-endian, then a uint8 step multiplier per sub-block: see
reference.py for the scheme, the measurements behind it and the edge cases). Outputs are
allocated when not given; given ones are written in place and may be the inputs they replace.

The backend is numba (`p2ptrain.kernels.quant`) unless the environment variable
P2PTRAIN_KERNELS=numpy selects the plain-numpy reference (`p2ptrain.kernels.reference`, slow
but correct, and numba is then never imported); `BACKEND` names the one in use. The choice is
made once, at import.
"""

from __future__ import annotations

import os

from .reference import DEFAULT_BLOCK, SUBS_PER_SUPER, meta_nbytes, quantized_nbytes, split_bounds

_requested = os.environ.get("P2PTRAIN_KERNELS", "numba").strip().lower() or "numba"
if _requested not in ("numba", "numpy"):
    raise ImportError(f"P2PTRAIN_KERNELS must be 'numba' or 'numpy', got {_requested!r}")

if _requested == "numpy":
    from . import reference as _impl
else:
    # imported only here, so the numpy backend works where numba does not
    from . import quant as _impl

BACKEND = _requested
quantize = _impl.quantize
dequantize = _impl.dequantize
dequantize_add = _impl.dequantize_add
ring_hop = _impl.ring_hop
owner_hop = _impl.owner_hop
sumsq = _impl.sumsq
sumsq_q8 = _impl.sumsq_q8


def warm() -> None:
    """Compile (or load from the disk cache) every kernel a ring round runs, before a node
    says it is ready: a first round that compiles for seconds would make the other members
    time out waiting for its frames."""
    import numpy as np

    x = np.linspace(-1, 1, 4096, dtype=np.float32)
    q, meta = quantize(x)
    q2, m2 = ring_hop(q, meta, x)
    owner_hop(q2, m2, x, 0.5)
    dequantize(q, meta)
    sumsq(x)  # the verified path's header norms (run/contribution.py) and fp32 frame checks
    sumsq_q8(q, meta)  # its int8 frame checks (reduce/ring.py)


def simulate_ring_mean(tensors, block=DEFAULT_BLOCK, kernels=None, return_all=False):
    """Ring all-reduce (mean) simulation; uses the selected backend unless `kernels` is given."""
    from .reference import simulate_ring_mean as _sim

    return _sim(tensors, block, kernels if kernels is not None else _impl, return_all)


__all__ = [
    "BACKEND",
    "DEFAULT_BLOCK",
    "SUBS_PER_SUPER",
    "dequantize",
    "dequantize_add",
    "meta_nbytes",
    "owner_hop",
    "quantize",
    "quantized_nbytes",
    "ring_hop",
    "simulate_ring_mean",
    "split_bounds",
    "sumsq",
    "sumsq_q8",
    "warm",
]
