"""The sparse collective (issue 18) between real libp2p nodes in one process, and its pure
codec: identical results on every member, bytes counted on the exchange path, hostile
contributions excluded with a reason, norm rules."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from conftest import each_member

from p2ptrain.identity import Identity
from p2ptrain.kernels import sparse as SK
from p2ptrain.reduce import sparsecodec as codec
from p2ptrain.reduce.service import RoundFailed
from p2ptrain.reduce.sparse import SparseReducer, framed_nbytes
from test_links_service import _cluster

N = 200_001
CFG = codec.SparseConfig(topk_fraction=0.02, chunk=4096)


class _Tamper:
    """A member's service that alters one of its outgoing messages (the rest passes through)."""

    def __init__(self, svc, index: int, how) -> None:
        self.svc, self.index, self.how = svc, index, how

    async def exchange(self, run_id, round_id, members, payload, timeout, **kw):
        if round_id.endswith(f"/sparse/{self.index}"):
            payload = self.how(payload)
        return await self.svc.exchange(run_id, round_id, members, payload, timeout, **kw)


async def _attempt(svcs, nodes, reducers, members, step=1, robust=False):
    return await each_member(len(svcs), lambda i: reducers[i].attempt(
        svcs[i], nodes[i].identity, "run", step, 0, "rh", members, 5.0, robust))


def _reducers(members, seed=0):
    rng = np.random.default_rng(seed)
    reds = []
    for _ in members:
        r = SparseReducer(CFG, N)
        r.prepare((rng.standard_normal(N) * 1e-3).astype(np.float32))
        reds.append(r)
    return reds


@pytest.mark.integration
def test_three_members_agree_bit_for_bit_and_bytes_are_counted():
    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await _cluster(nursery, 3)
            members = [n.identity.peer_id_str for n in nodes]
            reds = _reducers(members)
            res = await _attempt(svcs, nodes, reds, members)
            assert all(not isinstance(r, Exception) for r in res), res
            assert len({r.result.tobytes() for r in res}) == 1 and len({r.digest for r in res}) == 1
            assert all(r.members == members and not r.excluded for r in res)
            # the same sum computed here from the members' own payloads
            dec = {m: SK.unpack(r.payload, N, CFG.chunk, CFG.k) for m, r in zip(members, reds)}
            want = codec.aggregate(dec, members, N, CFG)[0]
            assert np.array_equal(res[0].result, want)
            payload = SK.payload_nbytes(N, CFG.chunk, CFG.k)
            assert all(r.payload_bytes == payload for r in res)
            for r in res:  # sent: 2 members x (header + fragments + vote); received: the same
                assert 2 * payload < r.bytes_sent < 2 * payload * 1.3, (r.bytes_sent, payload)
                assert r.bytes_recv == r.bytes_sent
            nursery.cancel_scope.cancel()

    trio.run(main)


def _bad_levels(frag: bytes) -> bytes:
    return np.float32(np.nan).tobytes() + frag[4:]


@pytest.mark.integration
@pytest.mark.parametrize("index,how,reason", [
    (0, lambda h: h[:-3] + bytes([h[-3] ^ 1]) + h[-2:], "bad-signature"),  # a flipped signature byte
    (1, lambda f: f[:-1] + bytes([f[-1] ^ 1]), "payload digest"),         # a fragment altered in flight
    (1, lambda f: f[:-10], "fragment sizes"),
])
def test_tampered_contribution_is_excluded_with_its_reason(index, how, reason):
    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await _cluster(nursery, 4)
            members = [n.identity.peer_id_str for n in nodes]
            svcs = [*svcs[:3], _Tamper(svcs[3], index, how)]
            reds = _reducers(members, 1)
            res = await _attempt(svcs, nodes, reds, members)
            honest = res[:3]
            assert all(not isinstance(r, Exception) for r in honest), honest
            assert len({r.digest for r in honest}) == 1
            assert all(r.members == members[:3] and r.excluded == {members[3]: reason} for r in honest)
            assert isinstance(res[3], RoundFailed)  # it used itself: its vote differs, nothing applied
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.integration
def test_signed_but_malformed_payload_is_excluded():
    async def main():
        async with trio.open_nursery() as nursery:
            nodes, svcs = await _cluster(nursery, 3)
            members = [n.identity.peer_id_str for n in nodes]
            reds = _reducers(members, 2)
            reds[2].payload = _bad_levels(reds[2].payload)  # NaN level, honestly signed
            res = await _attempt(svcs, nodes, reds, members)
            assert all(r.excluded == {members[2]: "malformed payload: levels not finite, negative or lo > hi"}
                       for r in res[:2]), res
            assert isinstance(res[2], RoundFailed)
            nursery.cancel_scope.cancel()

    trio.run(main)


# -- pure codec ----------------------------------------------------------------------------
def _contrib(scale: float, seed: int, n=20_000, cfg=CFG):
    x = (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)
    parts = SK.compress_ef(x, np.zeros(n, np.float32), cfg.ef_decay, cfg.chunk, cfg.k)
    return SK.unpack(SK.pack(*parts, n, cfg.chunk, cfg.k), n, cfg.chunk, cfg.k)


def test_norm_rules_mean_excludes_robust_clips():
    dec = {f"p{i}": _contrib(1.0, i) for i in range(3)} | {"big": _contrib(100.0, 9)}
    order = ["p0", "big", "p1", "p2"]
    mean, used, excluded, _ = codec.aggregate(dec, order, 20_000, CFG)
    assert used == ["p0", "p1", "p2"] and excluded == {"big": "norm-outlier"}
    rmean, rused, rex, _ = codec.aggregate(dec, order, 20_000, CFG, robust=True)
    assert rused == order and not rex
    norms = [codec.norm(dec[p], 20_000, CFG) for p in order]
    med = sorted(norms)[1] / 2 + sorted(norms)[2] / 2
    assert np.linalg.norm(rmean) <= med + 1e-6  # every sender bounded by the median norm
    # the norm is exact: equal to the decoded vector's
    dense = SK.decode_add(*dec["p0"], np.zeros(20_000), CFG.chunk, CFG.k)
    assert abs(codec.norm(dec["p0"], 20_000, CFG) - np.linalg.norm(dense)) < 1e-9


def test_newcomers_zeros_neither_shrink_the_mean_nor_lower_the_median():
    """Two joiners' zero payloads: the mean is over the three that trained (before: 3/5 of
    it), and the median the outlier rule uses is theirs (before, the zeros pulled it toward
    the smallest trained norm, or to 0: no bar at all)."""
    dec = {f"p{i}": _contrib(1.0 + i, i) for i in range(3)} | {f"j{i}": _contrib(0.0, 20 + i) for i in range(2)}
    order = ["j0", "p0", "p1", "j1", "p2"]
    mean, used, excluded, _ = codec.aggregate(dec, order, 20_000, CFG)
    assert used == order and not excluded
    trained, _, _, _ = codec.aggregate({p: dec[p] for p in ("p0", "p1", "p2")}, ["p0", "p1", "p2"], 20_000, CFG)
    assert np.array_equal(mean, trained)
    assert codec.aggregate(dec, order, 20_000, CFG)[3] == codec.aggregate(dec, order, 20_000, CFG)[3]
    zeros, used0, _, _ = codec.aggregate({p: dec[p] for p in ("j0", "j1")}, ["j0", "j1"], 20_000, CFG)
    assert used0 == ["j0", "j1"] and not zeros.any()  # nobody trained: a zero step, no division by 0


def test_header_checks_bind_step_roster_and_shape():
    ident = Identity.generate()
    parts = SK.compress_ef(np.ones(5000, np.float32), np.zeros(5000, np.float32), 0.9, CFG.chunk, CFG.k)
    payload = SK.pack(*parts, 5000, CFG.chunk, CFG.k)
    hdr = codec.sign_contribution(ident, "run", 3, 0, "rh", 5000, CFG, payload)
    frags = codec.fragments(payload)
    assert codec.verify(ident.peer_id_str, hdr, frags, "run", 3, 0, "rh", 5000, CFG)[0].size > 0
    for args, reason in [(("run", 4, 0, "rh", 5000), "wrong-step"), (("run", 3, 1, "rh", 5000), "attempt"),
                         (("run", 3, 0, "other", 5000), "roster"), (("run", 3, 0, "rh", 5001), "n")]:
        with pytest.raises(codec.BadSparse, match=reason):
            codec.verify(ident.peer_id_str, hdr, frags, *args, CFG)
    other = Identity.generate().peer_id_str
    with pytest.raises(codec.BadSparse, match="bad-signature"):
        codec.verify(other, hdr, frags, "run", 3, 0, "rh", 5000, CFG)
    with pytest.raises(codec.BadSparse, match="oversize"):
        codec.verify(ident.peer_id_str, b"\0" * 2000, frags, "run", 3, 0, "rh", 5000, CFG)
    assert framed_nbytes("run", "1/0/sparse/0", b"x" * codec.FRAGMENT) <= 4096 + 4


def test_run_spec_sparse_fields_are_checked():
    import dataclasses

    from p2ptrain.run.spec import SpecError, TrainSpec

    base = dict(inner_steps=4, group_size=4, outer_lr=1.0, outer_momentum=0.0)
    sparse = dict(allreduce="sparse", topk_fraction=0.02, bits=2, chunk=2048, ef_decay=0.95)
    spec = TrainSpec(**base, **sparse)
    assert spec.sparse_config().chunk == 2048 and spec.to_dict()["topk_fraction"] == 0.02
    assert "topk_fraction" not in TrainSpec(**base).to_dict()  # other runs' ids do not change
    for bad in ({"allreduce": "zip"}, {"bits": 3}, {"chunk": 8192}, {"topk_fraction": 0.0}, {"ef_decay": "x"},
                {"chunk": None}):
        with pytest.raises(SpecError):
            TrainSpec(**base, **{**sparse, **bad})
    with pytest.raises(SpecError):  # compressor fields only in sparse runs
        TrainSpec(**base, topk_fraction=0.02)
    assert dataclasses.replace(spec, ef_decay=0.5).ef_decay == 0.5
