"""Hugging Face models: `p2ptrain init --model hf:PATH`, and building a run's model on a peer.

PATH is a local `config.json` or a directory holding one; any architecture that
`transformers.AutoModelForCausalLM` builds from a config works. Nothing is ever downloaded
(HF_HUB_OFFLINE=1 is set before transformers is imported, and only `from_config` is used):
the config comes from the signed manifest, the weights from the run's state.

The manifest's model section for such a run (the preset sections are unchanged):
    kind = "hf", config_json = "<the config, canonical JSON>", config_sha256, vocab_size,
    max_seq_len, weights_sha256 ("" when the weights come from the seed).
The config travels as one canonical JSON string, not as a TOML table: HF configs hold
nulls and nested tables that TOML cannot express, and the string round-trips exactly.

Initial weights: from the run seed (global torch RNG seeded inside `fork_rng`, so the
caller's RNG is untouched; identical on every peer of one torch/transformers version), or
from `model.safetensors` next to config.json (continued pre-training / fine-tuning). Either
way they are pinned by the genesis checkpoint's hash in the manifest, and joiners load
them from that checkpoint, never from their own init.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

# Before any transformers/huggingface_hub import: no hub access at run time, ever.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MACHINE_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
"""config.json fields that describe where/how a file was saved, not the model: dropped so
two copies of one model pin the same config."""
MAX_CONFIG_JSON = 16 * 1024  # the manifest is capped at 32 KiB (p2ptrain.run.manifest)


class HFModelError(ValueError):
    pass


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def resolve_path(path: str | Path) -> tuple[Path, Path | None]:
    """(config.json, model.safetensors or None) for an `hf:` PATH."""
    p = Path(path).expanduser()
    cfg = p / "config.json" if p.is_dir() else p
    if not cfg.is_file():
        raise HFModelError(f"hf:{path}: no config.json there (give a config.json or a directory holding one)")
    weights = cfg.parent / "model.safetensors"
    return cfg, weights if weights.is_file() else None


def model_section(path: str | Path) -> tuple[dict, Path | None]:
    """The manifest's model section for `hf:PATH`, and the weights file to start from."""
    cfg_path, weights = resolve_path(path)
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise HFModelError(f"{cfg_path} is not a JSON file: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise HFModelError(f"{cfg_path} has no model_type: not a Hugging Face model config")
    config = {k: v for k, v in config.items() if k not in MACHINE_KEYS}
    text = canonical_json(config)
    if len(text) > MAX_CONFIG_JSON:
        raise HFModelError(f"{cfg_path} is {len(text)} bytes as canonical JSON, over {MAX_CONFIG_JSON}")
    hf_cfg = _auto_config(config)  # fail at init, not on every peer
    vocab = int(getattr(hf_cfg, "vocab_size", 0) or 0)
    max_len = int(getattr(hf_cfg, "max_position_embeddings", 0) or 0)
    if vocab < 2 or max_len < 2:
        raise HFModelError(f"{cfg_path}: vocab_size and max_position_embeddings must be set")
    section = {"kind": "hf", "config_json": text, "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
               "vocab_size": vocab, "max_seq_len": max_len,
               "weights_sha256": _file_sha256(weights) if weights else ""}
    return section, weights


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _auto_config(config: dict):
    from transformers import AutoConfig

    d = dict(config)
    try:
        return AutoConfig.for_model(d.pop("model_type"), **d)
    except (ValueError, KeyError, TypeError) as exc:
        raise HFModelError(f"transformers cannot build this config: {exc}") from None


class HFCausalLM(nn.Module):
    """A transformers causal LM with the interface peers train (`loss(tokens)`, `cfg`)."""

    def __init__(self, hf: nn.Module, vocab_size: int, max_seq_len: int) -> None:
        super().__init__()
        self.hf = hf
        self.cfg = SimpleNamespace(vocab_size=vocab_size, max_seq_len=max_seq_len)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy: predict tokens[:, 1:] from tokens[:, :-1] (fp32 loss
        whatever the autocast dtype of the logits)."""
        logits = self.forward(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_hf(section: dict, seed: int, weights: Path | None = None) -> HFCausalLM:
    """The section's model on the CPU in fp32: seeded init, or the safetensors weights."""
    from transformers import AutoModelForCausalLM

    text = section["config_json"]
    if hashlib.sha256(text.encode()).hexdigest() != section.get("config_sha256"):
        raise HFModelError("the manifest's HF config does not match its config_sha256")
    hf_cfg = _auto_config(json.loads(text))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(hf_cfg)  # no dtype kwarg: renamed across versions
    if weights is not None:
        from safetensors.torch import load_file

        missing, unexpected = hf.load_state_dict(load_file(str(weights)), strict=False)
        # tied heads are saved once; anything else missing means another model's file
        missing = [k for k in missing if "lm_head" not in k]
        if missing or unexpected:
            raise HFModelError(f"{weights} does not fit the config: missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}")
        if getattr(hf_cfg, "tie_word_embeddings", False):
            hf.tie_weights()
    hf.float()
    return HFCausalLM(hf, int(section["vocab_size"]), int(section["max_seq_len"]))


def build_run_model(section: dict, seed: int, weights: Path | None = None) -> nn.Module:
    """The model a manifest's model section names: an HF model (kind = "hf") or a preset
    Transformer (sections without a kind, as every manifest before HF support has)."""
    if section.get("kind") == "hf":
        return build_hf(section, seed, weights)
    from p2ptrain.train.model import ModelConfig, build_model

    return build_model(ModelConfig.from_dict(section), seed)


def model_section_from_args(args) -> tuple[dict, Path | None]:
    """`init`'s model section: the preset's config (unchanged) or `--model hf:PATH`'s."""
    spec = getattr(args, "model", None) or ""
    if spec:
        kind, _, path = spec.partition(":")
        if kind != "hf" or not path:
            raise HFModelError(f"--model {spec!r}: expected hf:PATH (a config.json or its directory)")
        return model_section(path)
    from p2ptrain.train.model import ModelConfig

    return ModelConfig.preset(args.preset).to_dict(), None
