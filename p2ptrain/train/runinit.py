"""`p2ptrain init`'s model, tokenizer and data options (kept here so cli/init.py only calls in).

    --model hf:PATH     a Hugging Face config.json (or its directory; p2ptrain.train.hf)
    --tokenizer PATH    a tokenizer.json (or its directory; p2ptrain.train.tokenize); default bytes

The manifest gains keys, never changes existing ones: the model section of an HF run is
p2ptrain.train.hf's; the data section adds `tokenizer_sha256` (only when a tokenizer is
given) and `n_tokens` (bounds what a joiner downloads, p2ptrain.train.shards). init writes
the tokenizer next to run.toml, where `join --manifest` finds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch: not while `p2ptrain init --help` builds its parser
    from p2ptrain.train.data import Dataset


def add_init_args(p) -> None:
    p.add_argument("--model", default="", metavar="hf:PATH",
                   help="a Hugging Face model: hf:path/config.json or hf:DIR (with model.safetensors there, "
                        "training starts from those weights); default: --preset")
    p.add_argument("--tokenizer", default="", metavar="PATH",
                   help="a Hugging Face tokenizer.json (or its directory) for jsonl:/parquet:/hf: data; "
                        "default: bytes")


@dataclass
class Prepared:
    model: dict
    weights: Path | None
    tokenizer: bytes | None
    ds: Dataset
    data_extra: dict


def prepare(args) -> Prepared:
    """Model section, tokenizer and tokenized data for `args`; ValueError with advice."""
    from p2ptrain.train.data import load_dataset
    from p2ptrain.train.hf import model_section_from_args
    from p2ptrain.train.tokenize import load_tokenizer_file

    model, weights = model_section_from_args(args)
    tok = load_tokenizer_file(args.tokenizer) if getattr(args, "tokenizer", "") else None
    if tok is not None and args.data.partition(":")[0] not in ("jsonl", "parquet", "hf"):
        raise ValueError("--tokenizer applies to jsonl:, parquet: and hf: data only")
    ds = load_dataset(args.data, int(model["vocab_size"]), tok)
    extra: dict = {"n_tokens": ds.n_tokens}
    if tok is not None:
        import hashlib

        extra["tokenizer_sha256"] = hashlib.sha256(tok).hexdigest()
    return Prepared(model, weights, tok, ds, extra)


def write_extras(out: Path, prep: Prepared) -> None:
    if prep.tokenizer is not None:
        from p2ptrain.ckpt import checkpoint

        checkpoint.write_atomic(Path(out) / "tokenizer.json", prep.tokenizer)
