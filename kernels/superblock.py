"""The int8 kernels' per-super-block work (numba, nogil): geometry, scales, the fused
quantize / hop / dequantize loops and their serial and parallel tile drivers. `quant.py`
wraps them in the public API; `lanes.py` holds the vector helpers they call.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .lanes import (
    _ABS,
    _EXP,
    _F0,
    _F1,
    _FINF,
    _F_MMAX,
    _F_NQMAX,
    _F_QMAX,
    _F_SDIV,
    _G,
    _HI16,
    _LO16,
    _NAN16,
    _ONE16,
    _TILE,
    _U1,
    _UG,
    _V,
    _absmax16,
    _bits,
    _deq16,
    _deqadd16,
    _float,
    _quant16,
    _quantdeq16,
    _steps16,
    _sum16,
    _sumscaled16,
)


# ------------------------------------------------------------------ per-super-block kernels
# Element indices are uint64 on purpose: numba wraps every signed index it cannot prove >= 0
# (negative indexing), which costs a branch per access in the scalar paths. The "fast" path
# (block a multiple of 16, full super-block) uses the 16-lane helpers; the scalar path
# covers any other block size and the final partial super-block with the same arithmetic.
_KW = dict(cache=True, error_model="numpy", inline="always")  # numpy: no ZeroDivision checks


@njit(**_KW)
def _geometry(n, block, j):
    """Super-block j: (meta offset of its sub-scales, sub-blocks, first element, elements)."""
    n_sub = (n + block - _U1) // block
    n_sup = (n_sub + _UG - _U1) // _UG
    k0 = np.uint64(j) * _UG
    nk = min(_UG, n_sub - k0)
    base = k0 * block
    return np.int64(2 * n_sup + k0), np.int64(nk), base, min(nk * block, n - base)


@njit(**_KW)
def _scale(meta, j):
    """Super-block j's scale S (two bytes, little-endian: meta may be unaligned)."""
    s16 = np.int32(meta[2 * j]) | (np.int32(meta[2 * j + 1]) << np.int32(8))
    return _float(s16 << np.int32(16))


@njit(**_KW)
def _sub_absmax(src, so, cnt, block, nk, subbits):
    """subbits[k] = max abs-bits of sub-block k of src[so:so+cnt]; returns the overall max."""
    amax = np.int32(0)
    if block % _V == 0 and cnt == _UG * block:
        nc = block // _V
        for k in range(_G):
            mb = np.int32(0)
            for c in range(nc):
                mb = max(mb, _absmax16(src, so + (np.uint64(k) * nc + c) * _V))
            subbits[k] = mb
            amax = max(amax, mb)
        return amax
    for k in range(nk):
        lo = so + np.uint64(k) * block
        mb = np.int32(0)
        for i in range(lo, min(lo + block, so + cnt)):
            b = _bits(src[i]) & _ABS
            mb = b if b > mb else mb
        subbits[k] = mb
        amax = max(amax, mb)
    return amax


@njit(**_KW)
def _emit(src, so, cnt, block, subbits, nk, amax, q, qo, meta, j, subs_at, dsub, out, owner):
    """Quantize src[so:so+cnt] (super-block j) into q[qo:qo+cnt], its scales into meta; for
    the owner also out[qo:qo+cnt] = the dequantized result."""
    b = _NAN16 << np.int32(16)  # inf / NaN in the super-block: NaN marker (see reference.py)
    if amax < _EXP:
        b = _bits(_float(amax) / _F_SDIV)
        if b & _LO16:  # round the bf16 scale up so no value needs more than 127 steps
            b = (b + _ONE16) & _HI16
    meta[2 * j] = np.uint8((b >> np.int32(16)) & np.int32(0xFF))
    meta[2 * j + 1] = np.uint8(b >> np.int32(24))
    S = _float(b)
    S127 = S * _F_QMAX
    if not S127 > _F0:  # all zero (S = 0) or non-finite (S = NaN): m = 0, q = 0
        for k in range(nk):
            meta[subs_at + k] = 0
        zero = _F0 * (S * _F0)  # what dequantization yields: 0, or NaN for the NaN marker
        for i in range(cnt):
            q[qo + i] = 0
            if owner:
                out[qo + i] = zero
        return
    if block % _V == 0 and cnt == _UG * block:
        _steps16(subbits, S, meta, subs_at, dsub)
        nc = block // _V
        for k in range(_G):
            for c in range(nc):
                o = (np.uint64(k) * nc + c) * _V
                if owner:
                    _quantdeq16(src, so + o, dsub[_G + k], dsub[k], q, qo + o, out)
                else:
                    _quant16(src, so + o, dsub[_G + k], dsub[k], q, qo + o, out)
        return
    for k in range(nk):
        m = min(np.ceil(_float(subbits[k]) / S127), _F_MMAX)
        inv = _F1 / (S * m)
        if not inv < _FINF:  # step 0 or below 2^-128: flush the sub-block (see reference.py)
            m = _F0
            inv = _F0
        meta[subs_at + k] = np.uint8(m)
        lo = np.uint64(k) * block
        for i in range(lo, min(lo + block, cnt)):
            r = np.rint(src[so + i] * inv)
            q[qo + i] = np.int8(min(max(r, _F_NQMAX), _F_QMAX))
    if owner:
        _deq_sup(q, meta, out, False, block, np.uint64(out.size), j)


@njit(**_KW)
def _deq_sup(q, meta, out, add, block, n, j):
    subs_at, nk, base, cnt = _geometry(n, block, j)
    S = _scale(meta, j)
    if block % _V == 0 and cnt == _UG * block:
        nc = block // _V
        for k in range(_G):
            d = S * np.float32(meta[subs_at + k])
            for c in range(nc):
                o = base + (np.uint64(k) * nc + c) * _V
                if add:
                    _deqadd16(q, o, d, out)
                else:
                    _deq16(q, o, d, out)
        return
    for k in range(nk):
        d = S * np.float32(meta[subs_at + k])
        lo = base + np.uint64(k) * block
        for i in range(lo, min(lo + block, n)):
            v = np.float32(q[i]) * d
            out[i] = out[i] + v if add else v


# The per-tile functions are deliberately not inlined: the parallel loop body stays a single
# call, which keeps numba's parfor passes (and so the cold compile time) small.
_TKW = dict(cache=True, error_model="numpy", nogil=True)


@njit(**_TKW)
def _quantize_sups(x, block, q, meta, s0, s1, no_out, subbits, dsub):
    n = np.uint64(x.size)
    for j in range(s0, s1):
        subs_at, nk, base, cnt = _geometry(n, block, j)
        amax = _sub_absmax(x, base, cnt, block, nk, subbits)
        _emit(x, base, cnt, block, subbits, nk, amax, q, base, meta, j, subs_at, dsub, no_out,
              False)


@njit(**_TKW)
def _hop_sups(q_in, meta_in, local, block, mul, q_out, meta_out, out, owner, s0, s1, subbits,
              dsub, sbuf):
    """Hop over super-blocks [s0, s1): s = (deq(q_in) + local) * mul goes to the L1-resident
    sbuf, so every input byte is read from memory once. mul is exactly 1 unless owner."""
    n = np.uint64(local.size)
    z = np.uint64(0)
    for j in range(s0, s1):
        subs_at, nk, base, cnt = _geometry(n, block, j)
        S = _scale(meta_in, j)
        amax = np.int32(0)
        if block % _V == 0 and cnt == _UG * block:
            nc = block // _V
            for k in range(_G):
                d = S * np.float32(meta_in[subs_at + k])
                mb = np.int32(0)
                for c in range(nc):
                    o = (np.uint64(k) * nc + c) * _V
                    if owner:
                        b = _sumscaled16(q_in, base + o, d, local, base + o, mul, sbuf, o)
                    else:
                        b = _sum16(q_in, base + o, d, local, base + o, mul, sbuf, o)
                    mb = max(mb, b)
                subbits[k] = mb
                amax = max(amax, mb)
        else:
            for k in range(nk):
                d = S * np.float32(meta_in[subs_at + k])
                lo = np.uint64(k) * block
                mb = np.int32(0)
                for i in range(lo, min(lo + block, cnt)):
                    s = (np.float32(q_in[base + i]) * d + local[base + i]) * mul
                    sbuf[i] = s
                    b = _bits(s) & _ABS
                    mb = b if b > mb else mb
                subbits[k] = mb
                amax = max(amax, mb)
        _emit(sbuf, z, cnt, block, subbits, nk, amax, q_out, base, meta_out, j, subs_at, dsub,
              out, owner)


# ------------------------------------------------------------------ parallel drivers
# One parallel driver per kernel and no serial twin: launching the thread pool costs ~2 us
# (measured), far less than compiling every kernel twice. Scratch (sub-block maxima and
# steps, the hop's sum) is allocated once per tile of _TILE super-blocks, never per block.
# nogil: the node can run a kernel in a worker thread while its event loop moves bytes.
_DKW = dict(cache=True, error_model="numpy", nogil=True, parallel=True)


@njit(**_DKW)
def _quantize_par(x, block, q, meta, n_sup, no_out):
    for t in prange((n_sup + _TILE - 1) // _TILE):
        _quantize_sups(x, block, q, meta, t * _TILE, min(n_sup, (t + 1) * _TILE), no_out,
                       np.empty(_G, np.int32), np.empty(2 * _G, np.float32))


@njit(**_DKW)
def _hop_par(q_in, meta_in, local, block, mul, q_out, meta_out, out, owner, n_sup):
    for t in prange((n_sup + _TILE - 1) // _TILE):
        _hop_sups(q_in, meta_in, local, block, mul, q_out, meta_out, out, owner, t * _TILE,
                  min(n_sup, (t + 1) * _TILE), np.empty(_G, np.int32),
                  np.empty(2 * _G, np.float32), np.empty(_G * np.int64(block), np.float32))


@njit(**_TKW)
def _deq_sups(q, meta, out, add, block, s0, s1):
    for j in range(s0, s1):
        _deq_sup(q, meta, out, add, block, np.uint64(out.size), j)


@njit(**_DKW)
def _deq_par(q, meta, out, add, block, n_sup):
    for t in prange((n_sup + _TILE - 1) // _TILE):
        _deq_sups(q, meta, out, add, block, t * _TILE, min(n_sup, (t + 1) * _TILE))
