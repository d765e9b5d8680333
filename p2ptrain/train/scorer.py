"""The model side of the loss gate (rule L1, `p2ptrain.run.lossgate`): score a round's candidate.

`CandidateScorer(local)(avg, seed)` returns (reference, after): the loss of the state the outer
step reaches with no work (a zero mean: momentum alone) and of the state it would commit with
`avg`, on training windows drawn from `seed` (a hash of the round's signed headers, so no
contributor chose them). Work is what moves the step away from momentum alone: measured
with 2 inner steps, an honest outer step raised the loss against the state it started from
in 8 of 25 steps (momentum overshooting), against momentum alone in 3. It runs in the
all-reduce service's worker thread, between the data plane and our commit vote, while the
local model may be training the next phase (overlapped runs): it scores on a model of its
own and reads the outer state, which only a commit changes, and no commit can happen before
our vote. Blocking torch work; the cost is two forward passes of `batches` x the run's batch (the
reference once per round). `piece` scores one member's work alone for rule L2 from the state the
round starts from, without momentum (rule L2b).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

import numpy as np
import torch

from p2ptrain.run.lossgate import GateConfig
from p2ptrain.train import device as dev
from p2ptrain.train.data import train_batch
from p2ptrain.train.hf import build_run_model
from p2ptrain.train.local import decode_state
from p2ptrain.train.outer import candidate


class CandidateScorer:
    def __init__(self, local, config: GateConfig | None = None) -> None:
        self.local = local
        self.config = config or GateConfig()
        self._model = None
        self._lock = threading.Lock()
        # (seed, base) -> the reference loss. More than one: L2's confirmation batches come
        # between pieces scored on the round's batch, and a single slot recomputed it for each.
        self._refs: dict[tuple, float] = {}
        self.last_seconds = 0.0
        """What the last score cost (wall seconds): the gate's price per gated round."""

    def __call__(self, avg: np.ndarray, seed: bytes, base_state: bytes | None = None) -> tuple[float, float]:
        """L1's score of a round's mean: (reference, after), the loss of the state the outer
        step reaches with no work at all (a zero mean: momentum alone; at a run's first step,
        the base itself) and of the state `step_fraction` of the way from there towards the
        one it reaches with `avg`, on the batch `seed` draws (a direction test: does the work
        point downhill). `base_state`: a merge round's merged state (checkpoint bytes), which
        the step would be applied to instead of our own outer state. The reference is
        computed once per (seed, base)."""
        return self._score(avg, seed, base_state, momentum_base=True)

    def piece(self, vec: np.ndarray, seed: bytes, base_state: bytes | None = None) -> tuple[float, float]:
        """L2's score of one member's work alone: (before, after), the loss of the state the
        round starts from (ours, or `base_state`'s) and of the state `step_fraction` of the
        way along the step `vec` alone would make from there without momentum, on the batch
        `seed` draws: does the work point downhill from where it was trained. Momentum is
        left out on purpose (rule L2b): from momentum alone, which overshoots at a run's
        early steps, honest pieces rose on all 3 batches (convicted) at step 1 in 2 of 8
        worlds of the checkpoint test's config, and a -2.5x anti-update fell in 6 of 8."""
        return self._score(vec, seed, base_state, momentum_base=False)

    def _score(self, avg, seed: bytes, base_state: bytes | None, momentum_base: bool) -> tuple[float, float]:
        with self._lock:
            t0 = time.perf_counter()
            local = self.local
            if base_state is None:
                base, momentum = local.outer.outer, local.outer.momentum
            else:
                sd, _ = decode_state(base_state)
                base, momentum = sd["outer"].to(torch.float32).reshape(-1), sd["momentum"].to(torch.float32)
            if not momentum_base:
                momentum = torch.zeros_like(base)
            tokens = self.tokens(seed)
            key = (seed, None if base_state is None else hashlib.sha256(base_state).digest(), momentum_base)
            ref = candidate(base, momentum, local.outer.cfg, torch.zeros_like(base))
            if key not in self._refs:
                if len(self._refs) >= 16:
                    self._refs.pop(next(iter(self._refs)))
                self._refs[key] = self._loss(ref, tokens)
            cand = candidate(base, momentum, local.outer.cfg, torch.from_numpy(np.asarray(avg, dtype=np.float32)))
            after = self._loss(ref.add_(cand.sub_(ref), alpha=self.config.step_fraction), tokens)
            self.last_seconds = time.perf_counter() - t0
            return self._refs[key], after

    def state_losses(self, data: bytes, seed: bytes) -> tuple[float, float]:
        """(ours, theirs): the loss of our outer state and of the state in checkpoint `data`
        (a head we are about to adopt, `checked_load`), on the windows `seed` draws."""
        with self._lock:
            local = self.local
            sd, _ = decode_state(data)
            tokens = self.tokens(seed)
            return (self._loss(local.outer.outer, tokens),
                    self._loss(sd["outer"].to(torch.float32).reshape(-1), tokens))

    def tokens(self, seed: bytes) -> torch.Tensor:
        """The training windows `seed` draws (`batches` x the run's batch), on the model's device."""
        local = self.local
        return dev.to_device(train_batch(local.ds, seed, 0, self.config.batches * local.batch, local.seq_len,
                                         local.seed), local.device)

    def _loss(self, flat: torch.Tensor, tokens: torch.Tensor) -> float:
        if self._model is None:  # built at the first score, on the model's device
            self._model = build_run_model(self.local.spec.model.config, self.local.seed).to(self.local.device)
            self._model.eval()
        params = list(self._model.parameters())
        with torch.no_grad():
            dev.scatter_from_host(flat, params)
            with dev.autocast(self.local.device, self.local.autocast_dtype):
                return float(self._model.loss(tokens))


def make_scorer(local, config: GateConfig | None = None) -> CandidateScorer | None:
    """A scorer for a single-process model whose outer steps move the whole model; None where
    the gate is off or cannot score the step (a streaming run's fragments, a sharded or
    multi-rank model: the gate does not cover those yet)."""
    config = config or GateConfig()
    frags = getattr(local, "frags", None)
    if not config.enabled or frags is None or frags.P != 1 or not hasattr(local, "outer"):
        return None
    if not hasattr(local, "ds"):
        return None
    return CandidateScorer(local, config)


class WorseThanGenesis(ValueError):
    """A head that scores no better than the state we hold (the genesis; for H3, our own
    lineage) on windows we drew: not trained work, or no better than ours."""


def checked_load(scorer: CandidateScorer | None, local, data: bytes, always: bool = False) -> None:
    """`local.load_state_at(data)`, but a peer still at the genesis first scores the state
    against its own (rule H1's sanity bar, issue 32's planted checkpoint): trained work
    lowers the loss on windows nobody chose (ours, drawn here), a planted state of noise does
    not. `always`: at any step (rule H3's far-ahead state, which nobody we trust attests).
    Raised, the head is rejected like one that does not load (`ckpt.catchup.adopt`) and
    the next best is tried. Blocking. `scorer`: anything with `state_losses(data, seed)`."""
    if scorer is not None and (always or local.step == 0):
        ours, theirs = scorer.state_losses(data, os.urandom(32))
        if not theirs < ours:
            raise WorseThanGenesis(f"the state scores {theirs:.4f} where ours scores {ours:.4f}")
    local.load_state_at(data)
