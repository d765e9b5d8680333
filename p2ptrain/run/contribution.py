"""Signed contribution headers and their verification (pure logic: no I/O).

Before a group reduces, each member signs a header describing its pseudo-gradient: run,
step, attempt, roster hash, its norm per ring chunk, the BLAKE3 of each sub-chunk payload
it will send first (its own chunk, quantized: the exact bytes its successor will receive),
inner steps and tokens. Members exchange headers and each one runs `influence.verify_headers` on the
same set, so they exclude the same peers. The data plane then holds every frame to these
claims (`FrameChecker`): the first hop must match the signed digests, and every partial sum
must be finite and no larger than the claimed norms allow. A peer caught either way is
excluded, the round is retried without it, and it is ignored for the rest of the run.

Known limit: a data-plane accusation names the accuser's ring predecessor and is trusted by
the others (frames are sealed pairwise, not signed, so a third party cannot check it). A
malicious member can therefore get one honest peer excluded per accusation; issue 7's
robust aggregation addresses Byzantine accusers.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np
from blake3 import blake3

from p2ptrain.identity import Identity, peer_id_from_str, public_from_peer_id_bytes, verify

MAX_HEADER_BYTES = 16 * 1024
_F32_MAX_SQ = float(np.finfo(np.float32).max) ** 2
_DOMAIN = b"p2ptrain-contribution-v4"
"""v2: ring frame digests are BLAKE3 (`frame_digest`), no longer SHA-256; a v1 header fails
its signature check here instead of having its frames blamed for the other hash. v3: headers
carry the signer's anchor (`trusts`, `ref`: issue 32), so every member judges every norm
from the same signed data. v4: `evidence`, the signer's whole contribution's BLAKE3, which
the loss gate's attribution fetches and scores alone (`run.lossgate`, rule L2)."""


class BadContribution(Exception):
    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"{peer}: {reason}")
        self.peer = peer
        self.reason = reason


@dataclass(frozen=True)
class Header:
    run: str
    step: int
    attempt: int
    roster: str
    peer: str
    chunk_norms: tuple[float, ...]
    own_digests: tuple[str, ...]
    norm: float
    inner_steps: int
    tokens: int
    trusts: tuple[int, ...] = ()
    """The roster positions of the members the signer has standing with (`run.standing`):
    it holds them to `norm_factor` x its anchor, everyone else to `probation_factor` x."""
    ref: float = 0.0
    """The signer's own reference norm: the median of the norms it signed in its last
    committed steps (0: none). Its anchor when it did not train this round (a joiner)."""
    evidence: str = ""
    """BLAKE3 (hex) of the signer's contribution as little-endian float32, which it serves for
    the step (`run.evidence`); "" when it serves none (rule L2, `run.lossgate`)."""

    def body(self) -> dict:
        return {"run": self.run, "step": self.step, "attempt": self.attempt, "roster": self.roster,
                "peer": self.peer, "chunk_norms": list(self.chunk_norms), "own_digests": list(self.own_digests),
                "norm": self.norm, "inner_steps": self.inner_steps, "tokens": self.tokens,
                "trusts": list(self.trusts), "ref": self.ref, "evidence": self.evidence}

    @property
    def anchor(self) -> float:
        """What the signer holds the others' norms to: its own norm when it trained (it
        knows that one is honest), else its signed reference (0: it bounds nobody)."""
        return self.norm if self.norm > 0 else self.ref


def _payload(body: dict) -> bytes:
    return _DOMAIN + msgpack.packb(body, use_bin_type=True)


def sign_header(h: Header, identity: Identity) -> bytes:
    body = h.body()
    return msgpack.packb({"h": body, "sig": identity.sign(_payload(body))}, use_bin_type=True)


def _strict(x, kind: type):
    """`x` if of `kind` (a float may be an int; a number is never a bool); else TypeError."""
    if isinstance(x, bool) and kind is not bool or not isinstance(x, (int, float) if kind is float else kind):
        raise TypeError(f"{type(x).__name__} where {kind.__name__} belongs")
    return x


def decode_header(data: bytes) -> Header:
    """Parse and check the signature; raises BadContribution(peer='?' when unknown)."""
    if len(data) > MAX_HEADER_BYTES:
        raise BadContribution("?", "oversize header")
    try:
        obj = msgpack.unpackb(data, raw=False, max_array_len=4096, max_map_len=32, max_bin_len=128,
                              max_str_len=1024)
        body, sig = obj["h"], obj["sig"]
        # Each field of its own type: int("7"), float(True), str([..]) took what a signer never meant.
        h = Header(_strict(body["run"], str), _strict(body["step"], int), _strict(body["attempt"], int),
                   _strict(body["roster"], str), _strict(body["peer"], str),
                   tuple(float(_strict(x, float)) for x in _strict(body["chunk_norms"], list)),
                   tuple(_strict(x, str) for x in _strict(body["own_digests"], list)),
                   float(_strict(body["norm"], float)), _strict(body["inner_steps"], int),
                   _strict(body["tokens"], int), _ints(_strict(body["trusts"], list)),
                   float(_strict(body["ref"], float)), _evidence(body["evidence"]))
    except Exception:
        raise BadContribution("?", "malformed header") from None
    try:
        public = public_from_peer_id_bytes(peer_id_from_str(h.peer))
    except ValueError:
        raise BadContribution(h.peer, "malformed peer id") from None
    if not isinstance(sig, bytes) or not verify(public, sig, _payload(body)):
        raise BadContribution(h.peer, "bad-signature")
    return h


def _evidence(x) -> str:
    if not isinstance(x, str) or x and (len(x) != 64 or x.strip("0123456789abcdef")):
        raise ValueError("evidence is not a BLAKE3 hex digest")
    return x


def _ints(xs) -> tuple[int, ...]:
    if not isinstance(xs, list) or not all(type(x) is int for x in xs):
        raise ValueError("not a list of ints")
    return tuple(xs)


def consistent(h: Header, rel: float = 1e-3) -> bool:
    """The chunk norms bound every frame, the total norm is what the norm filter sees: they
    must describe the same vector, sqrt(sum chunk_norms^2) == norm (float64, relative
    tolerance for the sender's float32 sums)."""
    total = math.sqrt(math.fsum(x * x for x in h.chunk_norms))
    return abs(total - h.norm) <= rel * max(total, h.norm) + 1e-6


def trained_scale(norms: Iterable[float], world: int) -> float:
    """The factor that turns a committed mean over a round's `world` members into the mean
    over those that trained. A newcomer joins a round with zeros under a signed norm of 0
    (the data plane holds its frames to that norm), and DiLoCo's outer gradient is the
    average of the workers' progress: before, each joiner shrank the step by its share (3
    trainers and a joiner applied 3/4 of their mean). Every member computes it from the same
    verified headers' norms, so all of them scale by the same float32 factor: params stay
    identical."""
    trained = sum(1 for x in norms if x > 0)
    return world / trained if 0 < trained < world else 1.0


def sumsq64(x: np.ndarray) -> float:
    """Sum of squares accumulated in float64 (float32 sums lose the bound on long chunks);
    non-finite iff some value is. Not a float64 copy and np.dot: BLAS's dot runs on
    OpenBLAS's thread pool, whose threads spin-wait for work; next to the ring's own threads
    on 2 shared cores that cost ~0.5 CPU s per member per 64 MiB round and stretched a
    1 Gbit/s round 5x (BENCHMARKS.md, "Emulated internet"). The kernel (`kernels.sumsq`, one
    pass, this thread, one explicit vector register) takes ~4 ms per 16M values here, ~3x
    faster than einsum, which other dtypes/layouts still take."""
    if x.dtype == np.float32 and x.ndim == 1 and x.flags.c_contiguous:
        from p2ptrain import kernels as K

        return K.sumsq(x)
    return float(np.einsum("i,i->", x.ravel(), x.ravel(), dtype=np.float64))


class FrameChecker:
    """Holds each frame of a ring round to the members' signed headers.

    Called with the float64 sum of squares of the values a frame decodes to (the ring's
    `check` protocol), in the compute thread."""

    def __init__(self, members: list[str], headers: dict[str, Header], rank: int,
                 sub_counts: list[int], slack: float = 1.05) -> None:
        self.members = members
        self.headers = headers
        self.rank = rank
        self.world = len(members)
        self.sub_counts = sub_counts
        self.slack = slack
        self._partial: dict[tuple[int, int], float] = {}

    def _bound(self, chunk: int, contributors: list[int]) -> float:
        return sum(self.headers[self.members[i]].chunk_norms[chunk] for i in contributors)

    def check(self, step: int, chunk: int, sub: int, payload: bytes, sq: float) -> None:
        prev = self.members[(self.rank - 1) % self.world]
        # Non-finite iff a value is; beyond fp32's range squared, some value decodes to inf
        # in fp32 (an int8 frame's sum is taken in float64 from its payload: sumsq_q8).
        if not sq <= _F32_MAX_SQ:
            raise BadContribution(prev, "non-finite values")
        w = self.world
        if step == 0:  # the predecessor's own data, exactly as it signed it
            digest = frame_digest(payload)
            own = self.headers[prev].own_digests
            if sub >= len(own) or own[sub] != digest:
                raise BadContribution(prev, "payload does not match its signed digest")
        if step < w - 1:  # a partial sum of members chunk, chunk+1, ..., rank-1
            contributors = [(chunk + i) % w for i in range(step + 1)]
            bound = self._bound(chunk, contributors)
        else:  # all-gather: the owner's mean
            bound = self._bound(chunk, list(range(w))) / w
        key = (step, chunk)
        self._partial[key] = self._partial.get(key, 0.0) + sq
        if math.sqrt(self._partial[key]) > self.slack * bound + 1e-6:
            raise BadContribution(prev, f"chunk {chunk} norm exceeds the signed bound at step {step}")


class HeldChecker:
    """Lets a ring round's data plane start before the headers are in (issue 17: signing and
    the header exchange held back the first byte by 0.07-0.45 s per round) while no frame is
    mixed in unchecked: each check waits, in the compute thread, until `settle` hands over
    the `FrameChecker` built from the verified headers. Settled with None (a header was
    rejected or missing), every check fails without blaming the sender: the round aborts
    and the caller rejects the members whose headers were bad, as before any data moved."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._event = threading.Event()
        self._checker: FrameChecker | None = None
        self._why = ""

    def settle(self, checker: FrameChecker | None, why: str = "") -> None:
        if not self._event.is_set():
            self._checker, self._why = checker, why
            self._event.set()

    def settle_verified(self, ok: dict[str, Header] | None, bad: dict[str, str] | None, members: list[str],
                        rank: int, sub_counts: list[int]) -> None:
        """`settle` with `influence.verify_headers`' result (None, None: the exchange never finished)."""
        bad = {"?": "no headers"} if ok is None and not bad else bad or {}
        self.settle(None if bad else FrameChecker(members, ok, rank, sub_counts),
                    ", ".join(f"{p}: {r}" for p, r in sorted(bad.items())))

    def pending(self) -> bool:
        """Not settled yet: the ring reads frames ahead meanwhile (`ring._RingRound.read_ahead`)."""
        return not self._event.is_set()

    def passed(self) -> bool:
        """Settled with verified headers (every frame will be checked against them)."""
        return self._event.is_set() and self._checker is not None

    def wait(self, timeout: float) -> bool:
        """Until settled or `timeout` seconds (the ring's read-ahead waits here for a frame)."""
        return self._event.wait(timeout)

    def check(self, step: int, chunk: int, sub: int, payload: bytes, sq: float) -> None:
        if not self._event.wait(self.timeout):
            raise TimeoutError("contribution headers did not arrive in time")
        if self._checker is None:
            raise ValueError(f"contribution headers rejected: {self._why}")
        self._checker.check(step, chunk, sub, payload, sq)

    __call__ = check  # the ring calls the checker itself, and asks it `pending()`


def frame_digest(payload) -> str:
    """What a header signs of a ring frame: its BLAKE3, hex. BLAKE3 rather than SHA-256 for
    the ring's result digest's reason (`ring.allreduce`): ~4x the speed on one core here
    (4.3 MiB: 0.6 ms against 2.4 ms), and every member hashes its own chunk and its
    predecessor's, ~2/W of the payload, each round."""
    return blake3(payload).hexdigest()


def _chunk_spans(lay: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    return [(subs[0][0], subs[-1][1]) for subs in lay]


def chunk_norms(delta: np.ndarray, lay: list[list[tuple[int, int]]]) -> tuple[float, ...]:
    """The norm of `delta` over each ring chunk of `lay` (what a header signs)."""
    return tuple(math.sqrt(sumsq64(delta[lo:hi])) for lo, hi in _chunk_spans(lay))


def norm_threads() -> int:
    """Half the cores this process may run on, at most 8: the ring's own threads need the
    rest (on 2 cores: one thread). The affinity mask, not os.cpu_count(): a peer confined to
    some cores (a container's cpuset, taskset) must not start more threads than it has
    cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


def start_chunk_norms(delta: np.ndarray, lay: list[list[tuple[int, int]]],
                      threads: int | None = None) -> Callable[[], tuple[float, ...]]:
    """`chunk_norms` on helper threads, a chunk per task (the kernel is nogil); call the
    result to wait for them. The same numbers as `chunk_norms`, bit for bit (issue 17: on
    one thread they were ~12 ms before the header could leave in a 1 Gbit/s round)."""
    spans = _chunk_spans(lay)
    pool = ThreadPoolExecutor(max(1, min(threads or norm_threads(), len(spans))), thread_name_prefix="norms")
    futures = [pool.submit(sumsq64, delta[lo:hi]) for lo, hi in spans]
    pool.shutdown(wait=False)  # the threads end with their tasks
    return lambda: tuple(math.sqrt(f.result()) for f in futures)


def streamed_material(delta: np.ndarray, lay: list[list[tuple[int, int]]],
                      own: "OwnDigests") -> tuple[tuple[float, ...], tuple[str, ...]]:
    """(chunk norms, our frames' digests) for a header signed beside the data plane: this
    thread hashes each frame as the ring encodes it, then the norms run on helper threads
    (blocking; NotEncoded as `OwnDigests.wait`). Digests first: the norms read the whole
    tensor on several threads, and started with the round they competed with the ring's
    first frames: on the verified path a member's first frame left ~4 ms later than on the
    unverified one (3 peers, 16 MiB, 500 Mbit/s lab, `bench allreduce --trace`; with digests
    first the two start alike). The header waits the norms' ~2 ms longer, well inside the
    time our predecessor's own chunk takes on the wire, which its checks wait for anyway."""
    digests = own.wait()
    norms = start_chunk_norms(delta, lay)
    return norms(), digests


class NotEncoded(Exception):
    """Our own frames were never (all) encoded: the round ended or stalled first."""


class OwnDigests:
    """The digests of our ring step-0 frames (our own chunk, encoded), taken while the data
    plane already sends them: the ring encodes each frame into its wire buffer as usual and
    hands it over (`ring.allreduce(on_own=...)`), and the header's digests, norms and
    signature follow beside the data (issue 17: signing everything before the first byte
    held back a 1 Gbit/s round by 0.02-0.05 s). Nothing unsigned is mixed in anywhere:
    every receiver's check waits for our verified header (`HeldChecker`)."""

    def __init__(self, count: int, timeout: float) -> None:
        self.timeout = timeout
        self._views: list[memoryview | None] = [None] * count
        self._over = False
        self._cond = threading.Condition()

    def __call__(self, j: int, payload: memoryview | None) -> None:
        """The ring's `on_own`: frame j is encoded (j = -1: the round is over)."""
        with self._cond:
            if j < 0:
                self._over = True
            else:
                self._views[j] = payload
            self._cond.notify_all()

    def wait(self) -> tuple[str, ...]:
        """Every frame's digest, each hashed as soon as the ring has encoded it (blocking,
        bounded by `timeout` in all); NotEncoded when the round ended or stalled first."""
        deadline = time.monotonic() + self.timeout
        out = []
        for j in range(len(self._views)):
            with self._cond:
                if not self._cond.wait_for(lambda: self._over or self._views[j] is not None,
                                           max(0.0, deadline - time.monotonic())):
                    raise NotEncoded("our own frames were not encoded in time")
                view = self._views[j]
            if view is None:
                raise NotEncoded("the round ended before our own frames were encoded")
            out.append(frame_digest(view))
        return tuple(out)
