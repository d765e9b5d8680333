"""Fragment-wise (streaming) outer steps (issue 17; Streaming DiLoCo, arXiv 2501.18512).

A run with `train.fragments = P` splits the flat parameter vector into P fragments and
reduces one of them per outer step: step t carries fragment t mod P, and a phase is H / P
inner steps long, so every fragment is still synchronized every H inner steps, the fragments
staggered by H / P. A round then carries 1/P of the payload, so on a link where the whole
vector's all-reduce takes a whole phase a fragment's round takes H / P steps: its average
lands H / P steps after the round began instead of H (`bench diloco --avg streaming`:
within 1 % of synchronous DiLoCo where whole-vector overlap lost 2-2.5 %, BENCHMARKS.md).

Fragments are strided blocks of the flat vector (block b of BLOCK values belongs to
fragment b mod P): every fragment spans every layer, the paper's "strided" pattern at block
granularity, and a fragment is a few contiguous runs that gather and scatter with numpy
fancy indexing. The committed state (outer params, momentum) stays one full vector that
every member changes identically: a step's Nesterov update touches fragment t mod P only
(`OuterOptimizer.step(index=...)`), in the same operation order as a full step.

Pure logic: no I/O, no trio. Its users: `p2ptrain.train.local` (phase length, the outer
step), `p2ptrain.train.overlap` (contributions and start points per fragment) and the
simulation in `p2ptrain.bench.diloco_stream`.
"""

from __future__ import annotations

import numpy as np

BLOCK = 4096
"""Values per block. 16 KiB of fp32: large enough that indexing runs at memory speed, small
enough that a 0.1M-parameter model still has dozens of blocks to stride."""


def blocks(n: int, block: int = BLOCK) -> int:
    return -(-n // block)


def of_step(t: int, P: int) -> int:
    """The fragment that outer step t reduces."""
    return t % P


def index(n: int, P: int, f: int, block: int = BLOCK) -> np.ndarray:
    """Sorted int64 positions of fragment f of an n-vector: the definition, for tests and
    checks (`Fragments.part` / `put`, which the network uses, build no such array)."""
    if not 0 <= f < P:
        raise ValueError(f"fragment {f} out of range for {P} fragments")
    return np.flatnonzero((np.arange(n, dtype=np.int64) // block) % P == f)


def size(n: int, P: int, f: int, block: int = BLOCK) -> int:
    """Values in fragment f (the length of a step's contribution)."""
    full, rest = divmod(n, block)
    nb = full + (1 if rest else 0)
    count = nb // P + (1 if f < nb % P else 0)
    last = (nb - 1) % P  # the fragment holding the last, possibly short, block
    return count * block - ((block - rest) if rest and f == last else 0)


class Fragments:
    """The fragments of one run's parameter vector: n values, P fragments (1: whole-vector
    steps, where `part` is the vector itself). `part` and `put` work on numpy arrays and
    torch tensors through strided views of the vector's blocks: no index arrays (int64
    positions would cost twice the fp32 vector's memory on a large model)."""

    def __init__(self, n: int, P: int = 1, block: int = BLOCK) -> None:
        self.n, self.P, self.block = n, P, block
        if P > 1 and P > blocks(n, block):
            raise ValueError(f"{P} fragments of {block}-value blocks do not fit a model of {n} values")
        self._full, self._rest = divmod(n, block)
        self._tail_owner = self._full % P  # the short last block's fragment

    def at(self, t: int):
        """Step t's fragment number, or None when P = 1 (everything)."""
        return None if self.P == 1 else of_step(t, self.P)

    def size(self, t: int) -> int:
        return self.n if self.P == 1 else size(self.n, self.P, of_step(t, self.P), self.block)

    def _views(self, vec, t: int):
        f = of_step(t, self.P)
        m = self._full * self.block
        body = vec[:m].reshape(self._full, self.block)[f::self.P]
        return body, (vec[m:] if self._rest and f == self._tail_owner else None)

    def part(self, vec, t: int):
        """Step t's fragment of a full vector, in `index` order: a new array (numpy or torch,
        as `vec`), or `vec` itself when P = 1."""
        if self.P == 1:
            return vec
        body, tail = self._views(vec, t)
        pieces = [body.reshape(-1)] + ([] if tail is None else [tail])
        return np.concatenate(pieces) if isinstance(vec, np.ndarray) else _torch_cat(pieces)

    def put(self, vec, t: int, values) -> None:
        """Write step t's fragment of `vec` (in place) from `values` (`part`'s layout)."""
        if self.P == 1:
            vec[...] = values
            return
        body, tail = self._views(vec, t)
        k = body.shape[0] * self.block
        body[...] = values[:k].reshape(body.shape)
        if tail is not None:
            tail[...] = values[k:]


def _torch_cat(pieces):
    import torch

    return torch.cat(pieces)
