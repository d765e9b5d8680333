"""One rank's part of a multi-rank node (issue 19): the model sharded with FSDP2.

A node with N ranks (torchrun) trains ONE copy of the model, cut into N shards with
`torch.distributed.fsdp.fully_shard` (every transformer block, then the root): each rank
holds 1/N of the parameters, gradients and AdamW state. The node's batch is split by rows
across the ranks: the peer's tokens per inner step are a single-process peer's with the
same batch size, drawn from the same (peer, step) windows (`train_batch`), and rank r trains
rows [r*B/N, (r+1)*B/N). FSDP averages the gradients over the ranks, so the step is the mean
over the whole batch, as for one process (not bit-identical: the reduction order differs).

The outer state is not here: rank 0 holds it whole, on the host (p2ptrain.train.leader).
What this module gives rank 0 is each rank's shard as one flat fp32 host vector, and the
layout that turns the N vectors into the full parameter vector (the order of
`model.parameters()`, as `p2ptrain.train.outer.flatten` writes it) and back. FSDP2 shards
dim 0 in `torch.chunk` order, so a parameter's full row-major values are its ranks' local
values concatenated in rank order: `assemble` and `split` are slicing, no reshapes.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from p2ptrain.run.spec import RunSpec
from p2ptrain.train import device as dev
from p2ptrain.train.data import Dataset, train_batch, val_batches
from p2ptrain.train.hf import build_run_model
from p2ptrain.train.outer import make_inner_optimizer, seek_schedule


def rank_rows(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s rows of a node batch (contiguous, in order: rank 0 gets the first)."""
    return torch.tensor_split(tokens, world)[rank]


def shard_model(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """fully_shard every element of every ModuleList (the transformer blocks of our preset
    and of HF models), then the root; `loss` is made an FSDP forward method, since it
    calls `forward` directly and FSDP2 hooks only `__call__`."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for mod in list(model.modules()):
        if isinstance(mod, torch.nn.ModuleList):
            for block in mod:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "loss")
    return model


def build_sharded(section: dict, seed: int, device: torch.device, mesh) -> torch.nn.Module:
    """The run's model, sharded. A preset model is built on the meta device and allocated
    only as this rank's shards (no rank ever holds the whole model; only the rope tables,
    derived from the config, are computed); its values come from the run's state, which rank
    0 applies to every rank before any inner step (`LeaderModel.load_state`). HF models
    build whole on the CPU first (their non-persistent buffers come from their own init)."""
    if section.get("kind") == "hf":
        return shard_model(build_run_model(section, seed).to(device), mesh)
    from p2ptrain.train.model import ModelConfig, Transformer, rope_tables

    cfg = ModelConfig.from_dict(section)
    with torch.device("meta"):
        model = Transformer(cfg)
    shard_model(model, mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            local(p).zero_()  # defined bytes until the state is applied
        cos, sin = rope_tables(cfg)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    return model


def assemble(pieces: list[torch.Tensor], numels: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """The full flat vector from every rank's flat shard. numels[r, i]: how many values of
    parameter i rank r holds (its local shard); pieces[r] holds them for every i in order."""
    n_ranks, n_params = numels.shape
    src = np.zeros(n_ranks, np.int64)
    dst = 0
    for i in range(n_params):
        for r in range(n_ranks):
            n = int(numels[r, i])
            out[dst:dst + n].copy_(pieces[r][src[r]:src[r] + n])
            src[r] += n
            dst += n
    if dst != out.numel():
        raise ValueError(f"shards hold {dst} values, the model {out.numel()}")
    return out


def split(full: torch.Tensor, numels: np.ndarray, pad_to: int) -> list[torch.Tensor]:
    """Inverse of `assemble`: each rank's flat shard, zero-padded to `pad_to` values."""
    n_ranks, n_params = numels.shape
    if int(numels.sum()) != full.numel():
        raise ValueError(f"layout holds {int(numels.sum())} values, the vector {full.numel()}")
    outs = [torch.zeros(pad_to, dtype=torch.float32) for _ in range(n_ranks)]
    fill = np.zeros(n_ranks, np.int64)
    src = 0
    for i in range(n_params):
        for r in range(n_ranks):
            n = int(numels[r, i])
            outs[r][fill[r]:fill[r] + n].copy_(full[src:src + n])
            fill[r] += n
            src += n
    return outs


def local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's values on this rank: its shard (DTensor) or itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def shard_flat(params: list, n_local: int, pad_to: int) -> torch.Tensor:
    """This rank's values of `params` as one fp32 host vector (n_local of them), zero-padded."""
    out = torch.zeros(pad_to, dtype=torch.float32)
    dev.gather_to_host([local(p) for p in params], out[:n_local])
    return out


def load_shard_flat(params: list, flat: torch.Tensor, n_local: int) -> None:
    """Write this rank's values of `params` from `flat` (the layout `shard_flat` reads)."""
    dev.scatter_from_host(flat[:n_local].contiguous(), [local(p) for p in params])


class ShardedModel:
    """This rank's shard of the node's model, its AdamW state and its rows of each batch."""

    def __init__(self, spec: RunSpec, ds: Dataset, peer_id: bytes, threads: int, device: torch.device,
                 precision: str, rank: int, world: int, mesh) -> None:
        torch.set_num_threads(max(1, threads))
        tr = spec.train
        if tr.batch_size % world:
            raise ValueError(f"the run's batch size {tr.batch_size} does not split over {world} ranks; "
                             f"use a --nproc-per-node that divides it")
        self.spec, self.ds, self.peer_id = spec, ds, peer_id
        self.rank, self.world = rank, world
        self.device = device
        self.autocast_dtype = dev.resolve_precision(precision, device)
        self.H, self.batch, self.seq_len, self.seed = tr.inner_steps, tr.batch_size, tr.seq_len, tr.seed
        self.model = build_sharded(spec.model.config, self.seed, device, mesh)
        self.params = list(self.model.parameters())
        self.inner_opt, self.sched = make_inner_optimizer(
            self.model, float(tr.inner_lr), float(tr.weight_decay), tr.warmup, tr.inner_steps * tr.planned_outer_steps,
            tr.schedule)
        self.local_numels = np.array([local(p).numel() for p in self.params], np.int64)
        self.n_params = int(sum(p.numel() for p in self.params))

    def inner(self, step: int, progress=None) -> tuple[float, int, float]:
        """H AdamW steps on this rank's rows; (the node's mean loss, the node's tokens,
        seconds). Every rank must call it for the same `step` (FSDP collectives)."""
        t0 = time.perf_counter()
        self.model.train()
        losses = []
        seek_schedule(self.sched, step * self.H)  # a node that joined late trains at the run's lr
        for i in range(self.H):
            tokens = train_batch(self.ds, self.peer_id, step * self.H + i, self.batch, self.seq_len, self.seed)
            self.inner_step(dev.to_device(rank_rows(tokens, self.rank, self.world), self.device), losses)
            if progress is not None:
                progress(i + 1, self.H)
        node = torch.stack(losses).double().mean().reshape(1).cpu()
        dist.all_reduce(node)  # each rank's rows are the same count: the node's mean is the ranks' mean
        return float(node) / self.world, self.H * self.batch * self.seq_len, time.perf_counter() - t0

    def inner_step(self, tokens: torch.Tensor, losses: list) -> None:
        with dev.autocast(self.device, self.autocast_dtype):
            loss = self.model.loss(tokens)
        self.inner_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)  # DTensor-aware: the node's global norm
        self.inner_opt.step()
        self.sched.step()
        losses.append(loss.detach().float())

    def shard_flat(self, pad_to: int) -> torch.Tensor:
        return shard_flat(self.params, int(self.local_numels.sum()), pad_to)

    def load_shard_flat(self, flat: torch.Tensor) -> None:
        load_shard_flat(self.params, flat, int(self.local_numels.sum()))

    def param_bytes(self) -> dict:
        """Exact bytes this rank holds: its parameter shards, and the AdamW state of them."""
        par = sum(local(p).numel() * local(p).element_size() for p in self.params)
        opt = 0
        for st in self.inner_opt.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    loc = local(v)
                    opt += loc.numel() * loc.element_size()
        return {"params": par, "optimizer": opt}

    @torch.no_grad()
    def evaluate(self, max_batches: int = 8) -> float:
        """The validation loss of `p2ptrain.train.data.evaluate` (same windows, batch 16): each
        batch's rows split over the ranks, per-token losses summed over them. A rank with no
        rows of a short last batch still runs the forward (FSDP needs every rank), weight 0."""
        was = self.model.training
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        try:
            for tokens in val_batches(self.ds, 16, self.seq_len, max_batches):
                rows = rank_rows(tokens, self.rank, self.world)
                weight = rows.shape[0]
                if weight == 0:
                    rows = tokens[:1]
                with dev.autocast(self.device, self.autocast_dtype):
                    loss = float(self.model.loss(rows.to(self.device)))
                total += torch.tensor([loss * weight * self.seq_len, weight * self.seq_len], dtype=torch.float64)
        finally:
            self.model.train(was)
        dist.all_reduce(total)
        return float(total[0] / total[1])
