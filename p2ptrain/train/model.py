"""A Llama-style decoder in plain torch: the model every peer trains.

Byte-level by default (vocab 256, so the embedded stdlib data needs no tokenizer). Pre-norm
residual blocks of RMSNorm -> causal self-attention with rotary position embeddings, and
RMSNorm -> SwiGLU MLP; the output head is tied to the token embedding.

Initialization is a pure function of (config, seed): the module is built on the meta device
(so torch's default initializers never touch the global RNG), then every parameter is drawn
in a fixed order from a local torch.Generator. Every peer that builds the model from the run
manifest's config and seed therefore starts from bit-identical parameters, which is what lets
a newcomer check a donor's state against the manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    vocab_size: int = 256
    """Token vocabulary; 256 = raw bytes. Token ids of the data must be < vocab_size."""
    d_model: int = 128
    """Residual stream width."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads; d_model / n_heads must be an even head dimension (for RoPE)."""
    ffn_hidden: int = 352
    """SwiGLU hidden width (about 8/3 * d_model, rounded to a multiple of 32)."""
    max_seq_len: int = 128
    """Longest sequence the rotary tables cover (the training context)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if not 2 <= self.vocab_size <= 65536:
            raise ValueError("ModelConfig.vocab_size must be in [2, 65536] (data is stored as uint8/uint16)")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dimension d_model / n_heads must be even for rotary embeddings")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError("rope_theta must be a positive finite number")
        if not (0 < self.norm_eps < 1):
            raise ValueError("norm_eps must be in (0, 1)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**PRESETS[name])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)} (manifest from a newer version?)")
        return cls(**d)

    def num_params(self) -> int:
        """Parameter count computed from the config (equals param_count(build_model(cfg)))."""
        d, f = self.d_model, self.ffn_hidden
        per_layer = 2 * d + 4 * d * d + 3 * d * f  # two norms, qkv + out, SwiGLU (w1, w3, w2)
        return self.vocab_size * d + self.n_layers * per_layer + d  # tied embedding, final norm


# Sizes: tiny is the 0.84M model of FACTS.md (CPU benchmarks), small ~10M, base ~100M.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, ffn_hidden=352, max_seq_len=128),
    "small": dict(d_model=320, n_layers=8, n_heads=5, ffn_hidden=864, max_seq_len=256),
    "base": dict(d_model=768, n_layers=14, n_heads=12, ffn_hidden=2048, max_seq_len=512),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim / 2] (computed in float64, stored fp32)."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x [B, H, T, hd] (the "half split" layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)  # residual projection

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # w1 and w3 fused into one matmul (fewer kernel launches, same math)
        self.w13 = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)  # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # derived from the config, so not part of the state dict (not persistent)
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (int64, T <= max_seq_len) -> logits [B, T, vocab_size] (fp32)."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(self.norm(x), self.embed.weight)  # head tied to the embedding

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy: predict tokens[:, 1:] from tokens[:, :-1]."""
        logits = self.forward(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """A Transformer whose parameters are a pure function of (cfg, seed).

    Normal(0, 0.02) everywhere except the residual projections (attention out, SwiGLU w2),
    which get 0.02 / sqrt(2 * n_layers) so the residual stream's variance does not grow with
    depth (GPT-2 / Llama practice); RMSNorm weights start at 1.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cpu")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():  # fixed registration order
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith(("attn.out.weight", "mlp.w2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
        cos, sin = rope_tables(cfg)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    return model


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def params_sha256(model: nn.Module) -> str:
    """SHA-256 of the parameters' fp32 little-endian bytes, in registration order."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes())
    return h.hexdigest()
