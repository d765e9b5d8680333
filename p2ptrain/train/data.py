"""Training data: the embedded default (the Python stdlib's own source) and local files.

Data specs (the run manifest names one, plus the content hash below):
  "stdlib"          every .py file under sysconfig's stdlib directory, as bytes (vocab 256).
                    Excluded directories: site-packages / dist-packages (machine-specific
                    installs), __pycache__, and test / tests (the CPython test suite is 60 % of
                    the bytes, full of generated data and deliberately malformed files, and
                    distributions often ship it separately, e.g. Debian's libpython3.X-testsuite
                    -- leaving it out makes two machines with the same Python agree more often).
  "glob:<pattern>"  files matching a glob pattern (recursive "**" allowed), read as bytes.
  "bin:<file>"      a pre-tokenized file of little-endian uint16 token ids (< vocab_size).
  "jsonl:<glob>", "parquet:<glob>", "hf:<dir>"
                    text documents tokenized with the run's tokenizer (p2ptrain.train.tokenize).

Validation is held out BY FILE, so no validation text leaks into training through a shared
file: a file is validation iff sha256(its path relative to the data root) mod 20 == 0 (~5 %).
If that leaves either side empty (a glob of very few files), and for "bin:" (one file), the
last 5 % of tokens are held out instead. Files are read in sorted relative-path order.

`Dataset.content_hash` pins the exact tokens: peers whose stdlib differs (another Python
version or distribution) get another hash and can refuse to join a run that names this one.
The hash covers the spec's kind (not its local path, so the same files under another directory
still match), the dtype and both token arrays.

Sharding needs no coordinator: `train_batch` draws random windows from a stream keyed by
sha256(seed, peer id, step), so each peer samples its own data independently and anyone can
recompute what a peer was supposed to train on.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VAL_MODULUS = 20  # a file is validation when sha256(relpath) % 20 == 0: about 5 %
TAIL_VAL_FRACTION = 0.05
STDLIB_EXCLUDE_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests"})
SPEC_HELP = ('use "stdlib" (the embedded default), "glob:<pattern>" (e.g. glob:data/**/*.txt, '
             'read as bytes), "bin:<file>" (little-endian uint16 token ids), "jsonl:<pattern>" '
             '(a "text" field per line), "parquet:<pattern>" (a "text" column) or "hf:<dir>" '
             '(a datasets save_to_disk directory)')
TEXT_KINDS = ("jsonl", "parquet", "hf")


@dataclass(frozen=True)
class Dataset:
    spec: str
    """The spec this was loaded from."""
    train: np.ndarray
    """Training tokens, 1-D uint8 (bytes), uint16 (bin:, tokenizers up to 65536 ids) or uint32."""
    val: np.ndarray
    """Held-out validation tokens, same dtype."""
    content_hash: str
    """sha256 hex pinning kind, dtype and every token (see the module docstring)."""
    n_train_files: int
    n_val_files: int
    hash_kind: str = ""
    """The kind string `content_hash` covers (p2ptrain.train.shards sends it with the tokens)."""

    @property
    def n_tokens(self) -> int:
        return int(self.train.size + self.val.size)


_CACHE: dict[tuple, Dataset] = {}


def is_val_file(relpath: str) -> bool:
    digest = hashlib.sha256(relpath.replace(os.sep, "/").encode("utf-8")).digest()
    return int.from_bytes(digest, "big") % VAL_MODULUS == 0


def stdlib_files() -> tuple[Path, list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDE_DIRS]
        for f in filenames:
            if f.endswith(".py"):
                rels.append(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
    return root, sorted(rels)


def _glob_files(pattern: str) -> tuple[Path, list[str]]:
    # the data root is the pattern's longest directory prefix without wildcards, so the split
    # depends on paths relative to it, not on where the data sits on this machine
    parts = Path(pattern).parts
    fixed = []
    for part in parts[:-1]:
        if globlib.has_magic(part):
            break
        fixed.append(part)
    root = Path(*fixed) if fixed else Path(".")
    files = [f for f in globlib.glob(pattern, recursive=True) if os.path.isfile(f)]
    return root, sorted(os.path.relpath(f, root).replace(os.sep, "/") for f in files)


def _split_files(root: Path, rels: list[str]) -> tuple[np.ndarray, np.ndarray, int, int]:
    train_parts, val_parts = [], []
    for rel in rels:
        (val_parts if is_val_file(rel) else train_parts).append((root / rel).read_bytes())
    if not train_parts or not val_parts or not any(val_parts):
        whole = np.frombuffer(b"".join(train_parts + val_parts), np.uint8)
        train, val = _tail_split(whole)
        return train, val, len(rels), 0
    return (np.frombuffer(b"".join(train_parts), np.uint8), np.frombuffer(b"".join(val_parts), np.uint8),
            len(train_parts), len(val_parts))


def _tail_split(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, math.ceil(tokens.size * TAIL_VAL_FRACTION))
    return tokens[:-n_val], tokens[-n_val:]


def _hash(kind: str, train: np.ndarray, val: np.ndarray) -> str:
    h = hashlib.sha256(f"p2ptrain-data-v1|{kind}|{train.dtype.name}|{train.size}|{val.size}|".encode())
    h.update(train.astype(train.dtype.newbyteorder("<"), copy=False).tobytes())
    h.update(val.astype(val.dtype.newbyteorder("<"), copy=False).tobytes())
    return h.hexdigest()


def load_dataset(spec: str = "stdlib", vocab_size: int = 256, tokenizer_json: bytes | None = None) -> Dataset:
    """Load (and cache in-process) the dataset named by `spec`; ValueError with advice if not.
    `tokenizer_json`: the run's tokenizer.json for the text kinds (None: bytes)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty data spec; {SPEC_HELP}")
    spec = spec.strip()
    kind, _, arg = spec.partition(":")
    well_formed = spec == "stdlib" or (kind in ("glob", "bin", *TEXT_KINDS) and arg.strip() != "")
    if not well_formed:
        raise ValueError(f"malformed data spec {spec!r}; {SPEC_HELP}")
    tok = None
    if kind in TEXT_KINDS:
        from p2ptrain.train.tokenize import RunTokenizer

        tok = RunTokenizer(tokenizer_json)
        if tok.vocab_size > vocab_size:
            raise ValueError(f"the tokenizer has {tok.vocab_size} ids, the model's vocab_size is {vocab_size}")
    elif kind != "bin" and vocab_size < 256:
        raise ValueError(f"byte-level data needs vocab_size >= 256, got {vocab_size}")
    key = (spec, vocab_size, os.path.abspath(arg) if arg else "", tok.sha256 if tok else "")
    if key in _CACHE:
        return _CACHE[key]

    if tok is not None:
        from p2ptrain.train.tokenize import tokenize_spec

        train, val, *n_files = tokenize_spec(kind, arg, tok)
        n_files = tuple(n_files)
        kind = f"{kind}|tok={tok.sha256 or 'bytes'}"  # the hash pins the tokenizer too
    elif kind == "bin":
        path = Path(arg)
        if not path.is_file():
            raise ValueError(f"bin: file {arg!r} does not exist; {SPEC_HELP}")
        raw = path.read_bytes()
        if len(raw) % 2 or len(raw) < 4:
            raise ValueError(f"bin: file {arg!r} has {len(raw)} bytes; expected an even number "
                             "(little-endian uint16 token ids), at least 2 tokens")
        tokens = np.frombuffer(raw, "<u2").astype(np.uint16)
        if int(tokens.max()) >= vocab_size:
            raise ValueError(f"bin: file {arg!r} holds token id {int(tokens.max())} >= vocab_size "
                             f"{vocab_size}; retokenize or raise the model's vocab_size")
        train, val = _tail_split(tokens)
        n_files = (1, 0)
    else:
        root, rels = stdlib_files() if kind == "stdlib" else _glob_files(arg)
        if not rels:
            where = f"under {root}" if kind == "stdlib" else f"matching {arg!r}"
            raise ValueError(f"no data files {where}; {SPEC_HELP}")
        train, val, *n_files = _split_files(root, rels)
        n_files = tuple(n_files)
    if train.size < 2 or val.size < 2:
        raise ValueError(f"data spec {spec!r} holds too few tokens ({train.size + val.size}) to train on")
    ds = Dataset(spec, train, val, _hash(kind, train, val), *n_files, hash_kind=kind)
    _CACHE[key] = ds
    return ds


def load_run_dataset(spec, tokenizer_json: bytes | None = None) -> Dataset:
    """The dataset a run (`p2ptrain.run.spec.RunSpec`) names, from this machine's files."""
    return load_dataset(spec.data.spec, int(spec.model.config["vocab_size"]), tokenizer_json)


def _check_window(tokens: np.ndarray, seq_len: int, what: str) -> int:
    if seq_len < 1:
        raise ValueError("seq_len must be >= 1")
    n_starts = tokens.size - seq_len  # a window holds seq_len + 1 tokens
    if n_starts < 1:
        raise ValueError(f"{what} split has {tokens.size} tokens, too few for windows of {seq_len + 1}")
    return n_starts


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    idx = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    return torch.from_numpy(tokens[idx].astype(np.int64))


def batch_starts(n_starts: int, peer_id: bytes, step: int, batch: int, seed: int) -> np.ndarray:
    """Window offsets for (seed, peer, step): SHAKE-256 of the key, 64 bits per window, mod
    n_starts (bias < n_starts / 2**64). Hash-derived rather than a numpy Generator so that the
    stream cannot change with the numpy version: any peer can recompute it."""
    if not isinstance(peer_id, (bytes, bytearray)):
        raise TypeError("peer_id must be bytes")
    if step < 0 or seed < 0 or batch < 1:
        raise ValueError("step and seed must be >= 0, batch >= 1")
    key = b"p2ptrain-batch-v1|" + seed.to_bytes(8, "big") + step.to_bytes(8, "big") + \
        len(peer_id).to_bytes(2, "big") + bytes(peer_id)
    words = np.frombuffer(hashlib.shake_256(key).digest(8 * batch), "<u8")
    return (words % np.uint64(n_starts)).astype(np.int64)


def train_batch(ds: Dataset, peer_id: bytes, step: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """LongTensor [batch, seq_len + 1] of random training windows for this peer and step."""
    n_starts = _check_window(ds.train, seq_len, "train")
    return _windows(ds.train, batch_starts(n_starts, peer_id, step, batch, seed), seq_len)


def val_batches(ds: Dataset, batch: int, seq_len: int, max_batches: int | None = None) -> list[torch.Tensor]:
    """Fixed validation windows: non-overlapping, evenly spread over the whole split, at most
    batch * max_batches of them. Identical on every peer (no randomness)."""
    n_starts = _check_window(ds.val, seq_len, "validation")
    n_windows = (ds.val.size - 1) // seq_len  # non-overlapping windows (adjacent ones share 1 token)
    total = n_windows if max_batches is None else min(n_windows, batch * max_batches)
    picks = np.arange(total, dtype=np.int64) * n_windows // total
    starts = np.minimum(picks * seq_len, n_starts - 1)
    return [_windows(ds.val, starts[i:i + batch], seq_len) for i in range(0, total, batch)]


@torch.no_grad()
def evaluate(model, ds: Dataset, batch: int = 32, seq_len: int | None = None,
             max_batches: int | None = 16) -> float:
    """Mean validation loss (per token) over `val_batches`; restores the model's mode."""
    seq_len = seq_len or model.cfg.max_seq_len
    was_training = model.training
    model.eval()
    try:
        total, count = 0.0, 0
        device = next(model.parameters()).device
        for tokens in val_batches(ds, batch, seq_len, max_batches):
            tokens = tokens.to(device)
            n = tokens.shape[0] * seq_len
            total += float(model.loss(tokens)) * n
            count += n
    finally:
        model.train(was_training)
    return total / count
