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
"""

from __future__ import annotations

import numpy as np
import numba
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .reference import (  # noqa: F401  (re-exported: same layout helpers on both backends)
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

# Globals are frozen as typed constants: fp32 / int32 / uint64 ones keep every operation in
# the intended type (a float64 literal would silently promote and break parity with numpy).
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_FINF = np.float32(np.inf)
_F_QMAX = np.float32(QMAX)
_F_NQMAX = np.float32(-QMAX)
_F_MMAX = np.float32(MMAX)
_F_SDIV = np.float32(QMAX * MMAX)
_ABS = np.int32(0x7FFFFFFF)
_EXP = np.int32(0x7F800000)
_LO16 = np.int32(0xFFFF)
_HI16 = np.int32(-65536)  # ~0xFFFF
_ONE16 = np.int32(0x10000)
_NAN16 = np.int32(0x7FC0)
_G = SUBS_PER_SUPER
_UG = np.uint64(SUBS_PER_SUPER)
_U1 = np.uint64(1)
_V = np.uint64(16)  # lanes of the explicit vector helpers
# _TILE super-blocks form one parallel work item; tiling never changes a result bit.
_TILE = 64

# ------------------------------------------------------------------ explicit 16-lane helpers
# Plain IEEE arithmetic without fast-math flags, so every lane equals the scalar path's result
# (and numpy's). Offsets are element offsets; the caller guarantees 16 lanes in bounds.
_I32, _I64 = ir.IntType(32), ir.IntType(64)
_I8x = ir.VectorType(ir.IntType(8), 16)
_I32x = ir.VectorType(_I32, 16)
_F32x = ir.VectorType(ir.FloatType(), 16)
_INF = float("inf")


def _cv(vty, value):
    return ir.Constant(vty, [value] * 16)


def _vptr(context, builder, aryty, ary, off, vty):
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [off]), vty.as_pointer())


def _splat(builder, v):
    vec = builder.insert_element(ir.Constant(_F32x, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, vec, _cv(_I32x, 0))


def _vcall(builder, name, retty, *args):
    fnty = ir.FunctionType(retty, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), list(args))


def _load(context, builder, sig, args, i, off, vty):
    """Load 16 lanes from array argument i at element offset `off`."""
    return builder.load(_vptr(context, builder, sig.args[i], args[i], off, vty), align=1)


def _store(context, builder, sig, args, i, off, value):
    builder.store(value, _vptr(context, builder, sig.args[i], args[i], off, value.type), align=1)


def _abs_max(builder, v_f32):
    bits = builder.and_(builder.bitcast(v_f32, _I32x), _cv(_I32x, 0x7FFFFFFF))
    return _vcall(builder, "llvm.vector.reduce.smax.v16i32", _I32, bits)


@intrinsic
def _absmax16(typingctx, src, so):
    """Max abs-bits (see reference.py) of src[so:so+16]."""
    def codegen(context, builder, sig, args):
        return _abs_max(builder, _load(context, builder, sig, args, 0, args[1], _F32x))

    return types.int32(src, so), codegen


def _make_quant16(deq):
    def _quant16(typingctx, src, so, inv, d, q, qo, out):
        def codegen(context, builder, sig, args):
            x = _load(context, builder, sig, args, 0, args[1], _F32x)
            r = builder.fmul(x, _splat(builder, args[2]))
            r = _vcall(builder, "llvm.rint.v16f32", _F32x, r)
            lo, hi = _cv(_F32x, -float(QMAX)), _cv(_F32x, float(QMAX))
            r = builder.select(builder.fcmp_ordered("<", r, lo), lo, r)
            r = builder.select(builder.fcmp_ordered(">", r, hi), hi, r)
            qv = builder.fptosi(r, _I8x)
            _store(context, builder, sig, args, 4, args[5], qv)
            if deq:  # r + 0.0 is float(q) exactly (-0.0 becomes +0.0): no int8 round trip
                r = builder.fadd(r, _cv(_F32x, 0.0))
                v = builder.fmul(r, _splat(builder, args[3]))
                _store(context, builder, sig, args, 6, args[5], v)
            return context.get_dummy_value()

        return types.none(src, so, inv, d, q, qo, out), codegen

    _quant16.__doc__ = ("q[qo:qo+16] = int8(clamp(rint(src[so:so+16] * inv), -127, 127))"
                        + ("; out[qo:qo+16] = q * d" if deq else ""))
    return intrinsic(_quant16)


_quant16, _quantdeq16 = _make_quant16(False), _make_quant16(True)


def _deq_vec(context, builder, sig, args):
    qv = _load(context, builder, sig, args, 0, args[1], _I8x)
    return builder.fmul(builder.sitofp(qv, _F32x), _splat(builder, args[2]))


def _make_sum16(scaled):
    def _sum16(typingctx, q, qo, d, y, yo, mul, dst, do):
        def codegen(context, builder, sig, args):
            y = _load(context, builder, sig, args, 3, args[4], _F32x)
            s = builder.fadd(_deq_vec(context, builder, sig, args), y)
            if scaled:
                s = builder.fmul(s, _splat(builder, args[5]))
            _store(context, builder, sig, args, 6, args[7], s)
            return _abs_max(builder, s)

        return types.int32(q, qo, d, y, yo, mul, dst, do), codegen

    _sum16.__doc__ = ("dst[do:do+16] = q[qo:qo+16] * d + y[yo:yo+16]"
                      + (", times mul" if scaled else "") + "; returns their max abs-bits.")
    return intrinsic(_sum16)


_sum16, _sumscaled16 = _make_sum16(False), _make_sum16(True)


@intrinsic
def _steps16(typingctx, subbits, S, meta, mo, dsub):
    """For a full super-block with scale S > 0: m = min(ceil(sub_absmax / (S * 127)), 255),
    d = S * m and inv = 1 / d, all three 0 where inv is not finite (flushed sub-block);
    m into meta[mo:mo+16], d into dsub[0:16], inv into dsub[16:32]."""
    def codegen(context, builder, sig, args):
        zero, z = ir.Constant(_I64, 0), _cv(_F32x, 0.0)
        sam = builder.bitcast(_load(context, builder, sig, args, 0, zero, _I32x), _F32x)
        S127 = builder.fmul(args[1], ir.Constant(ir.FloatType(), float(QMAX)))
        c = _vcall(builder, "llvm.ceil.v16f32", _F32x, builder.fdiv(sam, _splat(builder, S127)))
        top = _cv(_F32x, float(MMAX))
        c = builder.select(builder.fcmp_ordered(">", c, top), top, c)
        d = builder.fmul(_splat(builder, args[1]), c)
        inv = builder.fdiv(_cv(_F32x, 1.0), d)
        ok = builder.fcmp_ordered("<", inv, _cv(_F32x, _INF))
        m = builder.fptoui(builder.select(ok, c, z), _I8x)
        _store(context, builder, sig, args, 2, args[3], m)
        _store(context, builder, sig, args, 4, zero, builder.select(ok, d, z))
        _store(context, builder, sig, args, 4, ir.Constant(_I64, 16), builder.select(ok, inv, z))
        return context.get_dummy_value()

    return types.none(subbits, S, meta, mo, dsub), codegen


def _make_deq16(add):
    def _deq16(typingctx, q, qo, d, out):
        def codegen(context, builder, sig, args):
            v = _deq_vec(context, builder, sig, args)
            if add:
                v = builder.fadd(_load(context, builder, sig, args, 3, args[1], _F32x), v)
            _store(context, builder, sig, args, 3, args[1], v)
            return context.get_dummy_value()

        return types.none(q, qo, d, out), codegen

    _deq16.__doc__ = f"out[qo:qo+16] {'+' if add else ''}= q[qo:qo+16] * d."
    return intrinsic(_deq16)


_deq16, _deqadd16 = _make_deq16(False), _make_deq16(True)


@intrinsic
def _bits(typingctx, x):
    """fp32 -> int32 bit pattern."""
    return types.int32(types.float32), lambda ctx, b, sig, a: b.bitcast(a[0], _I32)


@intrinsic
def _float(typingctx, b):
    """Low 32 bits of an integer (numba widens int32 arithmetic to int64) -> fp32."""
    def codegen(context, builder, sig, args):
        v = args[0] if b.bitwidth == 32 else builder.trunc(args[0], _I32)
        return builder.bitcast(v, ir.FloatType())

    return types.float32(b), codegen


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
