"""numba kernels of the sparse compressor, bit-exact with `sparse_reference.py`.

Work is split by chunk (prange): each chunk's error-feedback update, selection, levels and
residual depend only on that chunk, so the result does not depend on the thread count. The
selection uses the reference's unique integer keys (np.partition finds the k-th; any
algorithm finds the same set); the levels are float64 sums in index order, as the
reference's cumsum; no fast-math, so every fp32 operation rounds as numpy's does.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .sparse_reference import check_compress, counts

_F32_HALF = np.float32(0.5)


@njit(parallel=True, cache=True)
def _ef_update(x, ef, beta):
    for i in prange(x.size):
        ef[i] = ef[i] * beta + x[i]


@njit(parallel=True, cache=True)
def _compress(ef, chunk, k, idx, codes, levels):
    n = ef.size
    nch = levels.size // 2
    # The keys read ef's bits through a uint32 view; the update is a separate kernel because
    # numba assumed the view and ef did not alias and read stale bits in one loop.
    efu = ef.view(np.uint32)
    for c in prange(nch):
        a = c * chunk
        b = min(n, a + chunk)
        length = b - a
        kc = min(k, length)
        off = c * k
        keys = np.empty(length, np.uint64)
        for i in range(length):
            bits = np.uint64(efu[a + i] & np.uint32(0x7FFFFFFF))
            keys[i] = (bits << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - np.uint64(i))
        thr = np.partition(keys, length - kc)[length - kc]
        j = 0
        t = np.float32(np.inf)
        s = np.float32(0.0)
        for i in range(length):
            if keys[i] >= thr:
                idx[off + j] = i
                m = np.abs(ef[a + i])
                t = min(t, m)
                s = max(s, m)
                j += 1
        mid = t * _F32_HALF + s * _F32_HALF
        lo_sum = 0.0
        hi_sum = 0.0
        n_lo = 0
        n_hi = 0
        for j in range(kc):
            m = np.abs(ef[a + idx[off + j]])
            if m > mid:
                hi_sum += np.float64(m)
                n_hi += 1
            else:
                lo_sum += np.float64(m)
                n_lo += 1
        lo_l = np.float32(lo_sum / np.float64(n_lo))
        hi_l = np.float32(hi_sum / np.float64(n_hi)) if n_hi else lo_l
        levels[2 * c] = lo_l
        levels[2 * c + 1] = hi_l
        for j in range(kc):
            p = a + idx[off + j]
            v = ef[p]
            m = np.abs(v)
            hi = m > mid
            neg = np.signbit(v)
            codes[off + j] = (np.uint8(2) if neg else np.uint8(0)) | (np.uint8(1) if hi else np.uint8(0))
            d = hi_l if hi else lo_l
            ef[p] = v - (-d if neg else d)


def compress_ef(x, ef, beta, chunk, k):
    nch, kk = check_compress(x, ef, chunk, k)
    idx = np.empty(kk, np.uint16)
    codes = np.empty(kk, np.uint8)
    levels = np.empty(2 * nch, np.float32)
    _ef_update(x, ef, np.float32(beta))
    _compress(ef, chunk, k, idx, codes, levels)
    return idx, codes, levels


@njit(parallel=True, cache=True)
def _decode_add(idx, codes, levels, acc, chunk, k, mul):
    kk = idx.size
    nch = levels.size // 2
    for c in prange(nch):
        for j in range(c * k, min(kk, (c + 1) * k)):
            code = codes[j]
            m = levels[2 * c + (code & 1)]
            v = -m if code & 2 else m
            acc[c * chunk + idx[j]] += np.float64(v) * mul


def decode_add(idx, codes, levels, acc, chunk, k, mul=1.0):
    nch, kk = counts(acc.size, chunk, k)
    if idx.size != kk or codes.size != kk or levels.size != 2 * nch or acc.dtype != np.float64:
        raise ValueError("idx/codes/levels do not match (n, chunk, k), or acc is not float64")
    _decode_add(idx, codes, levels, acc, chunk, k, np.float64(mul))
    return acc
