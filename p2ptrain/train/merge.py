"""A merge round's arithmetic (docs/PROTOCOL.md Part 3, rule M1), as pure torch math.

A round's members may start from different committed outer states (bases). The round
averages the distinct bases weighted by their work, momentum the same way, then applies the
members' mean pseudo-gradient with DiLoCo's Nesterov step from that average. Every member
takes the result, so a run of many groups redrawn each step is gossip averaging (Moshpit SGD,
arXiv 2103.03239).

    distinct bases B_1..B_k (deduplicated by exact params bytes), works W_j
    a_j = W_j / sum W             (1/k each when sum W == 0: nobody has trained yet)
    x_bar = sum_j a_j x_j,  m_bar = sum_j a_j m_j     (one weight per base, not per member)
    m' = mu * m_bar + g,  x' = x_bar - lr * (mu * m' + g)      (Nesterov; heavy ball: - lr * m')
    w' = max_j W_j + trained      (a merge takes the maximum, never the sum: no state gains
                                   work by averaging with itself)

Bit-identical on every member: the bases are taken in a canonical order (their params'
SHA-256), the weights are rounded to fp32 once, and every operation is a separately rounded
multiply or add (as `OuterOptimizer.step`, whose docstring says why), so the result depends
neither on the order members are listed in nor on the CPU. With one base (k == 1) it is
exactly `OuterOptimizer.step` (tests/test_diloco_groups.py checks both bit for bit).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class OuterState:
    """One committed outer state: flat fp32 params and momentum (host), and its work."""
    params: torch.Tensor
    momentum: torch.Tensor
    work: float = 0.0

    def __post_init__(self) -> None:
        if self.params.dtype != torch.float32 or self.momentum.dtype != torch.float32:
            raise ValueError("outer params and momentum must be fp32")
        if self.params.shape != self.momentum.shape or self.params.dim() != 1:
            raise ValueError("outer params and momentum must be flat vectors of one size")
        if not (math.isfinite(self.work) and self.work >= 0):
            raise ValueError(f"work must be finite and >= 0, got {self.work}")

    def params_sha256(self) -> str:
        return hashlib.sha256(_bytes(self.params)).hexdigest()


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().astype("<f4", copy=False).tobytes()


def distinct_bases(states: Sequence[OuterState]) -> list[OuterState]:
    """The distinct states among a round's members, deduplicated by exact params bytes, in
    canonical order (params SHA-256). Two members naming the same params must agree on momentum
    and work: a state is one thing, and a mismatch means the caller mixed up its records."""
    by: dict[str, OuterState] = {}
    for s in states:
        h = s.params_sha256()
        seen = by.setdefault(h, s)
        if seen is not s and (seen.work != s.work or _bytes(seen.momentum) != _bytes(s.momentum)):
            raise ValueError(f"two states with params {h[:12]} differ in momentum or work")
    return [by[h] for h in sorted(by)]


def base_weights(works: Sequence[float]) -> list[float]:
    """a_j = W_j / sum W, or equal weights when no base has work (the genesis, or joiners only)."""
    total = math.fsum(works)
    if total == 0:
        return [1.0 / len(works)] * len(works)
    return [w / total for w in works]


def _weighted_sum(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    # each weight rounded to fp32 once; mul and add separately rounded, in the given order
    out = torch.mul(vectors[0], float(np.float32(weights[0])))
    for v, a in zip(vectors[1:], weights[1:]):
        out.add_(torch.mul(v, float(np.float32(a))))
    return out


def nesterov_update(params: torch.Tensor, momentum: torch.Tensor, g: torch.Tensor, lr: float, mu: float,
                    nesterov: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """DiLoCo's outer step on copies: (x', m') from (x, m) and the mean pseudo-gradient g, with
    exactly the operations of `OuterOptimizer.step` (so k == 1 reproduces it bit for bit)."""
    x, buf = params.clone(), momentum.clone()
    if mu > 0:
        buf.mul_(mu).add_(g)                                # m' = mu * m + g
        d = torch.mul(buf, mu).add_(g) if nesterov else buf
    else:
        d = g
    x.sub_(torch.mul(d, lr))                                # x' = x - lr * d
    return x, buf


def merge_round(states: Sequence[OuterState], avg_pseudo_grad: torch.Tensor, trained: int, lr: float,
                mu: float, nesterov: bool = True) -> OuterState:
    """The state every member of a round commits (rule M1): the work-weighted average of the
    distinct bases among `states` (the members' own states, one per member, duplicates
    allowed), then the Nesterov step with the members' mean pseudo-gradient. `trained`: the
    members that contributed a trained pseudo-gradient (joiners' zeros do not count)."""
    if not states:
        raise ValueError("a round needs at least one member")
    if trained < 0:
        raise ValueError(f"trained must be >= 0, got {trained}")
    g = avg_pseudo_grad.detach().to("cpu", torch.float32).reshape(-1)
    if g.numel() != states[0].params.numel():
        raise ValueError(f"pseudo-gradient has {g.numel()} values, the states {states[0].params.numel()}")
    if not bool(torch.isfinite(g).all()):
        raise ValueError("pseudo-gradient holds inf or NaN; refusing to apply it")
    bases = distinct_bases(states)
    if len(bases) == 1:  # every member shares one base: plain DiLoCo, nothing averaged
        x_bar, m_bar = bases[0].params, bases[0].momentum
    else:
        a = base_weights([b.work for b in bases])
        x_bar = _weighted_sum([b.params for b in bases], a)
        m_bar = _weighted_sum([b.momentum for b in bases], a)
    x, m = nesterov_update(x_bar, m_bar, g, lr, mu, nesterov)
    return OuterState(x, m, max(b.work for b in bases) + trained)
