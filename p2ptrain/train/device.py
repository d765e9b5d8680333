"""Where a peer's tensors live, and in which precision its inner steps run.

The GPU (when there is one) holds only the model, its inner optimizer and the batch. The
outer state -- the fp32 master copy of the parameters and the Nesterov momentum -- and the
pseudo-gradient live in host memory, as in prime/OpenDiLoCo: the outer step runs once every
H inner steps, is bit-portable only as separately rounded fp32 CPU ops (p2ptrain.train.outer),
and the all-reduce reads and writes host bytes anyway. Host buffers are pinned (page-locked)
when CUDA is available, so device<->host copies can run with `non_blocking=True` and overlap
each other; without CUDA, pinning is impossible (torch raises) and plain memory is used, with
the same code path.

Precision: `auto` is bf16 autocast on a GPU that supports bf16, fp32 elsewhere; `bf16`
forces autocast (on CPU too, where torch supports it); `fp32` disables it. The parameters,
the optimizer state and the outer state stay fp32 in every mode (autocast only changes
the dtype of matmul inputs), so peers in different modes still average the same fp32 vectors.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import torch

# The user's request and its flags live in a torch-free module (the CLI parser imports it).
from p2ptrain.train.devicecfg import DEVICE_HELP, PRECISIONS, DeviceConfig, add_device_args  # noqa: F401


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(spec: str = "auto") -> torch.device:
    """The torch device `spec` names; ValueError (with advice) for a GPU this machine lacks."""
    DeviceConfig(device=spec)
    if spec == "auto":
        return torch.device("cuda:0" if cuda_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not cuda_available():
            raise ValueError(f"--device {spec}: torch sees no CUDA GPU here (CPU-only torch build, or no "
                             "driver); use --device cpu")
        index = dev.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: this machine has {torch.cuda.device_count()} GPU(s)")
        dev = torch.device("cuda", index)
    return dev


def resolve_precision(spec: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `spec` on `device`, or None for plain fp32."""
    DeviceConfig(precision=spec)
    if spec == "fp32":
        return None
    if spec == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def precision_name(dtype: torch.dtype | None) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Autocast context for the forward pass (a no-op context for fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def host_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized host tensor, pinned when CUDA is available (see the module docstring)."""
    return torch.empty(numel, dtype=dtype, pin_memory=cuda_available())


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A fp32, contiguous, 1-D host copy of `t` (pinned when CUDA is available)."""
    out = host_empty(t.numel())
    out.copy_(t.detach().reshape(-1), non_blocking=True)
    sync_if_cuda([t])
    return out


def sync_if_cuda(tensors: Iterable[torch.Tensor]) -> None:
    """Wait for the non_blocking copies issued on the devices of `tensors` (device->host
    copies into pinned memory return before the bytes are there)."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for dev in devices:
        torch.cuda.synchronize(dev)


def gather_to_host(params: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Every tensor's values, in order, as one fp32 host vector: each device slice is copied
    straight into its place with non_blocking=True (the copies overlap), then one wait."""
    total = sum(p.numel() for p in params)
    if out is None:
        out = host_empty(total)
    elif out.numel() != total or out.device.type != "cpu" or out.dtype != torch.float32:
        raise ValueError("gather_to_host: `out` must be a fp32 host vector of the parameters' size")
    offset = 0
    for p in params:
        n = p.numel()
        out[offset:offset + n].copy_(p.detach().reshape(-1), non_blocking=True)
        offset += n
    sync_if_cuda(params)
    return out


def scatter_from_host(flat: torch.Tensor, params: Sequence[torch.Tensor], add: bool = False) -> None:
    """Copy consecutive slices of host vector `flat` into `params` (in place, no autograd;
    `add`: add them instead); host->device copies from pinned memory are issued
    non_blocking, then one wait so the caller may change `flat` afterwards."""
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValueError(f"flat vector has {flat.numel()} values, the parameters {total}")
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            src = flat[offset:offset + n].view_as(p)
            if add:  # a device temporary (a no-op `to` on the host), then an in-place add
                p.add_(src.to(p.device, non_blocking=True))
            else:
                p.copy_(src, non_blocking=True)
            offset += n
    sync_if_cuda(params)


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on `device`; through pinned memory with an asynchronous copy on CUDA."""
    if device.type != "cuda":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


def config_from_args(args) -> DeviceConfig:
    """The checked DeviceConfig of `join`'s arguments; ValueError (with advice) if this
    machine cannot honour it."""
    cfg = DeviceConfig(getattr(args, "device", "auto"), getattr(args, "precision", "auto"))
    resolve_precision(cfg.precision, resolve_device(cfg.device))
    return cfg
