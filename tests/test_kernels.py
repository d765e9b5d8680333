"""int8 all-reduce kernels: numba/numpy bit parity, determinism, ring accuracy, edge cases."""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from p2ptrain import kernels as K
from p2ptrain.kernels import quant as NB
from p2ptrain.kernels import reference as NP

BLOCKS = [16, 64, 7]  # default; another multiple of 16 (vector path); odd (scalar path)


def _data(n: int, seed: int, kind: str = "gauss") -> np.ndarray:
    """Fresh random fp32 data; heavy-tailed = Student t with 2 degrees of freedom, whose
    blocks mix tiny and huge magnitudes. Scaled by a random power of ten."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) if kind == "gauss" else rng.standard_t(2, n)
    return (x * 10.0 ** rng.integers(-6, 4)).astype(np.float32)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical (NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def _lengths(block: int) -> list[int]:
    sup = NP.SUBS_PER_SUPER * block
    return sorted({1, 7, block - 1 or 1, block + 1, sup - 1, sup + 1, 3 * sup + 5, 65_537,
                   1_000_003})


CASES = [(n, b, kind) for b in BLOCKS for n in _lengths(b) for kind in ("gauss", "heavy")]


@pytest.fixture(params=["pool", "serial"])
def numba_threads(request):
    """Both numba paths: the parallel region (default threads) and the direct per-tile loop
    the ring takes with one thread per caller."""
    saved = numba.get_num_threads()
    numba.set_num_threads(1 if request.param == "serial" else numba.config.NUMBA_NUM_THREADS)
    yield request.param
    numba.set_num_threads(saved)


@pytest.mark.parametrize("n,block,kind", CASES)
def test_parity_all_kernels(n, block, kind, numba_threads):
    seed = n * 31 + block
    x, local, acc = _data(n, seed, kind), _data(n, seed + 1, kind), _data(n, seed + 2)
    qa, ma = NB.quantize(x, block)
    qb, mb = NP.quantize(x, block)
    assert _same(qa, qb) and _same(ma, mb)
    assert ma.size == NP.meta_nbytes(n, block) and qa.size + ma.size == K.quantized_nbytes(n, block)
    assert _same(NB.dequantize(qa, ma, block), NP.dequantize(qb, mb, block))
    assert _same(NB.dequantize_add(qa, ma, acc.copy(), block),
                 NP.dequantize_add(qb, mb, acc.copy(), block))
    ha, hb = NB.ring_hop(qa, ma, local, block), NP.ring_hop(qb, mb, local, block)
    assert all(_same(u, v) for u, v in zip(ha, hb))
    oa, ob = NB.owner_hop(qa, ma, local, 1 / 3, block), NP.owner_hop(qb, mb, local, 1 / 3, block)
    assert all(_same(u, v) for u, v in zip(oa, ob))


def test_rounding_half_to_even_and_no_clipping():
    # super-block max 127 * 255 gives S = 1 (bf16 0x3F80); a sub-block max of 127 * 128 gives
    # m = 128, so its step is 128 and 1/128 is exact: x = (k + 0.5) * 128 are exact ties
    x = np.zeros(256, np.float32)
    x[15] = 127 * 255
    x[31] = 127 * 128
    x[16:28] = (np.arange(-6, 6) + 0.5) * 128
    for mod in (NB, NP):
        q, meta = mod.quantize(x)
        assert list(meta[:4]) == [0x80, 0x3F, 255, 128]  # bf16 1.0 little-endian, m0, m1
        assert list(q[16:28]) == [-6, -4, -4, -2, -2, 0, 0, 2, 2, 4, 4, 6]
    # the bf16 scale is rounded up: no value ever needs more than 127 steps
    x = _data(1_000_003, 7, "heavy")
    q, meta = K.quantize(x)
    d = NP._steps(meta, x.size, K.DEFAULT_BLOCK)
    ratio = np.abs(x) / np.repeat(d, K.DEFAULT_BLOCK)[: x.size]
    assert ratio.max() <= 127.5


@pytest.mark.parametrize("block", BLOCKS)
def test_deterministic_across_runs_and_thread_counts(block):
    n = 1_000_003
    x, local = _data(n, 11), _data(n, 12, "heavy")
    saved = numba.get_num_threads()
    results = []
    try:
        for threads in (numba.config.NUMBA_NUM_THREADS, 1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            q, m = NB.quantize(x, block)
            owner = NB.owner_hop(q, m, local, 0.25, block)
            results.append((q, m, *owner, NB.dequantize(q, m, block)))
    finally:
        numba.set_num_threads(saved)
    for other in results[1:]:
        assert all(_same(u, v) for u, v in zip(results[0], other))


@pytest.mark.parametrize("peers", [2, 3, 4, 7])
def test_ring_error_bound(peers):
    """The issue's accuracy target: relative L2 error vs the exact fp32 mean <= 1.0 %, with
    re-quantization at every hop; all peers end bit-identical; both backends agree."""
    n = (1 << 20) + 3
    ts = [_data(n, 100 + p) / np.float32(10.0 ** np.random.default_rng(100 + p).integers(-6, 4))
          for p in range(peers)]  # unit-variance gaussians
    exact = np.mean(np.stack(ts).astype(np.float64), axis=0)
    per_peer = K.simulate_ring_mean(ts, kernels=NB, return_all=True)
    assert all(_same(per_peer[0], r) for r in per_peer[1:])
    err = np.linalg.norm(per_peer[0] - exact) / np.linalg.norm(exact)
    assert err <= 0.010, f"{peers} peers: {100 * err:.3f} %"
    assert _same(per_peer[0], NP.simulate_ring_mean(ts, kernels=NP))


def test_single_quantization_error():
    x = _data(1 << 20, 5)
    err = np.linalg.norm(K.dequantize(*K.quantize(x)) - x) / np.linalg.norm(x)
    assert err < 0.0055  # ~0.49 % measured; plain int8 floor on gaussian data is ~0.6 %


@pytest.mark.parametrize("mod", [NB, NP], ids=["numba", "numpy"])
def test_owner_hop_matches_forwarded_bytes(mod):
    n, block = 100_003, 16
    q, m = mod.quantize(_data(n, 21), block)
    local = _data(n, 22)
    q_out, m_out, out = mod.owner_hop(q, m, local, 0.25, block)
    # every other peer dequantizes the forwarded bytes: the owner's result is bit-identical
    assert _same(out, mod.dequantize(q_out.copy(), m_out.copy(), block))
    assert _same(out, NP.dequantize(q_out, m_out, block))
    # ... and it is the quantized value, not the unquantized fp32 sum
    exact = (NP.dequantize(q, m, block) + local) * np.float32(0.25)
    assert not np.array_equal(out, exact)
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 0.01


@pytest.mark.parametrize("mod", [NB, NP], ids=["numba", "numpy"])
def test_zero_blocks(mod):
    n = 256 * 300 + 5
    x = _data(n, 31)
    x[:256] = 0  # a whole super-block
    x[512 + 32: 512 + 48] = 0  # one sub-block inside a non-zero super-block
    x[-5:] = 0  # the final partial super-block
    q, meta = mod.quantize(x)
    y = mod.dequantize(q, meta)
    assert np.isfinite(y).all()
    assert not y[:256].any() and not y[512 + 32: 512 + 48].any() and not y[-5:].any()
    assert meta[0] == meta[1] == 0  # the zero super-block's scale
    z = np.zeros(n, np.float32)
    qz, mz = mod.quantize(z)
    assert not qz.any() and not mz.any() and not mod.dequantize(qz, mz).any()
    q2, m2, out = mod.owner_hop(qz, mz, z, 0.5)
    assert not q2.any() and not out.any() and np.isfinite(out).all()


@pytest.mark.parametrize("mod", [NB, NP], ids=["numba", "numpy"])
def test_non_finite_poisons_only_its_super_block(mod):
    n = 256 * 10
    x = _data(n, 41)
    x[300], x[1000], x[-1] = np.nan, np.inf, -np.inf
    y = mod.dequantize(*mod.quantize(x))
    bad = np.zeros(n, bool)
    bad[256:512] = bad[768:1024] = bad[-256:] = True
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()
    q, m = mod.quantize(x)
    q2, m2 = mod.ring_hop(q, m, _data(n, 42))  # stays NaN through later hops
    assert np.isnan(mod.dequantize(q2, m2)[bad]).all()


def test_tiny_and_empty_inputs():
    for mod in (NB, NP):
        q, m = mod.quantize(np.zeros(0, np.float32))
        assert q.size == 0 and m.size == 0 and mod.dequantize(q, m).size == 0
        q, m = mod.quantize(np.array([-2.5], np.float32))
        assert mod.dequantize(q, m)[0] == pytest.approx(-2.5, rel=0.01)
    assert K.quantized_nbytes(1) == 1 + 2 + 1
    assert K.quantized_nbytes(256) == 256 + 2 + 16
    assert K.quantized_nbytes(257, 16) == 257 + 4 + 17
    assert K.quantized_nbytes(1000, 7) == 1000 + 2 * 9 + 143
    assert K.split_bounds(1000, 3) == [0, 256, 512, 1000]
    assert K.split_bounds(10, 4) == [0, 0, 0, 0, 10]


@pytest.mark.parametrize("mod", [NB, NP], ids=["numba", "numpy"])
def test_argument_checks(mod):
    x = np.ones(100, np.float32)
    with pytest.raises(TypeError):
        mod.quantize(x.astype(np.float64))
    with pytest.raises(ValueError):
        mod.quantize(x[::2])
    with pytest.raises(ValueError):
        mod.quantize(x, 0)
    q, m = mod.quantize(x)
    with pytest.raises(ValueError):
        mod.dequantize(q, m[:-1])
    with pytest.raises(ValueError):
        mod.ring_hop(q, m, x[:50])
    with pytest.raises(TypeError):
        mod.dequantize(q.view(np.uint8), m)


def test_backend_switch_env_var():
    code = ("import sys; from p2ptrain import kernels as K; import numpy as np; "
            "x = np.random.default_rng(0).standard_normal(5000).astype(np.float32); "
            "r = K.simulate_ring_mean([x, -x, x]); "
            "print(K.BACKEND, 'numba' in sys.modules, K.quantize is K.reference.quantize, "
            "float(np.abs(r - x / 3).max()) < 0.05)")
    env = dict(os.environ, P2PTRAIN_KERNELS="numpy")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd="/")
    assert out.stdout.split() == ["numpy", "False", "True", "True"]
    env["P2PTRAIN_KERNELS"] = "cuda"
    bad = subprocess.run([sys.executable, "-c", "import p2ptrain.kernels"], env=env,
                         capture_output=True, text=True, cwd="/")
    assert bad.returncode != 0 and "P2PTRAIN_KERNELS" in bad.stderr
    assert K.BACKEND == os.environ.get("P2PTRAIN_KERNELS", "numba")


@pytest.mark.parametrize("mod", [NB, NP], ids=["numba", "numpy"])
def test_in_place_outputs(mod):
    n, block = 70_001, 16
    q, m = NP.quantize(_data(n, 51), block)
    local = _data(n, 52)
    want_hop = NP.ring_hop(q, m, local, block)
    want_owner = NP.owner_hop(q, m, local, 0.5, block)
    qi, mi = q.copy(), m.copy()
    assert all(_same(u, v) for u, v in zip(mod.ring_hop(qi, mi, local, block, qi, mi), want_hop))
    qi, mi, li = q.copy(), m.copy(), local.copy()
    got = mod.owner_hop(qi, mi, li, 0.5, block, qi, mi, li)
    assert got[2] is li and all(_same(u, v) for u, v in zip(got, want_owner))
