"""The verified path's sums of squares (`contribution.sumsq64`, `kernels.sumsq`, and
`kernels.sumsq_q8` for int8 frames, from the payload): float64 without BLAS (whose spinning thread pool cost ~0.5 CPU s per member per 64 MiB round in the
emulated internet), the numba kernel bit-identical to its numpy reference, non-finite iff a
value is, and FrameChecker still holds a frame to its signed norm with them."""

from __future__ import annotations

import numpy as np
import pytest

from p2ptrain.kernels import quant as NB
from p2ptrain.kernels import reference as NP
from p2ptrain.run.contribution import BadContribution, FrameChecker, Header, sumsq64


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4097, 1_000_003])
def test_sumsq_kernel_is_bit_identical_to_its_reference(n):
    rng = np.random.default_rng(n)
    for scale in (1e-6, 1.0, 1e6):
        x = (rng.standard_t(2, n) * scale).astype(np.float32)
        a, b = NP.sumsq(x), NB.sumsq(x)
        assert np.float64(a).tobytes() == np.float64(b).tobytes(), (n, scale, a, b)
        assert a == pytest.approx(float(np.sum(x.astype(np.float64) ** 2)), rel=1e-12)
        if n > 3:  # a view at an odd offset (a ring sub-chunk): unaligned vector loads
            assert np.float64(NP.sumsq(x[3:])).tobytes() == np.float64(NB.sumsq(x[3:])).tobytes()


def test_sumsq_is_non_finite_iff_a_value_is():
    x = np.ones(1001, np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, 500, 1000):  # a lane, the middle, the tail
            y = x.copy()
            y[at] = bad
            assert not np.isfinite(NB.sumsq(y)) and not np.isfinite(NP.sumsq(y))
    big = np.full(1 << 16, np.finfo(np.float32).max, np.float32)
    assert np.isfinite(NB.sumsq(big))  # fp32 extremes square finitely in float64


def test_sumsq64_matches_a_float64_dot():
    x = np.random.default_rng(3).standard_normal(1 << 22).astype(np.float32) + np.float32(3.0)
    ref = float(np.dot(x.astype(np.float64), x.astype(np.float64)))
    assert sumsq64(x) == pytest.approx(ref, rel=1e-12)
    assert sumsq64(x[:0]) == 0.0
    assert sumsq64(x[::2]) == pytest.approx(float(np.sum(x[::2].astype(np.float64) ** 2)), rel=1e-12)


def _header(m: str, norms: tuple[float, ...]) -> Header:
    return Header("run", 0, 0, "r" * 64, m, norms, ("d" * 64,), float(np.sqrt(sum(n * n for n in norms))), 1, 0)


def test_frame_checker_bounds_partial_sums_by_the_signed_norms():
    members = ["a", "b", "c"]
    v = np.full(1000, 0.1, np.float32)
    norm = float(np.sqrt(sumsq64(v)))
    headers = {m: _header(m, (norm, norm, norm)) for m in members}
    ok = FrameChecker(members, headers, 1, [1, 1, 1])
    ok.check(1, 0, 0, b"", sumsq64(v * 2))  # a partial sum of two members: within 2 x norm
    nan = v.copy()
    nan[7] = np.nan
    for sq in (sumsq64(nan), float("inf"), float(np.finfo(np.float32).max) ** 2 * 1.01):
        # the last: finite in float64, but some value of the frame overflows fp32
        with pytest.raises(BadContribution, match="non-finite"):
            FrameChecker(members, headers, 1, [1, 1, 1]).check(1, 0, 0, b"", sq)
    with pytest.raises(BadContribution, match="exceeds the signed bound"):
        FrameChecker(members, headers, 1, [1, 1, 1]).check(1, 0, 0, b"", sumsq64(v * 2.2))


@pytest.mark.parametrize("block", [16, 8, 32, 7])
@pytest.mark.parametrize("n", [0, 1, 15, 255, 256, 257, 4097, 1_000_003])
def test_sumsq_q8_is_the_decoded_sum_of_squares_without_decoding(n, block):
    """Bit-identical to its reference on both paths (the 16-lane one at block 16 on whole
    super-blocks, the scalar one elsewhere), equal to the decoded values' sum of squares up
    to rounding, over a 40-decade dynamic range, and unaligned (a ring frame's q and meta)."""
    rng = np.random.default_rng(n + block)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-20, 20, n)).astype(np.float32)
    q, meta = NB.quantize(x, block)
    a, b = NB.sumsq_q8(q, meta, block), NP.sumsq_q8(q, meta, block)
    assert np.float64(a).tobytes() == np.float64(b).tobytes(), (n, block, a, b)
    assert a == pytest.approx(NB.sumsq(NB.dequantize(q, meta, block)), rel=1e-12, abs=0.0)
    wire = np.empty(q.size + meta.size + 3, np.uint8)[3:]  # odd offset, as a frame buffer may be
    wire[:n] = q.view(np.uint8)
    wire[n:] = meta
    assert NB.sumsq_q8(wire[:n].view(np.int8), wire[n:], block) == a


def test_sumsq_q8_is_non_finite_exactly_where_a_decoded_value_is():
    x = np.random.default_rng(5).standard_normal(1 << 12).astype(np.float32)
    for at in (0, 300, 4095):  # the first super-block, a middle one, the last
        y = x.copy()
        y[at] = np.nan  # the quantizer marks its super-block NaN
        q, meta = NB.quantize(y)
        for K in (NB, NP):
            assert not np.isfinite(K.sumsq_q8(q, meta))
    q, meta = NB.quantize(x)
    hostile = meta.copy()
    hostile[2:4] = [0x80, 0x7F]  # super-block 1's scale is +inf: inf * m, or inf * 0 = NaN
    for K in (NB, NP):
        assert not np.isfinite(K.sumsq_q8(q, hostile))
        assert not np.isfinite(K.sumsq(K.dequantize(q, hostile)))
    zero_q = np.zeros_like(q)
    for K in (NB, NP):  # inf steps over zeros decode to NaN (0 * inf): still non-finite
        assert not np.isfinite(K.sumsq_q8(zero_q, hostile))


@pytest.mark.parametrize("world,threads", [(1, 4), (3, 1), (4, 2), (4, 8)])
def test_chunk_norms_on_helper_threads_are_bit_identical(world, threads):
    """The signer starts the chunk norms on helper threads and hashes its frames meanwhile
    (`start_chunk_norms`): the header must sign the very numbers `chunk_norms` gives."""
    from p2ptrain.reduce import ring
    from p2ptrain.run.contribution import chunk_norms, start_chunk_norms

    x = np.random.default_rng(world).standard_normal(3_000_017, dtype=np.float32)
    lay = ring.layout(x.size, world, ring.RingConfig("int8", sub_chunk_bytes=1 << 20))
    assert start_chunk_norms(x, lay, threads)() == chunk_norms(x, lay)


def test_own_digests_hash_each_frame_as_it_is_encoded_and_stop_when_the_round_ends():
    """`OwnDigests.wait` returns every frame's digest in order, hashing each as soon as the
    ring hands it over; NotEncoded (not a hang) once the round ends short, or at its timeout."""
    import threading
    import time

    from p2ptrain.run.contribution import NotEncoded, OwnDigests, frame_digest

    frames = [bytes([j]) * (1000 + j) for j in range(3)]
    own = OwnDigests(3, timeout=10.0)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(d=own.wait()))
    waiter.start()
    for j, f in enumerate(frames):
        time.sleep(0.01)
        own(j, memoryview(f))
    waiter.join(5)
    assert got["d"] == tuple(frame_digest(f) for f in frames)

    short = OwnDigests(3, timeout=10.0)
    short(0, memoryview(frames[0]))
    short(-1, None)  # the round ended before frames 1 and 2
    with pytest.raises(NotEncoded):
        short.wait()
    t0 = time.monotonic()
    with pytest.raises(NotEncoded):
        OwnDigests(2, timeout=0.2).wait()
    assert time.monotonic() - t0 < 2
