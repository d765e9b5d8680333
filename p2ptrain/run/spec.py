"""`RunSpec`: what every peer of a run must agree on, typed and validated (pure: no I/O).

Both `p2ptrain init` and the library API (`p2ptrain.DiLoCo`) build one, and the run id is
`p2ptrain.run.manifest.run_id` of its dict form (plus, for `init`, the initiator's key and
signature), so there is one schema and one run-id scheme. `to_dict()` is exactly the manifest
schema `init` has always written, so existing run ids do not change; `from_dict()` reads a
manifest (ignoring `initiator`/`signature`, which belong to `p2ptrain.run.manifest`).

Sections:
  model     the architecture (`p2ptrain.train.model.ModelConfig` fields) or, for a library
            run, {"source": "user", "n_params": N}: the user's own module
  data      the data spec and its content hash ("user" and "" for a library run)
  train     the inner loop (None for a library run: the user's loop owns it) and the outer
            loop every member must run identically (inner steps, group size, outer lr and
            momentum, all-reduce mode, aggregation)
  timeouts  the join window and the exchange timeout
  genesis   SHA-256 and size of the step-0 checkpoint: the fetch bound and the step-0 anchor
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from p2ptrain.run.manifest import ManifestError

ALLREDUCE_MODES = ("int8", "fp32", "sparse")
OVERLAP_SCHEMES = ("none", "delayed", "eager")
"""How a run overlaps step t's all-reduce with step t+1's inner steps (p2ptrain.train.overlap)."""
AGGREGATIONS = ("mean", "robust")
USER = "user"
_SCALARS = (bool, int, float, str)


class SpecError(ManifestError):
    """A manifest or arguments that do not make a valid run; the message says which field."""


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise SpecError(msg)


def _int(v, name: str, lo: int = 0) -> None:
    _need(type(v) is int and v >= lo, f"{name} must be an integer >= {lo}, got {v!r}")


def _num(v, name: str, lo: float = 0.0, strict: bool = True) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > lo if strict else v >= lo)
    _need(ok, f"{name} must be a finite number {'>' if strict else '>='} {lo}, got {v!r}")


class _Section:
    def to_dict(self) -> dict:
        """The manifest table: every field, except inner-loop fields a library run leaves None."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


SPARSE_DEFAULTS = {"topk_fraction": 0.0369, "bits": 2, "chunk": 4096, "ef_decay": 0.8}
"""A sparse run's compressor unless its initiator chose another: the best `bench diloco`
configuration (issue 18). `p2ptrain init` and the library both start from it."""


@dataclass(frozen=True)
class ModelSpec:
    config: dict
    """Scalars only; treated as immutable."""

    def __post_init__(self) -> None:
        _need(isinstance(self.config, dict) and bool(self.config), "model must be a non-empty table")
        for k, v in self.config.items():
            _need(isinstance(k, str) and isinstance(v, _SCALARS), f"model.{k} must be a scalar")

    @property
    def is_user(self) -> bool:
        return self.config.get("source") == USER

    def to_dict(self) -> dict:
        return dict(self.config)


@dataclass(frozen=True)
class DataSpec(_Section):
    spec: str
    content_hash: str
    n_tokens: int | None = None
    """Tokens in the stream (bounds what a joiner downloads: p2ptrain.train.shards)."""
    tokenizer_sha256: str | None = None
    """The run's tokenizer.json (None: bytes), fetched from peers by this hash."""

    def __post_init__(self) -> None:
        _need(isinstance(self.spec, str) and bool(self.spec), "data.spec must be a non-empty string")
        _need(isinstance(self.content_hash, str), "data.content_hash must be a string")
        if self.n_tokens is not None:
            _int(self.n_tokens, "data.n_tokens")
        _need(self.tokenizer_sha256 is None or (isinstance(self.tokenizer_sha256, str) and len(self.tokenizer_sha256) == 64),
              "data.tokenizer_sha256 must be a hex SHA-256")


@dataclass(frozen=True)
class TrainSpec(_Section):
    inner_steps: int
    group_size: int
    outer_lr: float
    outer_momentum: float
    allreduce: str = "int8"
    aggregation: str = "mean"
    # The inner loop: None for a library run, whose own loop owns it.
    seed: int | None = None
    inner_lr: float | None = None
    warmup: int | None = None
    weight_decay: float | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    schedule: str | None = None
    planned_outer_steps: int | None = None
    # The compressor of a sparse run (issue 18; p2ptrain.reduce.sparsecodec.SparseConfig);
    # None, and absent from the manifest, for other runs.
    topk_fraction: float | None = None
    bits: int | None = None
    chunk: int | None = None
    ef_decay: float | None = None
    # Overlapped outer steps (issue 17; p2ptrain.train.overlap): "delayed" or "eager"; None,
    # and absent from the manifest (so older run ids do not change), for the sequential loop.
    overlap: str | None = None
    # Overlapped runs: a peer whose phase ends before the previous round landed keeps
    # stepping, up to this many inner steps, instead of waiting (issue 17: with a fixed H the
    # faster peers idled for the slowest one's phase). None, and absent from the manifest:
    # exactly inner_steps, and reruns are bit-identical; with it, how many steps a peer adds
    # depends on timing (members stay identical to each other: they commit one average).
    max_inner_steps: int | None = None
    # Overlapped runs: outer step t reduces only fragment t mod P of the parameters, and a
    # phase is inner_steps / P steps (p2ptrain.train.fragments; Streaming DiLoCo). None, and
    # absent from the manifest: every step reduces the whole vector.
    fragments: int | None = None

    def __post_init__(self) -> None:
        _int(self.inner_steps, "train.inner_steps", 1)
        _int(self.group_size, "train.group_size", 1)
        _num(self.outer_lr, "train.outer_lr")
        _need(isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1,
              f"train.outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        _need(self.allreduce in ALLREDUCE_MODES, f"unknown allreduce {self.allreduce!r} "
              f"(this version knows {', '.join(ALLREDUCE_MODES)})")
        _need(self.aggregation in AGGREGATIONS, f"unknown aggregation {self.aggregation!r} "
              f"(this version knows {', '.join(AGGREGATIONS)})")
        self._check_sparse()
        _need(self.overlap is None or self.overlap in OVERLAP_SCHEMES[1:],
              f"unknown overlap {self.overlap!r} (this version knows {', '.join(OVERLAP_SCHEMES[1:])}; "
              "leave it out for the sequential loop)")
        if self.max_inner_steps is not None:
            _int(self.max_inner_steps, "train.max_inner_steps", self.inner_steps)
            _need(self.overlap is not None, "train.max_inner_steps needs train.overlap (a phase extends only "
                  "while the previous round is still in flight)")
        if self.fragments is not None:
            _int(self.fragments, "train.fragments", 2)
            _need(self.overlap is not None, "train.fragments needs train.overlap (fragment rounds overlap the "
                  "phases; without overlap use a smaller inner_steps instead)")
            _need(self.inner_steps % self.fragments == 0,
                  f"train.inner_steps {self.inner_steps} must be a multiple of train.fragments {self.fragments}")
            _need(self.allreduce in ("int8", "fp32") and self.aggregation == "mean",
                  "train.fragments works with allreduce int8/fp32 and aggregation mean (sparse error feedback "
                  "and robust reputation are kept per whole vector)")
        inner = [self.seed, self.inner_lr, self.warmup, self.weight_decay, self.batch_size, self.seq_len,
                 self.schedule, self.planned_outer_steps]
        if all(v is None for v in inner):
            _need(self.overlap is None, "train.overlap needs the run's own inner loop (not a library run)")
            return
        _int(self.seed, "train.seed")
        _num(self.inner_lr, "train.inner_lr")
        _int(self.warmup, "train.warmup")
        _num(self.weight_decay, "train.weight_decay", strict=False)
        for name in ("batch_size", "seq_len", "planned_outer_steps"):
            _int(getattr(self, name), f"train.{name}", 1)
        _need(isinstance(self.schedule, str), "train.schedule must be a string")

    @property
    def n_fragments(self) -> int:
        """1 (whole-vector steps) or train.fragments."""
        return self.fragments or 1

    @property
    def overlap_scheme(self) -> str:
        """'none' (sequential), 'delayed' or 'eager'."""
        return self.overlap or "none"

    @property
    def has_inner(self) -> bool:
        return self.seed is not None

    def _check_sparse(self) -> None:
        fields_ = {"topk_fraction": self.topk_fraction, "bits": self.bits, "chunk": self.chunk,
                   "ef_decay": self.ef_decay}
        if self.allreduce != "sparse":
            _need(all(v is None for v in fields_.values()), "compressor fields belong to allreduce = 'sparse' runs")
            return
        _need(all(v is not None for v in fields_.values()), "a sparse run needs topk_fraction, bits, chunk, ef_decay")
        self.sparse_config()  # validates

    def sparse_config(self):
        """The run's compressor (imported here: only sparse runs load the sparse kernels)."""
        from p2ptrain.reduce.sparsecodec import SparseConfig

        try:
            return SparseConfig(float(self.topk_fraction), int(self.bits), int(self.chunk), float(self.ef_decay))
        except (TypeError, ValueError) as exc:
            raise SpecError(f"invalid sparse compressor settings: {exc}") from None


@dataclass(frozen=True)
class TimeoutsSpec(_Section):
    join_window: float = 30.0
    exchange: float = 5.0

    def __post_init__(self) -> None:
        _num(self.join_window, "timeouts.join_window")
        _num(self.exchange, "timeouts.exchange")

    @property
    def early_ttl(self) -> float:
        """How long a node keeps a peer's message (exchange, vote) for a round it has not
        started: twice the longest a member waits at an exchange (rounds elected ahead wait
        the join window). Older, its sender has given up on that exchange."""
        return 2.0 * max(self.exchange, self.join_window)

    @property
    def retry_wait(self) -> float:
        """How long a node that skipped a step waits for a newer state before it trains the
        step again: long enough for the other groups of the step to commit and publish (two
        join windows, at least 30 s). Every try has its own round ids (rule T7), so no
        message of an earlier try can be taken for one of the retry's; before, a retry reused
        them and had to outlast `early_ttl` (120 s with the defaults, 60 s now)."""
        return max(30.0, 2.0 * self.join_window)


@dataclass(frozen=True)
class GenesisSpec(_Section):
    sha256: str
    bytes: int

    def __post_init__(self) -> None:
        _need(isinstance(self.sha256, str) and len(self.sha256) in (0, 64), "genesis.sha256 must be a hex SHA-256")
        _int(self.bytes, "genesis.bytes")


@dataclass(frozen=True)
class RunSpec:
    name: str
    created: int
    model: ModelSpec
    data: DataSpec
    train: TrainSpec
    timeouts: TimeoutsSpec
    genesis: GenesisSpec
    version: int = 1

    def __post_init__(self) -> None:
        _need(self.version == 1, f"manifest version {self.version!r} is not one this version reads")
        _need(isinstance(self.name, str), "name must be a string")
        _int(self.created, "created")
        _need(self.model.is_user == (self.data.spec == USER) == (not self.train.has_inner),
              "a library run (model.source = 'user') has user data and no inner-loop fields; others have both")

    def to_dict(self) -> dict:
        return {"version": self.version, "name": self.name, "created": self.created,
                "model": self.model.to_dict(), "data": self.data.to_dict(), "train": self.train.to_dict(),
                "timeouts": self.timeouts.to_dict(), "genesis": self.genesis.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "RunSpec":
        """Raises SpecError naming the first missing, unknown or invalid field."""
        _need(isinstance(d, dict), "manifest is not a table")
        try:
            sections = {}
            for name, typ in (("model", None), ("data", DataSpec), ("train", TrainSpec),
                              ("timeouts", TimeoutsSpec), ("genesis", GenesisSpec)):
                sec = d.get(name)
                _need(isinstance(sec, dict), f"manifest has no [{name}] table")
                sections[name] = ModelSpec(dict(sec)) if typ is None else typ(**sec)
            return cls(d.get("name"), d.get("created"), version=d.get("version"), **sections)
        except TypeError as exc:  # a missing or unknown field of a section
            raise SpecError(f"manifest does not fit this version's schema: {exc}") from None

    def with_genesis(self, sha256: str, nbytes: int) -> "RunSpec":
        from dataclasses import replace

        return replace(self, genesis=GenesisSpec(sha256, nbytes))
