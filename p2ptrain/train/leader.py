"""Rank 0 of a multi-rank node (issue 19): the `LocalModel` the Trainer drives, over N shards.

The Trainer (p2ptrain.train.trainer) sees the same interface as a single-process peer's
`p2ptrain.train.local.LocalModel`: `inner`, `pseudo_gradient`, `outer_step`, `evaluate`,
`state_bytes`, `load_state_at`, `outer.params_sha256`. Behind it, rank 0 commands the other
ranks (p2ptrain.train.ranks) and trains its own shard alongside them.

The outer state -- fp32 outer parameters and Nesterov momentum -- lives whole on rank 0's
host, exactly as on a single-process peer (`HostOuter` is `OuterOptimizer` without a local
model behind it), so the outer step is the same bytes as everywhere and the node publishes
the same params hash as a 1-rank peer that committed the same round. The pseudo-gradient
is outer - params: rank 0 gathers the ranks' parameter shards into one host vector and
subtracts there. Subtracting per shard on each rank and gathering the differences gives
the same bytes (an elementwise fp32 op), but would need each rank to keep an fp32 copy of
its slice of the outer parameters; gathering the parameters needs none.

After a committed outer step or an adopted checkpoint (a catch-up), `HostOuter` scatters
the new outer parameters to the ranks (APPLY); nothing else ever writes their shards. A
lock serialises commands: collectives must be issued in the same order on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import numpy as np
import torch

from p2ptrain.ckpt import checkpoint
from p2ptrain.train import device as dev
from p2ptrain.train import ranks
from p2ptrain.train.local import decode_state, encode_state
from p2ptrain.train.modelside import PhaseLeft
from p2ptrain.train.outer import OuterConfig, OuterOptimizer, sha256_f32
from p2ptrain.train.sharded import ShardedModel

log = logging.getLogger("p2ptrain.train.leader")


class HostOuter(OuterOptimizer):
    """The outer optimizer over a flat host vector; `load_into_model` calls `on_load`."""

    def __init__(self, numel: int, cfg: OuterConfig, on_load) -> None:
        self.cfg = cfg
        self.params = []
        self._numel = numel
        # outer and momentum come with the first load_state_dict (the run's state), which
        # replaces them: allocating them here would only raise rank 0's peak by 8 bytes/param
        self.outer = self.momentum = torch.empty(0)
        self._staging = dev.host_empty(numel)
        self.steps = self.skipped = 0
        self.on_load = on_load

    @property
    def numel(self) -> int:
        return self._numel

    def fill(self, outer: torch.Tensor) -> None:
        """Start from these outer parameters and zero momentum (the library API's genesis)."""
        self.outer, self.momentum = outer, dev.host_empty(self._numel).zero_()

    def load_into_model(self) -> None:
        self.on_load(self.outer)


class LeaderModel:
    """Rank 0's `LocalModel`: its own shard, the node's outer state, commands to the rest."""

    def __init__(self, spec, ds, peer_id: bytes, state: bytes, threads: int, device: torch.device,
                 precision: str, env: ranks.RankEnv, cfg: ranks.RanksConfig) -> None:
        if spec.train.overlap_scheme != "none":  # the overlapped loop drives one process's model
            raise ValueError("an overlapped run (train.overlap) trains in one process per node, not under torchrun")
        self.env, self.cfg = env, cfg
        self.lock = threading.Lock()
        ranks.send_setup(spec.to_dict(), ds, peer_id, threads, precision)
        self.shard = ShardedModel(spec, ds, peer_id, threads, device, precision, env.rank, env.world,
                                  ranks.make_mesh(device, env.world))
        ranks.exchange_layout(self.shard)
        self.H, self.n_params = self.shard.H, self.shard.n_params
        tr = spec.train
        self.outer = HostOuter(self.n_params, OuterConfig(float(tr.outer_lr), float(tr.outer_momentum)), self._apply)
        self.step = self.load_state(state)

    # -- the LocalModel interface (called from trio worker threads, one at a time) --------
    def inner(self, progress=None) -> tuple[float, int, float]:
        def lockstep(i: int, n: int) -> None:  # the other ranks cannot leave a phase with us (E17)
            with contextlib.suppress(PhaseLeft):
                progress(i, n)

        with self.lock:
            ranks.send_cmd(ranks.INNER, self.step)
            return self.shard.inner(self.step, None if progress is None else lockstep)

    def pseudo_gradient(self) -> np.ndarray:
        with self.lock:
            full = self._gather(self.outer._staging)
        return np.ascontiguousarray((self.outer.outer - full).numpy(), np.float32)

    def outer_step(self, avg: np.ndarray) -> str:
        self.outer.step(torch.from_numpy(np.array(avg, dtype=np.float32)))  # scatters (APPLY)
        self.step += 1
        return self.outer.params_sha256()

    evaluates_committed = False
    """Evaluation drives every rank's shard of the live model: the trainer runs it before the
    next inner phase, not beside it (`p2ptrain.train.modelside`)."""

    def evaluate(self, max_batches: int = 8, committed: bool = False) -> float:
        with self.lock:
            # every rank runs the same forwards (FSDP's collectives): the count goes with the
            # command. Sent without it, the other ranks evaluated their default 8 batches, and a
            # leader told `--eval-batches 2` waited for them forever after its first commit.
            ranks.send_cmd(ranks.EVAL, max_batches)
            return self.shard.evaluate(max_batches)

    def state_bytes(self) -> bytes:
        return encode_state(self.outer, self.step)

    def load_state(self, data: bytes) -> int:
        """As LocalModel.load_state: CheckpointError for bytes that are not this model's state
        (checked before any rank's shard changes)."""
        sd, step = decode_state(data)
        try:
            self.outer.load_state_dict(sd)  # scatters to the ranks (APPLY) once it fits
        except (KeyError, TypeError, ValueError) as exc:
            raise checkpoint.CheckpointError(f"checkpoint does not fit this run's model: {exc}") from None
        return step

    def load_state_at(self, data: bytes) -> None:
        self.step = self.load_state(data)

    def stop(self) -> None:
        with self.lock:
            ranks.send_cmd(ranks.STOP)

    def memory(self) -> dict:
        """Exact bytes rank 0 holds: its shard (params, AdamW) and the node's host outer state."""
        out = self.shard.param_bytes()
        out["outer_state"] = sum(t.numel() * t.element_size()
                                 for t in (self.outer.outer, self.outer.momentum, self.outer._staging))
        return out

    # -- collectives ---------------------------------------------------------------------
    def _gather(self, out: torch.Tensor) -> torch.Tensor:
        ranks.send_cmd(ranks.GATHER)
        return ranks.gather_full(self.shard, out)

    def _apply(self, full: torch.Tensor) -> None:
        """Every rank's shard := its slice of `full` (the committed or adopted outer params)."""
        with self.lock:
            ranks.send_cmd(ranks.APPLY)
            ranks.scatter_full(self.shard, full)
            if self.cfg.verify:
                verify(full, self._gather(torch.empty_like(full)), self.env.world)


def verify(full: torch.Tensor, back: torch.Tensor, world: int) -> None:
    """The shards gathered back after an APPLY hash to the parameters sent (RanksConfig.verify)."""
    want, got = sha256_f32(full), sha256_f32(back)
    if want != got:
        raise RuntimeError(f"after apply the ranks' shards hash to {got[:16]}, the outer params to {want[:16]}")
    log.info("shards verified: %d ranks hold params %s", world, want[:16])


def factory(env: ranks.RankEnv, cfg: ranks.RanksConfig):
    """`Parts.local` for rank 0: the same call signature as `LocalModel`'s constructor."""

    def make(spec, ds, peer_id, state, threads, device="auto", precision="auto") -> LeaderModel:
        return LeaderModel(spec, ds, peer_id, state, threads, ranks.rank_device(dev.resolve_device(device), env),
                           precision, env, cfg)

    return make
