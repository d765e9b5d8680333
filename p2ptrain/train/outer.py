"""DiLoCo's outer step, as pure torch math (no networking).

Each peer trains its own copy of the model for H inner steps (AdamW), then the peers average
their pseudo-gradients  delta = outer_params - local_params  (the network does this with the
int8 ring all-reduce) and every peer applies the same Nesterov SGD step to the shared outer
parameters, which then replace the local model's parameters.

Bit-identical outer state on every peer: given the same outer state and the same averaged
pseudo-gradient bytes, `OuterOptimizer.step` must produce the same bytes on any machine, so
peers can compare `params_sha256()`. torch.optim.SGD computes `d + momentum * buf` and
`p - lr * d` with `add(alpha=...)`, which torch's CPU kernels evaluate as fused multiply-adds
where the instruction set has them (measured here: up to 1 ulp away from separately rounded
operations) -- the result would then depend on the peer's CPU and on how the compiler built
the scalar tail loop. We apply the same update rule as separate multiplies and adds instead:
every operation is a single IEEE-754 rounding, identical on every conforming CPU. The result
equals torch.optim.SGD(momentum, nesterov=True) to within an ulp per step (tests check both
this and exact equality with a numpy float32 reference of the same formula).

Failed rounds (`skip`): the local model keeps its parameters and keeps training; the outer
parameters and momentum are unchanged. The next pseudo-gradient, outer - local, then covers
every inner step since the last successful outer step (2H after one failure), so no local work
is thrown away (reverting to the outer parameters would discard H steps of compute). This is
the behaviour of the DiLoCo paper's dropped-gradient experiments and OpenDiLoCo.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import torch

from p2ptrain.train import device


def flatten(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """One new contiguous fp32 HOST vector of all tensors, in the given order, wherever they
    live (p2ptrain.train.device: pinned when CUDA is available, copies overlapped)."""
    return device.gather_to_host(list(params))


def unflatten_into(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of host vector `flat` into `params` (in place, no autograd)."""
    device.scatter_from_host(flat, params)


def sha256_f32(flat: torch.Tensor) -> str:
    # .cpu(): a CUDA tensor has no .numpy() (a no-op for the host vectors of OuterOptimizer)
    return hashlib.sha256(flat.detach().cpu().contiguous().numpy().astype("<f4", copy=False).tobytes()).hexdigest()


@dataclass
class OuterConfig:
    lr: float = 0.7
    """Outer learning rate (DiLoCo paper: 0.7). 1.0 with momentum 0 is plain model averaging."""
    momentum: float = 0.9
    """Outer momentum (paper: 0.9)."""
    nesterov: bool = True
    """Nesterov momentum (the paper's choice); False gives heavy-ball momentum. With momentum 0
    both are plain SGD (allowed, unlike torch.optim.SGD, so a manifest can set momentum 0 alone)."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"outer lr must be positive and finite, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")


class OuterOptimizer:
    """The global (outer) parameters of one model, and the Nesterov step on them."""

    def __init__(self, model: torch.nn.Module, cfg: OuterConfig | None = None):
        self.cfg = cfg or OuterConfig()
        self.params = list(model.parameters())
        self.outer = flatten(self.params)
        # zeros, not torch's "first buf = grad": 0 * m + g == g exactly, and a fixed-size tensor
        # keeps checkpoints uniform. Host memory, like `outer` (p2ptrain.train.device).
        self.momentum = device.host_empty(self.outer.numel()).zero_()
        self._staging = device.host_empty(self.outer.numel())  # reused by pseudo_gradient
        self.steps = 0
        """Successful outer steps applied."""
        self.skipped = 0
        """Rounds that failed since the last successful step (see the module docstring)."""

    @property
    def numel(self) -> int:
        return self.outer.numel()

    def pseudo_gradient(self, model: torch.nn.Module | None = None) -> torch.Tensor:
        """outer_params - current params, fp32 (new tensor). `model` defaults to the one given
        at construction (its parameters are the ones this optimizer writes)."""
        params = self.params if model is None else list(model.parameters())
        return self.outer - device.gather_to_host(params, self._staging)

    def step(self, avg_pseudo_grad: torch.Tensor, load_model: bool = True, frags=None, t: int = 0) -> None:
        """Nesterov SGD on the outer parameters with grad = avg_pseudo_grad, then load them
        into the model (not with load_model=False: an overlapped run's model keeps training in
        another thread, p2ptrain.train.overlap). Separately rounded ops only (module
        docstring): bit-portable. `frags` (p2ptrain.train.fragments.Fragments, P > 1): the
        grad is step t's fragment, and only its params and momenta move, by the same
        elementwise operations as a full step."""
        g = avg_pseudo_grad.detach().to("cpu", torch.float32).reshape(-1)
        whole = frags is None or frags.P == 1
        want = self.outer.numel() if whole else frags.size(t)
        if g.numel() != want:
            raise ValueError(f"pseudo-gradient has {g.numel()} values, the model {'' if whole else 'fragment '}{want}")
        if not bool(torch.isfinite(g).all()):
            raise ValueError("pseudo-gradient holds inf or NaN; refusing to apply it")
        m, lr = self.cfg.momentum, self.cfg.lr
        x, buf = (self.outer, self.momentum) if whole else (frags.part(self.outer, t), frags.part(self.momentum, t))
        if m > 0:
            buf.mul_(m).add_(g)          # buf = m * buf + g
            d = torch.mul(buf, m).add_(g) if self.cfg.nesterov else buf
        else:
            d = g
        x.sub_(torch.mul(d, lr))          # p = p - lr * d
        if not whole:  # `part` copied the fragment out: write it back
            frags.put(self.outer, t, x)
            frags.put(self.momentum, t, buf)
        self.steps += 1
        self.skipped = 0
        if load_model:
            self.load_into_model()

    def candidate(self, avg_pseudo_grad: torch.Tensor) -> torch.Tensor:
        """The outer parameters `step(avg_pseudo_grad)` would produce (a whole-model step):
        `candidate` on this optimizer's state; nothing here moves."""
        return candidate(self.outer, self.momentum, self.cfg, avg_pseudo_grad)

    def skip(self) -> None:
        """A round failed: keep the local parameters and outer state (module docstring)."""
        self.skipped += 1

    def load_into_model(self) -> None:
        unflatten_into(self.outer, self.params)

    def params_sha256(self) -> str:
        """SHA-256 of the outer parameters' little-endian fp32 bytes, in parameter order."""
        return sha256_f32(self.outer)

    def state_dict(self) -> dict:
        return {"outer": self.outer.clone(), "momentum": self.momentum.clone(), "steps": self.steps,
                "skipped": self.skipped, "config": asdict(self.cfg)}

    def load_state_dict(self, state: dict, load_model: bool = True) -> None:
        outer = torch.as_tensor(state["outer"], dtype=torch.float32).reshape(-1)
        momentum = torch.as_tensor(state["momentum"], dtype=torch.float32).reshape(-1)
        if outer.numel() != self.numel or momentum.numel() != self.numel:
            raise ValueError(f"outer state holds {outer.numel()} / {momentum.numel()} values, "
                             f"the model {self.numel} (checkpoint of another model config?)")
        steps, skipped = int(state.get("steps", 0)), int(state.get("skipped", 0))  # may raise: before any change
        self.outer = device.host_copy(outer)
        self.momentum = device.host_copy(momentum)
        self.steps, self.skipped = steps, skipped
        # A checkpoint's "config" is ignored: hyperparameters come only from the signed run
        # manifest (a donor must not be able to set the outer lr of whoever loads its state).
        if load_model:
            self.load_into_model()


def candidate(outer: torch.Tensor, momentum: torch.Tensor, cfg: OuterConfig,
              avg_pseudo_grad: torch.Tensor) -> torch.Tensor:
    """The outer parameters a whole-model `OuterOptimizer.step` from (outer, momentum) would
    produce, momentum included, as a new tensor (the loss gate scores it,
    p2ptrain.run.lossgate): the same separately rounded operations as `step`."""
    g = avg_pseudo_grad.detach().to("cpu", torch.float32).reshape(-1)
    if g.numel() != outer.numel() or momentum.numel() != outer.numel():
        raise ValueError(f"pseudo-gradient has {g.numel()} values, the model {outer.numel()}")
    m, lr = cfg.momentum, cfg.lr
    if m > 0:
        buf = torch.mul(momentum.reshape(-1), m).add_(g)
        d = torch.mul(buf, m).add_(g) if cfg.nesterov else buf
    else:
        d = g
    return outer.reshape(-1) - torch.mul(d, lr)


def lr_lambda(warmup: int, total_steps: int, schedule: str = "cosine", min_ratio: float = 0.1,
              decay_fraction: float = 0.2):
    """Multiplier of the peak lr at a step: linear warmup, then
    cosine: cosine decay to min_ratio at total_steps;
    wsd (warmup-stable-decay): flat, then linear decay to min_ratio over the last
    decay_fraction of the steps (lets a run be extended without restarting its schedule)."""
    if schedule not in ("cosine", "wsd"):
        raise ValueError(f"schedule must be 'cosine' or 'wsd', got {schedule!r}")
    if warmup < 0 or total_steps < 1 or warmup > total_steps:
        raise ValueError("need 0 <= warmup <= total_steps and total_steps >= 1")
    if not 0 <= min_ratio <= 1 or not 0 < decay_fraction <= 1:
        raise ValueError("min_ratio must be in [0, 1], decay_fraction in (0, 1]")

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
        decay_start = total_steps - max(1, round(decay_fraction * (total_steps - warmup)))
        if step < decay_start:
            return 1.0
        t = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return 1.0 - (1 - min_ratio) * t

    return f


def make_inner_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, warmup: int,
                         total_steps: int, schedule: str = "cosine", min_ratio: float = 0.1,
                         betas: tuple[float, float] = (0.9, 0.95)):
    """(AdamW, LambdaLR) for the inner loop. Weight decay applies to matrices only (not to
    RMSNorm gains, where it would only pull the scale toward 0)."""
    if not (lr > 0 and weight_decay >= 0):
        raise ValueError("inner lr must be > 0 and weight_decay >= 0")
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total_steps, schedule, min_ratio))
    return opt, sched


def seek_schedule(sched, position: int) -> None:
    """Put the inner schedule (`make_inner_optimizer`'s LambdaLR) at the run's inner step
    `position` (outer step x steps per phase), as `position` calls of `step` would. A peer
    that adopted state t counted its schedule from its own start, so it trained at warmup
    or peak lr while the others were deep in the cosine, and its first contribution was
    rejected as a norm outlier for good (an overlapped newcomer test, 2026-11-26)."""
    sched.last_epoch = position
    for g, base, lam in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        g["lr"] = base * lam(position)
    sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
