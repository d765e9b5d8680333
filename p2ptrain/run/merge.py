"""Merge rounds: one committed state for members that start from different states (pure: no I/O).

docs/PROTOCOL.md, rule M1. Before, a member whose base differed from the others' was left out
of every roster (rule R1), so two lineages of one run never met again: 6 peers in groups of 3
split into two bases after step 1 and into same-base pairs at step 2 (issue 31). Now the
members of a round that start from different states average those states first, weighted
by the work each carries, and apply the round's averaged pseudo-gradient (Nesterov) to that
average, momentum averaged the same way. Every member ends with the same bytes, so a
partition heals at the first round its sides share, and a run of many groups is gossip
averaging of its lineages (Moshpit SGD, arXiv 2103.03239): groups redrawn every step mix
every lineage into every other.

The states travel as the checkpoints their holders already serve (content-addressed,
hash-checked chunks, `p2ptrain.ckpt.download`): a member fetches only the bases it lacks, so
members that already agree pay nothing, and `average` checks each state against the params
hash its holder confirmed. The arithmetic is elementwise float64 in a fixed order (bases
sorted by hash), then rounded once to float32: identical bytes on every member.

Weights: each member's base counts the weight it claims (the members that trained the round
that produced it), capped at the group size. A claim is not checked further: a member can
pull a merge toward its own state by at most one member's share (docs/PROTOCOL.md, "What a
merge trusts").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from p2ptrain.ckpt import checkpoint


class MergeError(ValueError):
    """A base's bytes are not the state its holder confirmed: that holder's fault."""

    def __init__(self, base: str, reason: str) -> None:
        super().__init__(f"base {base[:12]}...: {reason}")
        self.base = base


@dataclass(frozen=True)
class MergePlan:
    bases: tuple[tuple[str, float, tuple[str, ...]], ...]
    """(params hash, weight, holders) of each distinct base, sorted by hash."""

    @property
    def needed(self) -> bool:
        """More than one base: the round must merge before it reduces."""
        return len(self.bases) > 1

    def missing(self, have: str) -> list[tuple[str, tuple[str, ...]]]:
        """The bases (and who holds them) a member holding `have` must fetch."""
        return [(b, holders) for b, _, holders in self.bases if b != have]


def plan(bases: dict[str, tuple[str, int]], group_size: int) -> MergePlan:
    """`bases`: member -> (its base params hash, its claimed weight)."""
    acc: dict[str, tuple[float, list[str]]] = {}
    for member, (base, weight) in sorted(bases.items()):
        w, holders = acc.get(base, (0.0, []))
        acc[base] = (w + float(max(0, min(int(weight), group_size))), holders + [member])
    return MergePlan(tuple((b, w, tuple(h)) for b, (w, h) in sorted(acc.items())))


def params_hash(params: np.ndarray) -> str:
    """As `OuterOptimizer.params_sha256`: SHA-256 of the little-endian float32 bytes."""
    return hashlib.sha256(np.ascontiguousarray(params, "<f4").tobytes()).hexdigest()


def combine(p: MergePlan, arrays: dict[str, tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The weighted average of the bases' (params, momentum), `arrays` keyed by base hash:
    float64 accumulation of separately rounded multiplies, bases in hash order, one final
    rounding to float32. The same bytes on every member (and in `bench diloco --groups-of`)."""
    total = sum(w for _, w, _ in p.bases)
    acc_x = acc_m = None
    for base, w, _ in p.bases:
        share = (w / total) if total > 0 else 1.0 / len(p.bases)
        x, m = arrays[base]
        if acc_x is None:
            acc_x, acc_m = np.zeros(x.shape, np.float64), np.zeros(x.shape, np.float64)
        acc_x += np.multiply(x, share, dtype=np.float64)
        acc_m += np.multiply(m, share, dtype=np.float64)
    return acc_x.astype(np.float32), acc_m.astype(np.float32)


def average(p: MergePlan, states: dict[str, bytes], step: int) -> tuple[bytes, str]:
    """The merged checkpoint (outer params and momentum averaged by weight, at outer step
    `step`) and its params hash. `states`: base hash -> that state's checkpoint bytes.
    Raises MergeError naming a base whose bytes are not what its holders confirmed."""
    first_meta, first_arrays, shape = None, None, None
    arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for base, _, _ in p.bases:
        try:
            got, meta = checkpoint.decode(states[base])
        except (KeyError, checkpoint.CheckpointError) as exc:
            raise MergeError(base, f"not a checkpoint: {exc}") from None
        x, m = got.get("outer"), got.get("momentum")
        if x is None or m is None or x.dtype != np.float32 or m.shape != x.shape or x.ndim != 1:
            raise MergeError(base, "holds no float32 outer state")
        if meta.get("outer_step") != step:
            raise MergeError(base, f"is a state of step {meta.get('outer_step')!r}, not {step}")
        if params_hash(x) != base:
            raise MergeError(base, "params do not hash to the confirmed base")
        if not (np.isfinite(x).all() and np.isfinite(m).all()):
            raise MergeError(base, "holds inf or NaN")
        if shape is None:
            first_meta, first_arrays, shape = meta, got, x.shape
        elif x.shape != shape:
            raise MergeError(base, "is another model's state")
        arrays[base] = (x, m)
    merged = dict(first_arrays)
    merged["outer"], merged["momentum"] = combine(p, arrays)
    meta = dict(first_meta)
    meta["outer_step"] = step
    return checkpoint.encode(merged, meta), params_hash(merged["outer"])
