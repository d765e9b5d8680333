"""`p2ptrain.DiLoCo` on a multi-rank node (issue 19): torchrun, the user's own FSDP2 model.

    torchrun --nproc-per-node N my_train.py      # on every rank:
    model = build(); fully_shard(model)          # the user's sharding (FSDP2, dim-0 shards)
    diloco = DiLoCo(model, opt, run=..., bootstrap=[...])
    for batch in data: ...; diloco.step(loss)

As with `join` (p2ptrain.train.ranks), rank 0 speaks for the node: only it runs the network
thread, holds the identity and the fp32 outer state on the host (`HostOuter`). Every rank
runs the user's loop; at its H-th `step()` a non-zero rank stops in `Follower.step` and obeys
rank 0's commands -- GATHER (its shard for the pseudo-gradient), APPLY (the committed or
adopted parameters), then DONE (back to the user's loop) -- so its parameters change only
when rank 0 committed. Rank 0's own user thread waits in `step()` meanwhile, as on a
single-process peer.

The commands, gathers and scatters go over their own gloo process group: rank 0 issues them
from its network thread while its user thread may be running FSDP collectives on the
default group, and two groups keep the two streams from interleaving differently on
different ranks. Not supported: a user `evaluate` callable (it would run FSDP collectives
on rank 0 alone; the node reports no validation loss), and parameters that are not FSDP2
dim-0 shards (a replicated DDP model: use one process per peer, or FSDP2).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from p2ptrain.api import _UserModel
from p2ptrain.train import device as dev
from p2ptrain.train import ranks
from p2ptrain.train.leader import HostOuter, verify
from p2ptrain.train.outer import OuterConfig
from p2ptrain.train.sharded import load_shard_flat, local, shard_flat


def command_group(env: ranks.RankEnv, model: torch.nn.Module):
    """The gloo group rank 0's commands travel in (the user's process group initialised first
    if they have not: on CUDA with NCCL for FSDP, gloo for us)."""
    if not dist.is_initialized():
        device = next(model.parameters()).device
        ranks.init(env, device, ranks.RanksConfig())
    return dist.new_group(backend="gloo")


class UserShards:
    """The user's FSDP2-sharded parameters, in the layout of `p2ptrain.train.ranks`."""

    def __init__(self, model: torch.nn.Module, world: int, group) -> None:
        self.params = list(model.parameters())
        for p in self.params:
            placements = getattr(p, "placements", None)
            if placements is None or len(placements) != 1 or getattr(placements[0], "dim", None) != 0:
                raise ValueError("under torchrun, DiLoCo needs the model sharded with FSDP2 "
                                 "(torch.distributed.fsdp.fully_shard) before DiLoCo(...)")
        self.world = world
        self.local_numels = np.array([local(p).numel() for p in self.params], np.int64)
        self.n_params = int(sum(p.numel() for p in self.params))
        mine = torch.from_numpy(self.local_numels.copy())
        alls = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(alls, mine, group=group)
        self.layout = torch.stack(alls).numpy()
        self.pad = int(self.layout.sum(axis=1).max())

    def shard_flat(self, pad_to: int) -> torch.Tensor:
        return shard_flat(self.params, int(self.local_numels.sum()), pad_to)

    def load_shard_flat(self, flat: torch.Tensor) -> None:
        load_shard_flat(self.params, flat, int(self.local_numels.sum()))


class LeaderUserModel(_UserModel):
    """Rank 0's `_UserModel`: the outer state over the whole node's parameters."""

    def __init__(self, model: torch.nn.Module, inner_steps: int, cfg: OuterConfig, env: ranks.RankEnv,
                 group) -> None:
        from p2ptrain.config import resolve

        self.group, self.env = group, env
        self.cfg = resolve(ranks.RanksConfig, section="ranks")  # P2PTRAIN_RANKS_* too
        self.shards = UserShards(model, env.world, group)
        outer = HostOuter(self.shards.n_params, cfg, self._apply)
        # the starting params: every rank is in __init__
        outer.fill(ranks.gather_full(self.shards, dev.host_empty(self.shards.n_params), group))
        super().__init__(model, inner_steps, cfg, None, outer_opt=outer)

    def inner(self, progress=None):
        with self.lock:
            held = not self.outer_done  # the others wait in their H-th step() for rank 0's word
        if held:
            ranks.send_cmd(ranks.DONE, self.step, self.group)
        return super().inner(progress)

    def pseudo_gradient(self) -> np.ndarray:
        ranks.send_cmd(ranks.GATHER, 0, self.group)
        full = ranks.gather_full(self.shards, self.outer._staging, self.group)
        return np.ascontiguousarray((self.outer.outer - full).numpy(), np.float32)

    def _apply(self, full: torch.Tensor) -> None:
        ranks.send_cmd(ranks.APPLY, 0, self.group)
        ranks.scatter_full(self.shards, full, self.group)
        if self.cfg.verify:  # [ranks] verify: the shards hash back to what was sent (tests)
            ranks.send_cmd(ranks.GATHER, 0, self.group)
            verify(full, ranks.gather_full(self.shards, torch.empty_like(full), self.group), self.env.world)

    def evaluate(self, max_batches: int = 8, committed: bool = False) -> float:
        return math.nan

    def release(self) -> None:
        """At close: let the other ranks out of a step() they wait in."""
        with self.lock:
            held = not self.outer_done
        if held:
            ranks.send_cmd(ranks.STOP, self.step, self.group)


class Follower:
    """A non-zero rank's DiLoCo: counts the user's steps, obeys rank 0 at every H-th."""

    def __init__(self, model: torch.nn.Module, inner_steps: int, env: ranks.RankEnv, group) -> None:
        self.group = group
        self.shards = UserShards(model, env.world, group)
        ranks.send_shard(self.shards, group)  # rank 0's gather of the starting params
        self.H, self.calls, self.step_count, self.stopped = inner_steps, 0, 0, False

    def step(self) -> bool:
        """True when the parameters changed (rank 0 committed or adopted a state)."""
        self.calls += 1
        if self.calls < self.H or self.stopped:
            return False
        self.calls = 0
        changed = False
        while True:
            cmd, arg = ranks.recv_cmd(self.group)
            if cmd == ranks.GATHER:
                ranks.send_shard(self.shards, self.group)
            elif cmd == ranks.APPLY:
                ranks.recv_shard(self.shards, self.group)
                changed = True
            elif cmd in (ranks.DONE, ranks.STOP):
                self.step_count, self.stopped = arg, cmd == ranks.STOP
                return changed
            else:
                raise RuntimeError(f"unexpected command {ranks.NAMES[cmd]} in DiLoCo.step")
