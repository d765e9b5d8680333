"""Sparse compressor of pseudo-gradients (issue 18): top-k per chunk + 2-bit values + error
feedback. The scheme and its wire layout are described in `sparse_reference.py`.

Public API (identical on both backends, bit for bit):

    compress_ef(x, ef, beta, chunk, k) -> (idx uint16[K], codes uint8[K], levels float32[2*chunks])
        # ef <- beta*ef + x; keep the top k of each chunk; ef <- ef - decoded (in place)
    decode_add(idx, codes, levels, acc, chunk, k, mul=1.0) -> acc   # acc float64[n] += decoded * mul
    pack(idx, codes, levels, n, chunk, k) -> bytes;  unpack(buf, n, chunk, k) -> (idx, codes, levels)
    # indices Elias-Fano coded (sparse_reference.py); low_bits(chunk, k): its split
    counts(n, chunk, k) -> (chunks, K);  payload_nbytes(n, chunk, k);  k_for(chunk, fraction)

The backend follows P2PTRAIN_KERNELS as `p2ptrain.kernels` does (numba unless it says
numpy); pack/unpack are numpy on both (vectorized, a few ms for millions of entries).
`reference` is always the numpy module (the bench uses it next to torch, see diloco.py).
"""

from __future__ import annotations

import os

from . import sparse_reference as reference
from .sparse_reference import (MAX_CHUNK, SparseFormatError, counts, low_bits, pack, payload_nbytes,  # noqa: F401
                               unpack)

if (os.environ.get("P2PTRAIN_KERNELS", "numba").strip().lower() or "numba") == "numpy":
    _impl = reference
else:
    from . import sparse_numba as _impl  # imported only here: the numpy backend needs no numba

BACKEND = "numba" if _impl is not reference else "numpy"
compress_ef = _impl.compress_ef
decode_add = _impl.decode_add


def k_for(chunk: int, fraction: float) -> int:
    """Entries kept per chunk for a top-k fraction (at least 1)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
    return max(1, min(chunk, round(fraction * chunk)))
