"""The model side of a peer, as the trainer sees it: one declared interface (pure: no I/O).

Four implementations: `train.local.LocalModel` (one process, the run's model),
`train.leader.LeaderModel` (rank 0 of a torchrun node), `api._UserModel` (the library: the
user's loop drives inner steps) and `sim.model.VectorModel` (the simulator's deterministic
stand-in). The trainer calls only what is declared here; capabilities are declared
attributes, never probed with `getattr`.

Every method runs in a worker thread (`trio.to_thread`), one at a time, except where an
overlapped run says otherwise (`train.overlap`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


class OuterState(Protocol):
    """The committed (outer) parameters and momentum."""

    @property
    def numel(self) -> int: ...

    def params_sha256(self) -> str:
        """SHA-256 of the committed parameters: equal on every member of a committed round."""


class PhaseLeft(Exception):
    """Raised by an inner phase's progress callback when the run has left the phase's step
    two behind (rule E17, `train.lineage.Lineage.watched_phase`)."""


@runtime_checkable
class ModelSide(Protocol):
    H: int
    """Inner steps per phase."""
    n_params: int
    step: int
    """The outer step the committed state is at (the next round's step)."""
    outer: OuterState
    evaluates_committed: bool
    """`evaluate(n, committed=True)` scores the committed params without touching the model
    (on a copy), so the trainer may run it beside the next inner phase. False: the trainer
    evaluates before training on."""

    def inner(self, progress=None) -> tuple[float, int, float]:
        """H inner steps: (mean loss, tokens, seconds). `progress(i, H)` after step i, where
        it may raise `PhaseLeft` (rule E17): the phase then ends there, raising it; the
        trainer discards it."""

    def pseudo_gradient(self) -> np.ndarray:
        """outer params - current params, float32, contiguous."""

    def outer_step(self, avg: np.ndarray) -> str:
        """Apply the committed average (Nesterov); step += 1; the new params hash."""

    def evaluate(self, max_batches: int = 8, committed: bool = False) -> float:
        """Validation loss over at most `max_batches` held-out batches (nan: none)."""

    def state_bytes(self) -> bytes:
        """The committed state (params, momentum, step) as a checkpoint."""

    def load_state_at(self, data: bytes) -> None:
        """Adopt a state fetched from peers; raises `ckpt.checkpoint.CheckpointError` for
        bytes that are not this model's state."""


def check(local) -> None:
    """Raise TypeError naming what `local` lacks (at build time, not mid-run)."""
    missing = [name for name in ("H", "n_params", "step", "outer", "evaluates_committed", "inner",
                                 "pseudo_gradient", "outer_step", "evaluate", "state_bytes", "load_state_at")
               if not hasattr(local, name)]
    if missing:
        raise TypeError(f"{type(local).__name__} is not a model side: it lacks {', '.join(missing)}")
