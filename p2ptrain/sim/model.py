"""The simulator's training stand-in: a small deterministic vector model (a `ModelSide`).

Every peer's local parameters move toward a shared target (plus a per-peer bias: its own
data) with seeded noise, `H` inner steps per phase; the outer step is Nesterov SGD on the
committed average, float32, with the same separately rounded operations as
`p2ptrain.train.outer.OuterOptimizer`, so members of one round stay bit-identical. The
validation loss is the committed parameters' mean squared distance to the target, so the
quality of a run (forks, dropped contributions) shows as a number.

Inner steps cost simulated time (`step_seconds` x `slow`): they are charged with `charge`
and paid by the simulator's inline `to_thread` (`p2ptrain.sim.world`), which runs every
blocking call in the trio thread for determinism.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from p2ptrain.ckpt import checkpoint

_cost = [0.0]


def charge(seconds: float) -> None:
    """Simulated seconds the current blocking call takes."""
    _cost[0] += seconds


def take_cost() -> float:
    c, _cost[0] = _cost[0], 0.0
    return c


def genesis(dim: int, seed: int) -> bytes:
    x = np.random.default_rng([seed, 0x6E5]).standard_normal(dim).astype(np.float32)
    return encode(x, np.zeros(dim, np.float32), 0)


def encode(params: np.ndarray, momentum: np.ndarray, step: int) -> bytes:
    return checkpoint.encode({"outer": params, "momentum": momentum}, {"outer_step": int(step)})


class _Outer:
    def __init__(self, lr: float, momentum: float) -> None:
        self.lr, self.mu = np.float32(lr), np.float32(momentum)
        self.params = np.zeros(0, np.float32)
        self.momentum = np.zeros(0, np.float32)

    @property
    def numel(self) -> int:
        return int(self.params.size)

    def params_sha256(self) -> str:
        return hashlib.sha256(self.params.tobytes()).hexdigest()

    def step(self, g: np.ndarray) -> None:
        if g.shape != self.params.shape or not np.isfinite(g).all():
            raise ValueError("bad average")
        self.momentum = self.momentum * self.mu + g         # buf = m * buf + g
        d = self.momentum * self.mu + g                     # Nesterov
        self.params = self.params - d * self.lr


class VectorModel:
    evaluates_committed = True

    def __init__(self, state: bytes, *, dim: int, H: int, seed: int, peer: int, target_seed: int,
                 outer_lr: float, outer_momentum: float, step_seconds: float = 0.2, slow: float = 1.0,
                 inner_lr: float = 0.05, noise: float = 0.5, bias: float = 0.3,
                 hot: tuple[int, float] = (-1, 1.0)) -> None:
        self.H, self.n_params = H, dim
        self.seed, self.peer = seed, peer
        rng = np.random.default_rng([target_seed, 0x7A6])
        self.target = rng.standard_normal(dim).astype(np.float32)
        self.bias = (np.random.default_rng([target_seed, peer, 0xB1A5]).standard_normal(dim) * bias).astype(np.float32)
        self.lr, self.noise = np.float32(inner_lr), noise
        self.step_seconds, self.slow = step_seconds, slow
        self.outer = _Outer(outer_lr, outer_momentum)
        self.load_state_at(state)
        self.phases, self.hot = 0, hot

    def load_state_at(self, data: bytes) -> None:
        arrays, meta = checkpoint.decode(data)
        try:
            params, momentum = arrays["outer"], arrays["momentum"]
            step = meta["outer_step"]
        except KeyError as exc:
            raise checkpoint.CheckpointError(f"not a simulated state: no {exc}") from None
        if params.shape != (self.n_params,) or momentum.shape != params.shape or type(step) is not int:
            raise checkpoint.CheckpointError("state does not fit this model")
        self.outer.params = np.array(params, np.float32)
        self.outer.momentum = np.array(momentum, np.float32)
        self.step = step
        self.local = self.outer.params.copy()

    def state_bytes(self) -> bytes:
        return encode(self.outer.params, self.outer.momentum, self.step)

    def inner(self, progress=None) -> tuple[float, int, float]:
        rng = np.random.default_rng([self.seed, self.peer, self.step, self.phases])
        self.phases += 1
        goal = self.target + self.bias
        x = self.local
        for _ in range(self.H):
            grad = (x - goal) + rng.standard_normal(x.size).astype(np.float32) * np.float32(self.noise)
            x = x - grad * self.lr
        self.local = x
        seconds = self.H * self.step_seconds * self.slow
        charge(seconds)
        return self.loss(x), self.H * 16, seconds

    def pseudo_gradient(self) -> np.ndarray:
        k = np.float32(self.hot[1] if self.phases - 1 == self.hot[0] else 1.0)
        return np.ascontiguousarray((self.outer.params - self.local) * k, np.float32)

    def outer_step(self, avg: np.ndarray) -> str:
        self.outer.step(np.asarray(avg, np.float32))
        self.step += 1
        self.local = self.outer.params.copy()
        return self.outer.params_sha256()

    def loss(self, x: np.ndarray) -> float:
        return float(np.mean((x - self.target).astype(np.float64) ** 2))

    def evaluate(self, max_batches: int = 8, committed: bool = False) -> float:
        self.evaluated = max_batches
        v = self.loss(self.outer.params if committed else self.local)
        return v if math.isfinite(v) else math.nan


class StateScorer:
    """The stand-in's `state_losses` (rules H1 and H3, `p2ptrain.train.scorer.checked_load`):
    our committed params and a fetched state's, scored on the run's data (the target every
    peer's data shares, without our own bias: the real scorer draws windows of the run's
    dataset, which every peer holds, not of the peer's own share) with a fresh noise draw
    each time, as the real scorer draws fresh windows. The draws come from the world's seed,
    not the caller's random `seed`, so a world replays. Scored on our own biased target, an
    honest group's step that moved away from our bias read as worse than our state."""

    def __init__(self, model: VectorModel, noise: float = 0.05) -> None:
        self.model, self.noise, self.draws = model, noise, 0

    def state_losses(self, data: bytes, seed: bytes) -> tuple[float, float]:
        m = self.model
        arrays, _ = checkpoint.decode(data)
        theirs = arrays.get("outer")
        if theirs is None or theirs.shape != (m.n_params,):
            raise checkpoint.CheckpointError("state does not fit this model")
        rng = np.random.default_rng([m.seed, m.peer, 0x5C0E, self.draws])
        self.draws += 1
        goal = m.target + (rng.standard_normal(m.n_params) * self.noise).astype(np.float32)
        return (float(np.mean((m.outer.params - goal).astype(np.float64) ** 2)),
                float(np.mean((np.asarray(theirs, np.float32) - goal).astype(np.float64) ** 2)))

