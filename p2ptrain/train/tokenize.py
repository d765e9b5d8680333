"""Text data with a run's tokenizer: `--data jsonl:GLOB | parquet:GLOB | hf:DIR`, `--tokenizer`.

Tokenizer: raw bytes (the default, vocab 256) or a Hugging Face `tokenizer.json` (the
`tokenizers` library, no transformers needed). The manifest pins it by the SHA-256 of the
file's bytes (data.tokenizer_sha256); peers that lack the file fetch it by that hash.

Formats (documents are tokenized one by one and concatenated, each followed by the
tokenizer's end-of-text token when it has one of END_TOKENS, else by the encoding of "\\n\\n"):
  jsonl:GLOB    every non-blank line of every matching file is a JSON object with a string
                field "text"
  parquet:GLOB  the "text" column of every matching file (pyarrow)
  hf:DIR        a dataset saved with `datasets`' save_to_disk: its "text" column; a
                DatasetDict uses its "train" split (and "validation"/"test" as validation)
Validation is held out by file as in p2ptrain.train.data (sha256(relative path) % 20 == 0),
falling back to the last 5 % of tokens when that leaves a side empty.

Tokenization is cached on disk (P2PTRAIN_CACHE, default ~/.p2ptrain/cache/tokens), keyed by
the SHA-256 of every input file's bytes and the tokenizer's hash: a second `init`, or a peer
restart, reads the token arrays instead of re-tokenizing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

TEXT_KINDS = ("jsonl", "parquet", "hf")
END_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
MAX_TOKENIZER_BYTES = 64 << 20
_ENCODE_BATCH = 1024


class TokenizerError(ValueError):
    pass


class RunTokenizer:
    """Bytes (json_bytes None) or a tokenizer.json; `sha256` is "" for bytes."""

    def __init__(self, json_bytes: bytes | None = None) -> None:
        self.json_bytes = json_bytes
        if json_bytes is None:
            self.sha256, self.vocab_size, self._tok = "", 256, None
            self.sep = np.frombuffer(b"\n\n", np.uint8).astype(np.uint32)
            return
        if len(json_bytes) > MAX_TOKENIZER_BYTES:
            raise TokenizerError(f"tokenizer.json of {len(json_bytes)} bytes is over {MAX_TOKENIZER_BYTES}")
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(json_bytes.decode("utf-8"))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"not a tokenizers tokenizer.json: {exc}") from None
        self.sha256 = hashlib.sha256(json_bytes).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        end = next((self._tok.token_to_id(t) for t in END_TOKENS if self._tok.token_to_id(t) is not None), None)
        self.sep = np.array([end] if end is not None else self._tok.encode("\n\n", add_special_tokens=False).ids,
                            np.uint32)

    @property
    def dtype(self) -> np.dtype:
        if self._tok is None:
            return np.dtype(np.uint8)
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def encode_docs(self, texts: list[str]) -> np.ndarray:
        """The documents' tokens, each followed by `sep`, as one array of `dtype`."""
        parts: list[np.ndarray] = []
        for i in range(0, len(texts), _ENCODE_BATCH):
            batch = texts[i:i + _ENCODE_BATCH]
            if self._tok is None:
                ids = [np.frombuffer(t.encode("utf-8"), np.uint8) for t in batch]
            else:
                ids = [np.asarray(e.ids, np.uint32) for e in self._tok.encode_batch(batch, add_special_tokens=False)]
            for a in ids:
                parts += [a.astype(self.dtype, copy=False), self.sep.astype(self.dtype)]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)


def load_tokenizer_file(path: str | Path) -> bytes:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise TokenizerError(f"--tokenizer {path}: no tokenizer.json there")
    data = p.read_bytes()
    RunTokenizer(data)  # must parse
    return data


# -- reading documents ------------------------------------------------------------------
def _jsonl_texts(path: Path) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line).get("text")
            except (ValueError, AttributeError):
                text = None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{n}: not a JSON object with a string field 'text'")
            out.append(text)
    return out


def _parquet_texts(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        col = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    except (KeyError, ValueError, OSError) as exc:
        raise ValueError(f"{path}: no readable 'text' column ({exc})") from None
    return [t for t in col if isinstance(t, str)]


def _hf_splits(directory: str) -> list[tuple[str, list[str], bool | None]]:
    """(name, texts, is_validation or None = split by hash) from a save_to_disk directory."""
    import datasets

    try:
        ds = datasets.load_from_disk(directory)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"hf:{directory}: not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"hf:{directory}: a DatasetDict without a 'train' split ({list(ds)})")
        val = next((s for s in ("validation", "test") if s in ds), None)
        out = [("train", ds["train"], False)] + ([(val, ds[val], True)] if val else [])
    else:
        out = [("all", ds, None)]
    res = []
    for name, d, is_val in out:
        if "text" not in d.column_names:
            raise ValueError(f"hf:{directory}: split {name!r} has no 'text' column ({d.column_names})")
        res.append((name, [t for t in d["text"] if isinstance(t, str)], is_val if len(out) > 1 else None))
    return res


def _files(kind: str, arg: str) -> tuple[Path, list[str]]:
    if kind == "hf":
        root = Path(arg).expanduser()
        if not root.is_dir():
            raise ValueError(f"hf:{arg}: no such directory")
        return root, sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    from p2ptrain.train.data import _glob_files

    return _glob_files(arg)


def cache_key(kind: str, root: Path, rels: list[str], tok: RunTokenizer) -> str:
    h = hashlib.sha256(f"p2ptrain-tokcache-v1|{kind}|{tok.sha256}|".encode())
    for rel in rels:
        fh = hashlib.sha256()
        with open(root / rel, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                fh.update(block)
        h.update(f"{rel}\0{fh.hexdigest()}\0".encode())
    return h.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("P2PTRAIN_CACHE", "~/.p2ptrain/cache")).expanduser() / "tokens"


def tokenize_spec(kind: str, arg: str, tok: RunTokenizer) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(train tokens, val tokens, train files, val files) for a text spec; cached on disk."""
    from p2ptrain.train.data import _tail_split, is_val_file

    root, rels = _files(kind, arg)
    if not rels:
        from p2ptrain.train.data import SPEC_HELP

        raise ValueError(f"no data files matching {kind}:{arg}; {SPEC_HELP}")
    path = cache_dir() / f"{cache_key(kind, root, rels, tok)}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                return z["train"], z["val"], int(z["n"][0]), int(z["n"][1])
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache file: tokenize again and overwrite it
    if kind == "hf":
        units = [(name, texts, v) for name, texts, v in _hf_splits(arg)]
    else:
        read = _jsonl_texts if kind == "jsonl" else _parquet_texts
        units = [(rel, read(root / rel), None) for rel in rels]
    train_parts, val_parts = [], []
    for name, texts, is_val in units:
        val = is_val_file(name) if is_val is None else is_val
        (val_parts if val else train_parts).append(tok.encode_docs(texts))
    if not train_parts or not val_parts or not sum(p.size for p in val_parts):
        train, val = _tail_split(np.concatenate(train_parts + val_parts))
        n = (len(units), 0)
    else:
        train, val = np.concatenate(train_parts), np.concatenate(val_parts)
        n = (len(train_parts), len(val_parts))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez(tmp, train=train, val=val, n=np.array(n, np.int64))
    os.replace(tmp, path)
    return train, val, n[0], n[1]
