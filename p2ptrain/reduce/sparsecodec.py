"""Signed sparse contributions and their deterministic aggregation (pure logic: no I/O).

A member's contribution is its compressed pseudo-gradient (`p2ptrain.kernels.sparse`: top-k
per chunk, 2-bit values, error feedback kept locally) and a signed header binding run, step,
attempt, roster hash, sender, vector shape and the payload's SHA-256. The collective
(`p2ptrain.reduce.sparse`) moves them as exchange messages: the header, then the payload in
fragments of FRAGMENT bytes (the service's control messages are capped at 4 KiB).

Every member verifies every contribution the same way (`verify`), then `aggregate` sums the
decoded contributions in roster order in float64 and divides by their count: the result is
bit-identical on every member that accepted the same senders, whichever kernel backend it runs.

Robustness for sparse updates: a per-coordinate trimmed mean or median degenerates here (at
1-3 % density most coordinates carry one sender's value, so there is nothing to trim), so
each sender's influence is bounded by its decoded L2 norm instead. Mean runs exclude a sender
whose norm exceeds `norm_factor` x the median norm (as the dense headers do); robust runs clip
every sender's decoded update to the median norm (CenteredClip's bound with the centre at 0).
The norms come from the decoded levels and counts with math.fsum, so they are exact and the
same everywhere.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import msgpack
import numpy as np

from p2ptrain.identity import Identity, peer_id_from_str, public_from_peer_id_bytes
from p2ptrain.identity import verify as verify_signature
from p2ptrain.kernels import sparse as SK

FRAGMENT = 3968
"""Payload bytes per exchange message: with its tag and msgpack envelope (< 64 bytes) it stays
under the control-message limit (p2ptrain.reduce.control.MAX_CONTROL_MSG, 4096)."""
MAX_HEADER = 1024
_DOMAIN = b"p2ptrain-sparse-contribution-v1"


@dataclass
class SparseConfig:
    """The compressor of a run with train.allreduce = 'sparse' (manifest fields in brackets)."""

    topk_fraction: float = 0.015
    """[topk_fraction] entries kept per chunk (SparseLoCo: 1-3 %)."""
    bits: int = 2
    """[bits] bits per kept value; 2 (sign + one magnitude bit) is the only scheme."""
    chunk: int = 4096
    """[chunk] values per top-k chunk, <= 4096 (12-bit offsets)."""
    ef_decay: float = 0.95
    """[ef_decay] error-feedback decay beta."""
    norm_factor: float = 10.0
    """Mean runs: a sender whose decoded norm exceeds this x the median is excluded."""

    def __post_init__(self) -> None:
        if self.bits != 2:
            raise ValueError(f"sparse bits must be 2 (sign + magnitude bit), got {self.bits}")
        if not 1 <= self.chunk <= SK.MAX_CHUNK:
            raise ValueError(f"sparse chunk must be in [1, {SK.MAX_CHUNK}], got {self.chunk}")
        if not 0 < self.topk_fraction <= 1 or not 0 <= self.ef_decay <= 1 or self.norm_factor <= 1:
            raise ValueError("need 0 < topk_fraction <= 1, 0 <= ef_decay <= 1, norm_factor > 1")

    @property
    def k(self) -> int:
        return SK.k_for(self.chunk, self.topk_fraction)

    @classmethod
    def from_train(cls, train: dict) -> "SparseConfig":
        d = cls()
        return cls(float(train.get("topk_fraction", d.topk_fraction)), int(train.get("bits", d.bits)),
                   int(train.get("chunk", d.chunk)), float(train.get("ef_decay", d.ef_decay)))

    def manifest_fields(self) -> dict:
        return {"topk_fraction": self.topk_fraction, "bits": self.bits, "chunk": self.chunk,
                "ef_decay": self.ef_decay}


class BadSparse(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def fragments(payload: bytes) -> list[bytes]:
    return [payload[i:i + FRAGMENT] for i in range(0, len(payload), FRAGMENT)] or [b""]


def fragment_count(n: int, cfg: SparseConfig) -> int:
    return max(1, -(-SK.payload_nbytes(n, cfg.chunk, cfg.k) // FRAGMENT))


def _body(run: str, step: int, attempt: int, roster: str, peer: str, n: int, cfg: SparseConfig,
          payload: bytes) -> dict:
    return {"run": run, "step": step, "attempt": attempt, "roster": roster, "peer": peer, "n": n,
            "chunk": cfg.chunk, "k": cfg.k, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}


def sign_contribution(identity: Identity, run: str, step: int, attempt: int, roster: str, n: int,
                      cfg: SparseConfig, payload: bytes) -> bytes:
    body = _body(run, step, attempt, roster, identity.peer_id_str, n, cfg, payload)
    return msgpack.packb({"h": body, "sig": identity.sign(_DOMAIN + msgpack.packb(body))}, use_bin_type=True)


def verify(peer: str, header: bytes | None, frags: list, run: str, step: int, attempt: int, roster: str,
           n: int, cfg: SparseConfig):
    """(idx, codes, levels) of `peer`'s contribution; raises BadSparse with the reason.
    Sizes are checked before anything is decoded or hashed."""
    if header is None or any(f is None for f in frags):
        raise BadSparse("missing")
    if len(header) > MAX_HEADER:
        raise BadSparse("oversize header")
    try:
        obj = msgpack.unpackb(header, raw=False, max_bin_len=128, max_str_len=256, max_map_len=16,
                              max_array_len=0)
        body, sig = obj["h"], obj["sig"]
        public = public_from_peer_id_bytes(peer_id_from_str(peer))
        ok = (isinstance(body, dict) and isinstance(sig, bytes)
              and verify_signature(public, sig, _DOMAIN + msgpack.packb(body)))
    except Exception:
        raise BadSparse("malformed header") from None
    if not ok:
        raise BadSparse("bad-signature")
    nbytes = SK.payload_nbytes(n, cfg.chunk, cfg.k)
    want = {"run": run, "step": step, "attempt": attempt, "roster": roster, "peer": peer, "n": n,
            "chunk": cfg.chunk, "k": cfg.k, "bytes": nbytes}
    # Same type too: msgpack's True equals 1 (a step=True header matched step 1).
    wrong = [key for key, v in want.items() if isinstance(body.get(key), bool) or body.get(key) != v]
    if wrong:
        raise BadSparse("wrong-step" if "step" in wrong else f"header mismatch: {','.join(sorted(wrong))}")
    sizes = [len(f) for f in frags]
    if sizes != [len(f) for f in fragments(b"\0" * nbytes)]:
        raise BadSparse("fragment sizes")
    payload = b"".join(frags)
    if hashlib.sha256(payload).hexdigest() != body.get("sha256"):
        raise BadSparse("payload digest")
    try:
        return SK.unpack(payload, n, cfg.chunk, cfg.k)
    except SK.SparseFormatError as exc:
        raise BadSparse(f"malformed payload: {exc}") from None


def norm(decoded, n: int, cfg: SparseConfig) -> float:
    """Exact L2 norm of a decoded contribution (same bits on every machine: math.fsum)."""
    idx, codes, levels = decoded
    chunk_of = np.arange(idx.size) // cfg.k
    cnt = np.bincount(2 * chunk_of + (codes & 1), minlength=levels.size).astype(np.float64)
    return math.sqrt(math.fsum((cnt * levels.astype(np.float64) ** 2).tolist()))


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def aggregate(decoded: dict, order: list[str], n: int, cfg: SparseConfig, robust: bool = False):
    """(mean float32[n], senders used in roster order, excluded sender -> reason, digest).
    The mean is over the senders that trained: a newcomer's zeros (norm 0, exact from the
    decoded payload) neither shrink it nor pull the median down (`contribution.trained_scale`
    for the dense ring)."""
    senders = [p for p in order if p in decoded]
    norms = {p: norm(decoded[p], n, cfg) for p in senders}
    trained = [x for x in norms.values() if x > 0]
    med = _median(trained) if trained else 0.0
    excluded = {}
    if not robust and len(trained) >= 3:
        excluded = {p: "norm-outlier" for p in senders if norms[p] > cfg.norm_factor * med}
    used = [p for p in senders if p not in excluded]
    acc = np.zeros(n, np.float64)
    for p in used:
        mul = min(1.0, med / norms[p]) if robust and norms[p] > 0 else 1.0
        SK.decode_add(*decoded[p], acc, cfg.chunk, cfg.k, mul)
    mean = (acc / max(1, sum(1 for p in used if norms[p] > 0))).astype(np.float32)
    h = hashlib.sha256(mean.tobytes())
    h.update("\0".join(used).encode())
    return mean, used, excluded, h.hexdigest()
