"""Small local Hugging Face artifacts made inside the tests: a tiny Llama config, a BPE
tokenizer trained with tokenizers' BpeTrainer, and jsonl/parquet/save_to_disk text data.
Nothing comes from a hub."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
         "max_position_embeddings": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False, "_name_or_path": "/somewhere/else", "transformers_version": "0"}


def texts(n_docs: int = 120) -> list[str]:
    """Deterministic English-and-code documents: paragraphs of this Python's stdlib sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for name in ("textwrap.py", "fractions.py", "difflib.py", "heapq.py", "bisect.py", "shlex.py", "argparse.py",
                 "typing.py", "inspect.py"):
        body = (root / name).read_text(encoding="utf-8")
        docs += [p.strip() for p in body.split("\n\n") if len(p.strip()) > 40]
    return docs[:n_docs]


def write_llama(directory: Path, **overrides) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**LLAMA, **overrides}))
    return directory


def train_bpe(path: Path, vocab_size: int = 384) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def write_jsonl(directory: Path, n_files: int = 6, n_docs: int = 600) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    docs = texts(n_docs)
    for i in range(n_files):
        with open(directory / f"part{i}.jsonl", "w") as f:
            for d in docs[i::n_files]:
                f.write(json.dumps({"text": d, "id": i}) + "\n")
    return f"jsonl:{directory}/*.jsonl"
