"""numba kernels for the int8 ring all-reduce, bit-exact with `reference.py`.

The scheme (two-level block scales), its wire layout, the measured reasons for choosing it
and the edge-case behaviour are described in reference.py; this module is the fast version.
Every kernel is bit-identical to its numpy reference (quantize, both hops and both
dequantizations; no tolerance anywhere), and to itself across runs and thread counts: no
fast-math, no floating-point reduction whose order could vary (the only reductions are
integer maxima), and every super-block is computed independently of how work is split.

How: work is organised per super-block (256 values at the default block of 16). Its hot loops
are 16-lane LLVM vector helpers written as numba intrinsics, one call per 16 values: numba's
own vectorization of the same Python loops proved fragile (a ZeroDivision check or an
unprovable non-negative index silently made a loop scalar; a 16-wide max became a chain of
mispredicted branches). The fused hop reads q_in, its scales and local once, keeps the fp32
sum in an L1-resident buffer, and writes q_out and its scales once; the owner's hop also
writes the dequantized result from the same registers. Blocks that are not a multiple of 16,
and the last partial super-block, take a scalar path with the same arithmetic.

Speed (64 MiB fp32, both cores, quiet machine; ratios to np.copyto of the same vector in the
same run): quantize ~1.1x, dequantize ~2x, dequantize_add ~1.9x, ring_hop ~0.8x, owner_hop
~0.7x (it also writes the fp32 result). Figures, load conditions and what was tried are in
BENCHMARKS.md ("## Kernels", `python -m p2ptrain.bench.kernels`). First use compiles for
~10-15 s of CPU; the result is cached on disk (cache=True) and later processes load it in
well under a second.

Layout: `lanes.py` (typed constants, 16-lane vector intrinsics), `superblock.py` (the njit
per-super-block kernels and tile drivers), this module (the public API on top).
"""

from __future__ import annotations

import numpy as np
import numba

from .reference import (  # noqa: F401  (re-exported: same layout helpers on both backends)
    SUMSQ_LANES,
    DEFAULT_BLOCK,
    MMAX,
    QMAX,
    SUBS_PER_SUPER,
    _arr,
    _out,
    check_packet,
    check_quantize,
    counts,
    meta_nbytes,
    quantized_nbytes,
    simulate_ring_mean,
    split_bounds,
)
from .lanes import (
    _G,
    _sqacc8,
    _sqq8,
)
from .superblock import (
    _scale,
    _deq_par,
    _deq_sups,
    _hop_par,
    _hop_sups,
    _quantize_par,
    _quantize_sups,
)

# ------------------------------------------------------------------ public API (see reference.py)
# Inputs reach numba as read-only views, always: numba types read-only and writable arrays
# differently, so a caller passing np.frombuffer(bytes) would otherwise trigger a second,
# multi-second compilation in the middle of a round. _NO_OUT stands in for the owner-only
# output elsewhere (never written).
_NO_OUT = np.empty(0, np.float32)


def _ro(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


def _serial() -> bool:
    """One numba thread for this caller (the ring's setting): call the per-tile loop directly.
    A parallel region with one thread still goes through the thread pool's launch and cost
    ~10 % more CPU per call here; the loops are the same, so are the bits."""
    return numba.get_num_threads() == 1


def quantize(x, block=DEFAULT_BLOCK, q=None, meta=None):
    """fp32 x -> (q int8[n], meta uint8[meta_nbytes(n, block)])."""
    x, block, q, meta = check_quantize(x, block, q, meta)
    if x.size:
        n_sup = counts(x.size, block)[1]
        if _serial():
            _quantize_sups(_ro(x), np.uint64(block), q, meta, 0, n_sup, _NO_OUT,
                           np.empty(_G, np.int32), np.empty(2 * _G, np.float32))
        else:
            _quantize_par(_ro(x), np.uint64(block), q, meta, n_sup, _NO_OUT)
    return q, meta


def _dequantize(q, meta, out, add, block):
    if q.size:
        n_sup = counts(q.size, block)[1]
        if _serial():
            _deq_sups(_ro(q), _ro(meta), out, add, np.uint64(block), 0, n_sup)
        else:
            _deq_par(_ro(q), _ro(meta), out, add, np.uint64(block), n_sup)
    return out


def dequantize(q, meta, block=DEFAULT_BLOCK, out=None):
    """out[i] = q[i] * d[i // block] (exact). Returns out."""
    q, meta, block, n = check_packet(q, meta, block)
    return _dequantize(q, meta, _out(out, np.float32, "out", n), False, block)


def dequantize_add(q, meta, acc, block=DEFAULT_BLOCK):
    """acc += dequantize(q, meta) in fp32. Returns acc."""
    q, meta, block, n = check_packet(q, meta, block)
    return _dequantize(q, meta, _out(acc, np.float32, "acc", n), True, block)


def _hop(q_in, meta_in, local, mul, block, q_out, meta_out, out, owner):
    q_in, meta_in, block, n = check_packet(q_in, meta_in, block, "q_in")
    local = _arr(local, np.float32, "local", n)
    q_out = _out(q_out, np.int8, "q_out", n)
    meta_out = _out(meta_out, np.uint8, "meta_out", meta_in.size)
    if owner:
        out = _out(out, np.float32, "out", n)
    if n:
        args = (_ro(q_in), _ro(meta_in), _ro(local), np.uint64(block), np.float32(mul), q_out,
                meta_out, out if owner else _NO_OUT, owner)
        if _serial():
            _hop_sups(*args, 0, counts(n, block)[1], np.empty(_G, np.int32), np.empty(2 * _G, np.float32),
                      np.empty(_G * block, np.float32))
        else:
            _hop_par(*args, counts(n, block)[1])
    return q_out, meta_out, out


def ring_hop(q_in, meta_in, local, block=DEFAULT_BLOCK, q_out=None, meta_out=None):
    """quantize(dequantize(q_in) + local), fused: each byte read and written once."""
    return _hop(q_in, meta_in, local, 1.0, block, q_out, meta_out, None, False)[:2]


def owner_hop(q_in, meta_in, local, mul=1.0, block=DEFAULT_BLOCK, q_out=None, meta_out=None,
              out=None):
    """Owner's last hop: quantize((deq(q_in) + local) * float32(mul)) into (q_out, meta_out),
    and out = dequantize(q_out, meta_out). Returns (q_out, meta_out, out)."""
    return _hop(q_in, meta_in, local, mul, block, q_out, meta_out, out, True)


@numba.njit(cache=True, nogil=True)
def _sumsq(x):
    # The reference's order exactly: SUMSQ_LANES (8) lanes, lane j takes x[j], x[j+8], ... in
    # sequence (one explicit vector register: `lanes._sqacc8`), the tail into lanes 0..,
    # then the lanes added 0..7.
    lanes = np.zeros(8, np.float64)
    n = x.size
    head = n - n % 8
    _sqacc8(x, np.int64(head // 8), lanes)
    for j in range(n - head):
        v = np.float64(x[head + j])
        lanes[j] += v * v
    total = 0.0
    for j in range(8):
        total += lanes[j]
    return total


def sumsq(x) -> float:
    """sum of float64(x[i])^2, bit-identical to reference.sumsq (see there)."""
    assert SUMSQ_LANES == 8  # _sumsq's unrolled lanes
    return float(_sumsq(_ro(_arr(x, np.float32, "x"))))


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _sumsq_q8(q, meta, block):
    # The reference's order exactly: sub-block k's term goes into lane k % 8, in sequence,
    # then the lanes are added 0..7. A full super-block at the default block of 16 is two
    # calls of `lanes._sqq8` (sub-blocks 0-7 and 8-15: lanes 0..7 each, as k0 % 8 == 0).
    n = q.size
    n_sub = (n + block - 1) // block
    n_sup = (n_sub + 15) // 16
    lanes = np.zeros(8, np.float64)
    for j in range(n_sup):
        S = _scale(meta, j)
        k0 = j * 16
        if block == 16 and (k0 + 16) * 16 <= n:
            _sqq8(q, np.uint64(k0 * 16), meta, np.uint64(2 * n_sup + k0), S, lanes)
            _sqq8(q, np.uint64(k0 * 16 + 128), meta, np.uint64(2 * n_sup + k0 + 8), S, lanes)
            continue
        for k in range(k0, min(k0 + 16, n_sub)):
            d = np.float64(S * np.float32(meta[2 * n_sup + k]))
            acc = np.int64(0)
            for i in range(k * block, min(k * block + block, n)):
                v = np.int64(q[i])
                acc += v * v
            lanes[k % 8] += d * d * np.float64(acc)
    total = 0.0
    for j in range(8):
        total += lanes[j]
    return total


def sumsq_q8(q, meta, block=DEFAULT_BLOCK) -> float:
    """sumsq(dequantize(q, meta)) up to summation order, from the payload: bit-identical to
    reference.sumsq_q8 (see there). ~7x faster than dequantize + sumsq at 1M values here."""
    q, meta, block, n = check_packet(q, meta, block)
    if n == 0:
        return 0.0
    return float(_sumsq_q8(_ro(q), _ro(meta), np.int64(block)))
