"""The int8 kernels' typed constants and explicit 16-lane LLVM vector helpers (numba
intrinsics), used by `superblock.py`. Why explicit vectors: numba's own vectorization of the
same loops proved fragile (see quant.py). Plain IEEE arithmetic without fast-math flags, so
every lane equals the scalar path's result (and numpy's).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .reference import (
    MMAX,
    QMAX,
    SUBS_PER_SUPER,
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


_F32x8 = ir.VectorType(ir.FloatType(), 8)
_F64x8 = ir.VectorType(ir.DoubleType(), 8)


@intrinsic
def _sqacc8(typingctx, x, nvec, lanes):
    """lanes[j] += float64(x[8i + j])^2 for i = 0..nvec-1, in that order per lane: the
    reference's lane order exactly, with the eight lanes in one <8 x double> register. Why
    explicit: without fast-math flags LLVM keeps eight scalar chains here (32 ms per 16M
    values against ~4 ms), and fast-math would let it reassociate a lane's sum. fmul then
    fadd, never contracted to an FMA (no `contract` flag): numpy rounds the square first."""
    def codegen(context, builder, sig, args):
        acc0 = builder.load(_vptr(context, builder, sig.args[2], args[2], ir.Constant(_I64, 0), _F64x8), align=1)
        acc = cgutils.alloca_once_value(builder, acc0)
        with cgutils.for_range(builder, args[1]) as loop:
            off = builder.mul(loop.index, ir.Constant(loop.index.type, 8))
            v = builder.fpext(_load(context, builder, sig, args, 0, off, _F32x8), _F64x8)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(v, v)), acc)
        _store(context, builder, sig, args, 2, ir.Constant(_I64, 0), builder.load(acc))
        return context.get_dummy_value()

    return types.none(x, nvec, lanes), codegen


_I8x8 = ir.VectorType(ir.IntType(8), 8)
_I32x8 = ir.VectorType(_I32, 8)


@intrinsic
def _sqq8(typingctx, q, qo, meta, mo, S, lanes):
    """lanes[j] += (d_j * d_j) * sum(q[qo + 16j : qo + 16j + 16]^2) for j = 0..7, with
    d_j = S * meta[mo + j] in fp32 as dequantize computes it, widened to float64: eight
    sub-blocks of 16 values (`quant.sumsq_q8`), their terms in one <8 x double> register. The
    integer sums are exact in any order (at most 16 * 127^2); no FMA contraction, as in
    `_sqacc8`: the reference squares d first, then multiplies."""
    def codegen(context, builder, sig, args):
        isq = ir.Constant(_I32x8, ir.Undefined)
        for j in range(8):
            off = builder.add(args[1], ir.Constant(args[1].type, 16 * j))
            v = builder.sext(_load(context, builder, sig, args, 0, off, _I8x), _I32x)
            s = _vcall(builder, "llvm.vector.reduce.add.v16i32", _I32, builder.mul(v, v))
            isq = builder.insert_element(isq, s, ir.Constant(_I32, j))
        m = builder.load(_vptr(context, builder, sig.args[2], args[2], args[3], _I8x8), align=1)
        sv = builder.insert_element(ir.Constant(_F32x8, ir.Undefined), args[4], ir.Constant(_I32, 0))
        sv = builder.shuffle_vector(sv, sv, ir.Constant(_I32x8, [0] * 8))
        d = builder.fpext(builder.fmul(sv, builder.uitofp(m, _F32x8)), _F64x8)
        term = builder.fmul(builder.fmul(d, d), builder.sitofp(isq, _F64x8))
        lp = _vptr(context, builder, sig.args[5], args[5], ir.Constant(_I64, 0), _F64x8)
        builder.store(builder.fadd(builder.load(lp, align=1), term), lp, align=1)
        return context.get_dummy_value()

    return types.none(q, qo, meta, mo, S, lanes), codegen
