"""The verified path's sums of squares (`contribution.sumsq64`): float64-accurate without
BLAS (whose spinning thread pool cost ~0.5 CPU s per member per 64 MiB round in the emulated
internet), and FrameChecker still holds a frame to its signed norm with them."""

from __future__ import annotations

import numpy as np
import pytest

from p2ptrain.run.contribution import BadContribution, FrameChecker, Header, sumsq64


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
    ok.check(1, 0, 0, b"", v * 2)  # a partial sum of two members: within 2 x norm
    with pytest.raises(BadContribution, match="exceeds the signed bound"):
        FrameChecker(members, headers, 1, [1, 1, 1]).check(1, 0, 0, b"", v * 2.2)
