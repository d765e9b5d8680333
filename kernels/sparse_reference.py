"""Plain-numpy reference of the sparse (top-k + 2-bit + error feedback) compressor, and its
wire layout. The numba twins are in `sparse_numba.py`; `sparse.py` selects one.

Scheme (after SparseLoCo, arXiv 2508.15706; no DCT, which SparseLoCo found unnecessary):
  1. error feedback:  e <- beta * e + x                      (fp32, one multiply, one add)
  2. per chunk of `chunk` values, keep the k entries of largest |e| (the last chunk keeps
     min(k, its length)); ties go to the lower index, so every machine keeps the same set:
     the selection key is (|e| bits << 32) | (2^32 - 1 - index), unique within a chunk.
  3. 2 bits per kept value: sign and one magnitude bit. Split at mid = (t + s) / 2 between
     the smallest (t) and largest (s) kept |e|; each half is reconstructed as its mean
     |e| (float64 sum in index order, then fp32), so a chunk sends two fp32 levels lo <= hi.
  4. e <- e - decoded at the kept entries: what was not sent stays for the next round.

Wire layout of one compressed vector (n values, chunk C <= 4096, k per chunk; bit streams are
little-endian: bit i of a stream is bit i % 8 of byte i // 8):
  levels  fp32 little-endian [lo_0, hi_0, lo_1, hi_1, ...]       8 bytes per chunk
  lows    the L = floor(log2(C / k)) low bits of every offset (offset within its chunk),
          entry after entry, L bits each (bit 0 first)
  highs   per chunk of length len with kc kept offsets, a bitvector of kc + ((len-1) >> L) + 1
          bits with bit (offset_j >> L) + j set for its j-th offset: the high parts in unary
          (Elias-Fano). The chunks' bitvectors follow each other, then the stream is padded
  codes   2 bits each (bit 1: negative, bit 0: hi), four per byte, first in the low bits
Offsets in a chunk are ascending, so Elias-Fano codes each in L + 1 + 2^-L * C / k bits, within
~0.5 bit of the entropy of a k-subset and at a fixed size for given (n, C, k): ~6.6 bits at
k / C = 4 %, 7.6 at 2 % (a plain 12-bit offset was 12). Padding (the last bits of each stream)
is zero; `unpack` rejects anything else, as it rejects a chunk's bitvector without exactly kc
set bits, offsets out of their chunk or not strictly ascending, and levels that are not
finite, negative or unordered. Entry j belongs to chunk j // k (every chunk but the last is full).

Determinism: the selection uses integer keys only; the levels are float64 sums in a fixed
(index) order; every other step is one IEEE operation. numpy and numba therefore agree bit
for bit, and decoding (a level and a sign) is exact on any machine.
"""

from __future__ import annotations

import numpy as np

MAX_CHUNK = 4096  # offsets fit uint16 (and the bench's chunks are 4096)
_F32, _F64, _U64 = np.float32, np.float64, np.uint64
_LOW32 = np.uint64(0xFFFFFFFF)


class SparseFormatError(ValueError):
    """Bytes that are not a valid compressed vector of the expected shape."""


def check_shape(n: int, chunk: int, k: int) -> None:
    if not (n >= 1 and 1 <= chunk <= MAX_CHUNK and 1 <= k <= chunk):
        raise ValueError(f"need n >= 1, 1 <= chunk <= {MAX_CHUNK}, 1 <= k <= chunk (n={n}, chunk={chunk}, k={k})")


def counts(n: int, chunk: int, k: int) -> tuple[int, int]:
    """(chunks, kept entries in all)."""
    check_shape(n, chunk, k)
    nch = -(-n // chunk)
    return nch, (nch - 1) * k + min(k, n - (nch - 1) * chunk)


def payload_nbytes(n: int, chunk: int, k: int) -> int:
    nch, kk = counts(n, chunk, k)
    return 8 * nch + 3 * (-(-kk // 2)) + (-(-kk // 4))


def check_compress(x, ef, chunk, k):
    if not (isinstance(x, np.ndarray) and isinstance(ef, np.ndarray) and x.dtype == _F32 and ef.dtype == _F32
            and x.ndim == 1 and x.shape == ef.shape and x.flags.c_contiguous and ef.flags.c_contiguous
            and ef.flags.writeable):
        raise ValueError("x and ef must be 1-D C-contiguous float32 arrays of one length (ef writable)")
    if not np.isfinite(x).all() or not np.isfinite(ef).all():
        raise ValueError("x and ef must be finite")
    return counts(x.size, chunk, k)


def compress_ef(x, ef, beta, chunk, k):
    """(idx uint16[K], codes uint8[K], levels float32[2 * chunks]); `ef` is updated in place."""
    nch, kk = check_compress(x, ef, chunk, k)
    n = x.size
    np.multiply(ef, _F32(beta), out=ef)
    np.add(ef, x, out=ef)
    idx = np.empty(kk, np.uint16)
    codes = np.empty(kk, np.uint8)
    levels = np.empty(2 * nch, _F32)
    bits = (ef.view(np.uint32) & np.uint32(0x7FFFFFFF)).astype(_U64)
    for c in range(nch):
        a, b = c * chunk, min(n, (c + 1) * chunk)
        length, kc, off = b - a, min(k, b - a), c * k
        key = (bits[a:b] << _U64(32)) | (_LOW32 - np.arange(length, dtype=_U64))
        thr = np.partition(key, length - kc)[length - kc]
        sel = np.flatnonzero(key >= thr)  # exactly kc: keys are unique; ascending
        v = ef[a + sel]
        mag = np.abs(v)
        t, s = mag.min(), mag.max()
        mid = t * _F32(0.5) + s * _F32(0.5)  # no overflow, unlike (t + s) / 2
        hi = mag > mid
        lo_l = _mean(mag[~hi])
        hi_l = _mean(mag[hi]) if hi.any() else lo_l
        neg = np.signbit(v)
        idx[off:off + kc] = sel
        codes[off:off + kc] = (neg.astype(np.uint8) << 1) | hi.astype(np.uint8)
        levels[2 * c], levels[2 * c + 1] = lo_l, hi_l
        dec = np.where(hi, hi_l, lo_l).astype(_F32)
        ef[a + sel] = v - np.where(neg, -dec, dec)
    return idx, codes, levels


def _mean(m: np.ndarray) -> np.float32:
    # cumsum is a sequential sum (np.sum is pairwise): the order the numba loop uses
    return _F32(np.cumsum(m.astype(_F64))[-1] / _F64(m.size))


def decoded_values(codes, levels, chunk_of) -> np.ndarray:
    """fp32 value of every kept entry: +-lo or +-hi of its chunk."""
    mag = levels[2 * chunk_of + (codes & 1).astype(np.intp)]
    return np.where(codes & 2, -mag, mag).astype(_F32)


def decode_add(idx, codes, levels, acc, chunk, k, mul=1.0):
    """acc[kept positions] += float64(value) * mul; acc is float64[n], updated in place."""
    nch, kk = counts(acc.size, chunk, k)
    if idx.size != kk or codes.size != kk or levels.size != 2 * nch or acc.dtype != _F64:
        raise ValueError("idx/codes/levels do not match (n, chunk, k), or acc is not float64")
    chunk_of = np.arange(kk) // k
    pos = chunk_of * chunk + idx.astype(np.intp)
    acc[pos] += decoded_values(codes, levels, chunk_of).astype(_F64) * _F64(mul)
    return acc


# -- wire layout ---------------------------------------------------------------------------
def low_bits(chunk: int, k: int) -> int:
    """Elias-Fano low bits per index: floor(log2(chunk / k)) (the size-optimal split)."""
    return max(0, (chunk // k).bit_length() - 1)


def _segments(n: int, chunk: int, k: int):
    """(kept per chunk, high-bitvector bits per chunk, start bit of each chunk's bitvector)."""
    nch, _ = counts(n, chunk, k)
    lengths = np.minimum(chunk, n - np.arange(nch) * chunk)
    kc = np.minimum(k, lengths)
    seg = kc + ((lengths - 1) >> low_bits(chunk, k)) + 1
    return kc, seg, np.concatenate(([0], np.cumsum(seg)[:-1]))


def payload_nbytes(n: int, chunk: int, k: int) -> int:
    nch, kk = counts(n, chunk, k)
    _, seg, _ = _segments(n, chunk, k)
    return 8 * nch + -(-kk * low_bits(chunk, k) // 8) + -(-int(seg.sum()) // 8) + -(-kk // 4)


def pack(idx, codes, levels, n: int, chunk: int, k: int) -> bytes:
    """levels | low bits | high bitvectors | codes (the layout in the module docstring)."""
    nch, kk = counts(n, chunk, k)
    if idx.size != kk or codes.size != kk or levels.size != 2 * nch:
        raise ValueError("idx/codes/levels do not match (n, chunk, k)")
    L = low_bits(chunk, k)
    i = idx.astype(np.int64)
    chunk_of = np.arange(kk) // k
    rank = np.arange(kk) - chunk_of * k
    _, seg, start = _segments(n, chunk, k)
    lows = ((i[:, None] >> np.arange(L)) & 1).astype(np.uint8).reshape(-1)
    pos = (i >> L) + rank
    if (pos >= seg[chunk_of]).any():
        raise ValueError("index beyond its chunk")
    highs = np.zeros(int(seg.sum()), np.uint8)
    highs[start[chunk_of] + pos] = 1
    c = np.zeros(-(-kk // 4) * 4, np.uint8)
    c[:kk] = codes
    c = c.reshape(-1, 4)
    cb = c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)
    return (levels.astype("<f4").tobytes() + np.packbits(lows, bitorder="little").tobytes()
            + np.packbits(highs, bitorder="little").tobytes() + cb.astype(np.uint8).tobytes())


def _bits(raw: np.ndarray, a: int, nbits: int, what: str) -> tuple[np.ndarray, int]:
    """nbits little-endian bits from raw[a:], and the offset after them; padding must be 0."""
    b = a + -(-nbits // 8)
    bits = np.unpackbits(raw[a:b], bitorder="little")
    if bits[nbits:].any():
        raise SparseFormatError(f"nonzero {what} padding")
    return bits[:nbits], b


def unpack(buf: bytes, n: int, chunk: int, k: int):
    """(idx, codes, levels) from `pack`'s bytes; raises SparseFormatError on anything else."""
    nch, kk = counts(n, chunk, k)
    if len(buf) != payload_nbytes(n, chunk, k):
        raise SparseFormatError(f"payload of {len(buf)} bytes, expected {payload_nbytes(n, chunk, k)}")
    raw = np.frombuffer(buf, np.uint8)
    levels = raw[:8 * nch].view("<f4").astype(_F32)
    lv = levels.reshape(-1, 2)
    if not np.isfinite(levels).all() or (lv[:, 0] < 0).any() or (lv[:, 1] < lv[:, 0]).any():
        raise SparseFormatError("levels not finite, negative or lo > hi")
    L = low_bits(chunk, k)
    kc, seg, start = _segments(n, chunk, k)
    lows, a = _bits(raw, 8 * nch, kk * L, "low-bit")
    highs, a = _bits(raw, a, int(seg.sum()), "high-bit")
    if not np.array_equal(np.add.reduceat(highs.astype(np.int64), start), kc):
        raise SparseFormatError("high bitvector does not hold k indices per chunk")
    chunk_of = np.arange(kk) // k
    high = np.flatnonzero(highs) - start[chunk_of] - (np.arange(kk) - chunk_of * k)
    low = (lows.reshape(kk, L).astype(np.int64) << np.arange(L)).sum(1) if L else np.zeros(kk, np.int64)
    idx = (high << L) | low
    cb = raw[a:]
    c = np.stack([cb & 3, (cb >> 2) & 3, (cb >> 4) & 3, cb >> 6], axis=1).reshape(-1)
    if c[kk:].any():
        raise SparseFormatError("nonzero code padding")
    lengths = np.minimum(chunk, n - chunk_of * chunk)
    if (idx >= lengths).any():
        raise SparseFormatError("index beyond its chunk")
    same = chunk_of[1:] == chunk_of[:-1]
    if (idx[1:][same] <= idx[:-1][same]).any():
        raise SparseFormatError("indices not strictly ascending within a chunk")
    return idx.astype(np.uint16), c[:kk].astype(np.uint8), levels
