"""The model side of a peer: inner steps, pseudo-gradients, outer steps, evaluation.

Everything here is blocking torch work; the trainer calls it through `trio.to_thread`.
Given the same manifest, peer id, outer state and step, it computes bit-identical numbers
(seeded data windows, deterministic init, fixed thread count), which is what lets tests
compare parameter hashes instead of "close enough".
"""

from __future__ import annotations

import time

import numpy as np
import torch

from p2ptrain.ckpt import checkpoint
from p2ptrain.run.spec import RunSpec
from p2ptrain.train import device as dev
from p2ptrain.train.data import Dataset, evaluate, load_run_dataset, train_batch
from p2ptrain.train.fragments import Fragments
from p2ptrain.train.hf import build_run_model
from p2ptrain.train.outer import OuterConfig, OuterOptimizer, make_inner_optimizer, seek_schedule


class DataMismatch(ValueError):
    pass


def load_run_data(spec: RunSpec, tokenizer_json: bytes | None = None) -> Dataset:
    """The run's token stream from this machine's files (`tokenizer_json`: the run's
    tokenizer.json bytes when the spec names one, p2ptrain.train.tokenize)."""
    ds = load_run_dataset(spec, tokenizer_json)
    if ds.content_hash != spec.data.content_hash:
        raise DataMismatch(
            f"this machine's data for spec {spec.data.spec!r} hashes to {ds.content_hash[:16]}..., "
            f"the run was started with {spec.data.content_hash[:16]}...")
    return ds


def genesis_state(spec: RunSpec, weights=None) -> bytes:
    """The step-0 checkpoint implied by the model config and seed, or by the `weights`
    file of an HF model (what `init` writes)."""
    model = build_run_model(spec.model.config, spec.train.seed, weights)
    outer = OuterOptimizer(model, OuterConfig(float(spec.train.outer_lr), float(spec.train.outer_momentum)))
    return encode_state(outer, 0)


def decode_state(data: bytes) -> tuple[dict, int]:
    """(OuterOptimizer state dict, outer step) from checkpoint bytes (see `encode_state`)."""
    arrays, meta = checkpoint.decode(data)
    step = meta.get("outer_step", 0)
    if type(step) is not int or not 0 <= step < 1 << 40:
        raise checkpoint.CheckpointError("checkpoint outer_step is not a small non-negative integer")
    if not {"outer", "momentum"} <= set(arrays):
        raise checkpoint.CheckpointError("checkpoint holds no outer state (outer, momentum)")
    sd = {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}
    # Counters only: hyperparameters ("config") never come from a checkpoint, whoever served it.
    sd.update({k: v for k, v in meta.items() if k in ("steps", "skipped")})
    return sd, step


def encode_state(outer: OuterOptimizer, step: int) -> bytes:
    sd = outer.state_dict()
    arrays = {k: np.asarray(v.detach().cpu().numpy() if torch.is_tensor(v) else v) for k, v in sd.items()
              if torch.is_tensor(v) or isinstance(v, np.ndarray)}
    meta = {k: v for k, v in sd.items() if not (torch.is_tensor(v) or isinstance(v, np.ndarray))}
    meta["outer_step"] = step
    return checkpoint.encode(arrays, meta)


class LocalModel:
    def __init__(self, spec: RunSpec, ds: Dataset, peer_id: bytes, state: bytes, threads: int = 1,
                 device: str = "auto", precision: str = "auto") -> None:
        torch.set_num_threads(max(1, threads))
        # the model and inner optimizer on `device`; the outer state on the host
        # (p2ptrain.train.device), so the outer step is the same bytes on every peer
        self.device = dev.resolve_device(device)
        self.autocast_dtype = dev.resolve_precision(precision, self.device)
        tr = spec.train
        self.spec = spec
        self.ds = ds
        self.peer_id = peer_id
        P = tr.n_fragments
        self.H = tr.inner_steps // P
        """Inner steps per phase: H, or H / P in a streaming run (train.fragments)."""
        self.max_H = (tr.max_inner_steps or tr.inner_steps) // P
        """Overlapped runs: the most inner steps a phase may take while its round is in flight."""
        self.batch = tr.batch_size
        self.seq_len = tr.seq_len
        self.seed = tr.seed
        self.model = build_run_model(spec.model.config, self.seed).to(self.device)
        self.outer = OuterOptimizer(self.model, OuterConfig(float(tr.outer_lr), float(tr.outer_momentum)))
        self.step = self.load_state(state)
        total = tr.inner_steps * tr.planned_outer_steps
        self.inner_opt, self.sched = make_inner_optimizer(
            self.model, float(tr.inner_lr), float(tr.weight_decay), tr.warmup, total, tr.schedule)
        self.inner_done = 0
        self.n_params = int(sum(p.numel() for p in self.model.parameters()))
        self.frags = Fragments(self.n_params, P)  # ValueError when P fragments do not fit the model
        """Which fragment each outer step reduces (p2ptrain.train.fragments; P = 1: all)."""
        self.detached = False
        """Overlapped runs (p2ptrain.train.overlap): outer steps and adopted states leave the
        model alone (it trains in another thread; the overlapped loop rebases it), and
        `evaluate` scores the committed params on a copy of the model."""
        self._eval_model = None

    def load_state(self, data: bytes) -> int:
        """Raises CheckpointError for bytes that are not a state of this run's model: a
        peer can publish any bytes under a matching hash, so nothing here may crash."""
        sd, step = decode_state(data)
        try:
            self.outer.load_state_dict(sd, load_model=not getattr(self, "detached", False))
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise checkpoint.CheckpointError(f"checkpoint does not fit this run's model: {exc}") from None
        return step

    def state_bytes(self) -> bytes:
        return encode_state(self.outer, self.step)

    def inner(self, progress=None) -> tuple[float, int, float]:
        """H AdamW steps on this peer's own data; (mean loss, tokens, seconds)."""
        t0 = time.perf_counter()
        self.model.train()
        losses = []
        self.seek_schedule(self.step)
        for i in range(self.H):
            global_step = self.step * self.H + i
            tokens = train_batch(self.ds, self.peer_id, global_step, self.batch, self.seq_len, self.seed)
            self.inner_step(dev.to_device(tokens, self.device), losses)
            if progress is not None:
                progress(i + 1, self.H)
        self.inner_done += self.H
        # one device->host sync for all H losses (a float() per step would stall the GPU)
        mean = float(torch.stack(losses).double().mean())
        return mean, self.H * self.batch * self.seq_len, time.perf_counter() - t0

    def seek_schedule(self, phase: int) -> None:
        """The inner lr schedule at phase `phase`'s first step, wherever this peer started."""
        seek_schedule(self.sched, phase * self.H)

    def inner_step(self, tokens: torch.Tensor, losses: list, schedule: bool = True) -> None:
        """One AdamW step on a batch already on the device (the throughput bench times this).
        `schedule=False`: at the current learning rate, without advancing the schedule (a
        phase's extra steps: every peer's schedule stays at H steps per outer step)."""
        with dev.autocast(self.device, self.autocast_dtype):
            loss = self.model.loss(tokens)
        self.inner_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.inner_opt.step()
        if schedule:
            self.sched.step()
        losses.append(loss.detach().float())

    def pseudo_gradient(self) -> np.ndarray:
        return np.ascontiguousarray(self.outer.pseudo_gradient(self.model).detach().cpu().numpy(), np.float32)

    def outer_step(self, avg: np.ndarray) -> str:
        """Apply step `self.step`'s committed average (its fragment's, in a streaming run)."""
        self.outer.step(torch.from_numpy(np.array(avg, dtype=np.float32)), load_model=not self.detached,
                        frags=self.frags, t=self.step)
        self.step += 1
        return self.outer.params_sha256()

    evaluates_committed = True
    """`evaluate(committed=True)` scores the committed params without touching the model, so
    the trainer may run it while the next inner phase trains (`Trainer.commit_step`)."""

    def evaluate(self, max_batches: int = 8, committed: bool = False) -> float:
        model = self.model
        if committed or self.detached:  # the committed params, on a copy: the model may be mid-phase
            if self._eval_model is None:
                self._eval_model = build_run_model(self.spec.model.config, self.seed).to(self.device)
            model = self._eval_model
            with torch.no_grad():
                dev.scatter_from_host(self.outer.outer, list(model.parameters()))
        with dev.autocast(self.device, self.autocast_dtype):
            return float(evaluate(model, self.ds, batch=16, seq_len=self.seq_len, max_batches=max_batches))

    def load_state_at(self, data: bytes) -> None:
        """Adopt a state fetched from peers (catch-up): outer params, momentum and step."""
        self.step = self.load_state(data)
