"""Sparse compressor (issue 18): numba/numpy bit parity, deterministic ties, error feedback,
wire layout round trip and the decoder's refusals."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from p2ptrain.kernels import sparse as SK
from p2ptrain.kernels import sparse_numba as NB
from p2ptrain.kernels import sparse_reference as NP

CASES = [(1, 16, 1), (7, 16, 16), (100, 16, 3), (4096, 4096, 61), (4097, 4096, 61), (10_000, 1000, 15),
         (65_537, 4096, 123), (300_001, 4096, 61)]


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def _data(n: int, seed: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "ties":  # few distinct magnitudes: selection decided by the index tie-break
        return (rng.integers(-3, 4, n) * 0.25).astype(np.float32)
    x = rng.standard_normal(n) if kind == "gauss" else rng.standard_t(2, n)
    return (x * 10.0 ** rng.integers(-6, 3)).astype(np.float32)


@pytest.fixture(params=["pool", "serial"])
def threads(request):
    saved = numba.get_num_threads()
    numba.set_num_threads(1 if request.param == "serial" else numba.config.NUMBA_NUM_THREADS)
    yield
    numba.set_num_threads(saved)


@pytest.mark.parametrize("kind", ["gauss", "heavy", "ties"])
@pytest.mark.parametrize("n,chunk,k", CASES)
def test_parity_compress_and_decode(n, chunk, k, kind, threads):
    x, e0 = _data(n, n + k, kind), _data(n, n + k + 1, kind)
    ea, eb = e0.copy(), e0.copy()
    for _ in range(3):  # a few rounds: the error feedback carries over
        ra, rb = NB.compress_ef(x, ea, 0.95, chunk, k), NP.compress_ef(x, eb, 0.95, chunk, k)
        assert all(_same(a, b) for a, b in zip(ra, rb))
        assert _same(ea, eb)
    acc_a = NB.decode_add(*ra, np.full(n, 0.25), chunk, k, 0.5)
    acc_b = NP.decode_add(*rb, np.full(n, 0.25), chunk, k, 0.5)
    assert _same(acc_a, acc_b)
    assert ra[0].size == SK.counts(n, chunk, k)[1]


@pytest.mark.parametrize("n,chunk,k", CASES)
def test_selection_error_feedback_and_round_trip(n, chunk, k):
    x = _data(n, 7, "ties")
    ef = np.zeros(n, np.float32)
    idx, codes, levels = SK.compress_ef(x, ef, 0.9, chunk, k)
    dec = SK.decode_add(idx, codes, levels, np.zeros(n), chunk, k).astype(np.float32)
    # error feedback: what was sent plus what was kept is exactly the input (first round)
    assert np.array_equal(dec + ef, x) or np.allclose(dec + ef, x, rtol=0, atol=1e-6)
    for c in range(SK.counts(n, chunk, k)[0]):
        seg = np.abs(x[c * chunk:(c + 1) * chunk])
        kc = min(k, seg.size)
        sel = idx[c * k:c * k + kc]
        # the top kc magnitudes, ties to the lower index
        order = np.lexsort((np.arange(seg.size), -seg))[:kc]
        assert np.array_equal(np.sort(order), sel)
    buf = SK.pack(idx, codes, levels, n, chunk, k)
    assert len(buf) == SK.payload_nbytes(n, chunk, k)
    back = SK.unpack(buf, n, chunk, k)
    assert all(_same(a, b) for a, b in zip(back, (idx, codes, levels)))


def test_zero_input_keeps_k_entries_and_decodes_to_zero():
    ef = np.zeros(5000, np.float32)
    idx, codes, levels = SK.compress_ef(np.zeros(5000, np.float32), ef, 0.95, 4096, 10)
    assert idx.size == 20 and not levels.any() and not ef.any()
    assert list(idx[:10]) == list(range(10))  # ties: lowest indices


def _valid(n=5000, chunk=1024, k=9):
    x = _data(n, 3, "gauss")
    r = SK.compress_ef(x, np.zeros(n, np.float32), 0.95, chunk, k)
    return bytearray(SK.pack(*r, n, chunk, k)), (n, chunk, k)


@pytest.mark.parametrize("corrupt,reason", [
    (lambda b: b[:-1], "expected"),
    (lambda b: b + b"\0", "expected"),
    (lambda b: b[:4] + np.float32(np.nan).tobytes() + b[8:], "levels"),
    (lambda b: np.float32(-1.0).tobytes() + b[4:], "levels"),
    (lambda b: np.float32(1e30).tobytes() + b[4:], "levels"),  # lo > hi
])
def test_unpack_rejects_malformed(corrupt, reason):
    buf, shape = _valid()
    with pytest.raises(SK.SparseFormatError, match=reason):
        SK.unpack(bytes(corrupt(buf)), *shape)


def test_unpack_rejects_bad_indices_and_padding():
    n, chunk, k = 5000, 1024, 9
    nch, kk = SK.counts(n, chunk, k)
    idx = np.tile(np.arange(k, dtype=np.uint16), nch)[:kk]
    codes = np.zeros(kk, np.uint8)
    levels = np.ones(2 * nch, np.float32)
    assert SK.unpack(SK.pack(idx, codes, levels, n, chunk, k), n, chunk, k)[0].size == kk
    dup = idx.copy()
    dup[1] = dup[0]
    with pytest.raises(SK.SparseFormatError, match="ascending"):
        SK.unpack(SK.pack(dup, codes, levels, n, chunk, k), n, chunk, k)
    far = idx.copy()
    far[-1] = 1000  # the last chunk holds only 5000 - 4 * 1024 = 904 values
    with pytest.raises(SK.SparseFormatError, match="beyond"):
        SK.unpack(SK.pack(far, codes, levels, n, chunk, k), n, chunk, k)
    buf = bytearray(SK.pack(idx, codes, levels, n, chunk, k))
    buf[-1] |= 0xC0  # kk = 45: the last code byte has 3 padding slots
    with pytest.raises(SK.SparseFormatError, match="padding"):
        SK.unpack(bytes(buf), n, chunk, k)


def test_shape_limits():
    with pytest.raises(ValueError):
        SK.counts(10, 8192, 10)  # chunk > 4096: offsets would not fit 12 bits
    with pytest.raises(ValueError):
        SK.compress_ef(np.array([np.inf], np.float32), np.zeros(1, np.float32), 0.9, 16, 1)
    assert SK.k_for(4096, 0.015) == 61 and SK.k_for(16, 0.001) == 1


@pytest.mark.parametrize("n,chunk,k", [(4096, 4096, 151), (123_200, 4096, 82), (5000, 1024, 9), (300, 16, 16),
                                       (17, 16, 1), (10_000, 4096, 4096)])
def test_elias_fano_round_trip_and_size(n, chunk, k):
    """Any ascending k-subset per chunk survives pack/unpack; the payload is the fixed size
    the layout promises, and smaller than 12-bit offsets once k / chunk <= 1/4."""
    rng = np.random.default_rng(n + k)
    nch, kk = SK.counts(n, chunk, k)
    idx = np.concatenate([np.sort(rng.choice(min(chunk, n - c * chunk), min(k, n - c * chunk), replace=False))
                          for c in range(nch)]).astype(np.uint16)
    codes = rng.integers(0, 4, kk).astype(np.uint8)
    levels = np.sort(rng.random((nch, 2)).astype(np.float32), axis=1).reshape(-1)
    buf = SK.pack(idx, codes, levels, n, chunk, k)
    assert len(buf) == SK.payload_nbytes(n, chunk, k)
    assert all(_same(a, b) for a, b in zip(SK.unpack(buf, n, chunk, k), (idx, codes, levels)))
    if 4 * k <= chunk:
        assert SK.payload_nbytes(n, chunk, k) < 8 * nch + 3 * (-(-kk // 2)) + (-(-kk // 4))


def test_elias_fano_rejects_bad_bitvectors():
    n, chunk, k = 5000, 1024, 9
    buf, _ = _valid(n, chunk, k)
    nch, kk = SK.counts(n, chunk, k)
    start = 8 * nch + -(-kk * SK.low_bits(chunk, k) // 8)  # first byte of the high bitvectors
    highs = np.unpackbits(np.frombuffer(bytes(buf[start:]), np.uint8), bitorder="little")
    extra = int(np.flatnonzero(highs == 0)[0])  # one more set bit: a chunk with k + 1 indices
    bad = bytearray(buf)
    bad[start + extra // 8] |= 1 << (extra % 8)
    with pytest.raises(SK.SparseFormatError, match="k indices"):
        SK.unpack(bytes(bad), n, chunk, k)
    first = int(np.flatnonzero(highs)[0])  # one fewer: a chunk with k - 1
    bad = bytearray(buf)
    bad[start + first // 8] &= ~(1 << (first % 8)) & 0xFF
    with pytest.raises(SK.SparseFormatError, match="k indices"):
        SK.unpack(bytes(bad), n, chunk, k)
    bad = bytearray(buf)
    bad[start - 1] |= 0x80  # kk * L = 45 * 6 = 270 bits: the last low-bit byte has 2 padding bits
    with pytest.raises(SK.SparseFormatError, match="low-bit padding"):
        SK.unpack(bytes(bad), n, chunk, k)
