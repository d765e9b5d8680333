"""The sparse scheme (issue 18) inside `p2ptrain bench diloco`: what the network's sparse
collective computes and sends, without the network."""

from __future__ import annotations


def sparse_mean(deltas: list, efs: list, st):
    """The sparse all-gather's result, as every network member computes it: each worker
    compresses (delta + its error feedback), the decoded contributions are summed in worker
    (roster) order in float64 and divided by M. numpy kernels, for the reason int8 uses them."""
    import numpy as np

    from p2ptrain.kernels import sparse as SK

    k = SK.k_for(st.chunk, st.topk_fraction)
    acc = np.zeros(deltas[0].size, np.float64)
    for d, ef in zip(deltas, efs):
        idx, codes, levels = SK.reference.compress_ef(d, ef, st.ef_decay, st.chunk, k)
        SK.reference.decode_add(idx, codes, levels, acc, st.chunk, k)
    return (acc / len(deltas)).astype(np.float32)


def sparse_wire_nbytes(n: int, st) -> int:
    """Bytes one worker sends one other member per round: the exchange messages of its signed
    contribution (p2ptrain.reduce.sparsecodec), framed exactly as the service writes them."""
    from p2ptrain.reduce.sparse import wire_nbytes
    from p2ptrain.reduce.sparsecodec import SparseConfig

    return wire_nbytes(n, SparseConfig(st.topk_fraction, 2, st.chunk, st.ef_decay), st.workers)
