"""The butterfly data plane of `aggregation = "robust"` runs, and its owner step.

Why not the ring: a ring hop only ever sees a running sum, so nobody can tell one member's
contribution from another's and a robust rule has nothing to work on. Here every member sends
chunk c of its pseudo-gradient (int8, the exact bytes whose SHA-256 it signed in its
contribution header) straight to chunk c's owner, member c. The owner checks each copy against
its sender's header, combines all W copies with the robust rule (`p2ptrain.reduce.robust`),
quantizes the result ONCE and sends those bytes, unchanged, to every member, followed by a
small frame with its per-member scores. Every member decodes the same bytes for every chunk,
so results and scores are bit-identical and the digest vote of `p2ptrain.reduce.service` commits
or aborts the round exactly as for the ring.

Frames on the pairwise channel member -> member (FrameId(step, chunk * 1000 + sub)):
  step 0  sender's copy of the receiver's chunk, sub-chunk by sub-chunk
  step 1  the sender's (owner's) combined chunk, sub-chunk by sub-chunk
  step 2  the sender's scores: float32[W] (chunk index * 1000)
Cost per member: (W-1)/W of the tensor out and the same back, as the ring, but over W-1
connections; the owner holds W copies of its chunk (4 n bytes in all) while combining.

Synchronous on purpose, like `p2ptrain.reduce.ring`: one compute thread (the caller's worker thread)
and one pump thread per channel, so no member ever blocks on a send nobody reads.
"""

from __future__ import annotations

import hashlib
import math
import queue
import threading
from dataclasses import dataclass, field

import numpy as np

from p2ptrain import kernels as K
from p2ptrain.reduce import robust
from p2ptrain.reduce.ring import (
    Channel,
    FrameId,
    RingConfig,
    RingError,
    _Pump,
    _set_kernel_threads,
    encode_payload,
    layout,
    wire_bytes,
)

SCORES = 2


# ----------------------------------------------------------------------------- pure part
def own_payloads(vec: np.ndarray, world: int, cfg: RingConfig) -> list[list[bytearray]]:
    """[chunk][sub] payloads of this member's copy of every chunk (what it signs and sends)."""
    vec = np.ascontiguousarray(vec, dtype=np.float32).ravel()
    return [[encode_payload(vec[lo:hi], cfg) for lo, hi in subs] for subs in layout(vec.size, world, cfg)]


def chunk_digest(sub_digests) -> str:
    """One chunk's digest: SHA-256 over the SHA-256 of each of its sub-chunk payloads."""
    return hashlib.sha256(b"".join(sub_digests)).hexdigest()


def chunk_digests(payloads: list[list[bytearray]]) -> tuple[str, ...]:
    """The header's `own_digests` in robust mode: one per chunk, so a header stays W digests
    long whatever the model size (per sub-chunk, 16 KiB headers would cap models at ~60M
    parameters)."""
    return tuple(chunk_digest(hashlib.sha256(p).digest() for p in subs) for subs in payloads)


def decode(payload, m: int, cfg: RingConfig) -> np.ndarray:
    if cfg.mode == "fp32":
        return np.frombuffer(payload, np.float32, count=m).copy()
    return K.dequantize(np.frombuffer(payload, np.int8, count=m), np.frombuffer(payload, np.uint8, offset=m),
                        cfg.block)


def _active(world: int, idle: frozenset[int], rcfg: robust.RobustConfig) -> list[int]:
    """The members a chunk's robust rule combines: all but those that did not train (a
    signed norm of 0: newcomers' zeros are no point to centre on, and counted they shrank the
    step like a free-rider's), unless that leaves none, or too few for an explicit trim."""
    act = [i for i in range(world) if i not in idle]
    if not act or (rcfg.rule == "trimmed_mean" and rcfg.trim >= 0 and 2 * rcfg.trim >= len(act)):
        return list(range(world))
    return act


def owner_reduce(copies: list[np.ndarray], subs: list[tuple[int, int]], cfg: RingConfig,
                 rcfg: robust.RobustConfig, idle: frozenset[int] = frozenset(),
                 ) -> tuple[list[bytearray], np.ndarray, np.ndarray]:
    """The owner's step for one chunk: combine the decoded copies (index = rank) of the
    members that trained (`_active`), quantize the result once per sub-chunk. Returns
    (payloads, decoded result, scores). A member left out scores the others' median: never a
    suspect, and the median `robust.suspects` judges the others by does not move."""
    act = _active(len(copies), idle, rcfg)
    combined, part = robust.combine([copies[i] for i in act], rcfg)
    scores = np.full(len(copies), float(np.median(part)), np.float64)
    scores[act] = part
    base = subs[0][0]
    payloads = [encode_payload(combined[lo - base:hi - base], cfg) for lo, hi in subs]
    result = np.concatenate([decode(p, hi - lo, cfg) for p, (lo, hi) in zip(payloads, subs)])
    return payloads, result, scores.astype(np.float32)


def simulate(tensors, cfg: RingConfig | None = None, rcfg: robust.RobustConfig | None = None
             ) -> tuple[np.ndarray, list[np.ndarray]]:
    """The network's robust all-reduce in one process: (the result every member decodes,
    each owner's scores). Same functions, same bytes as `allreduce` below."""
    cfg, rcfg = cfg or RingConfig(), rcfg or robust.RobustConfig()
    xs = [np.ascontiguousarray(t, dtype=np.float32).ravel() for t in tensors]
    world, n = len(xs), xs[0].size
    idle = frozenset(i for i, x in enumerate(xs) if not x.any())  # as their signed norm of 0 says
    lay = layout(n, world, cfg)
    result = np.empty(n, np.float32)
    rows = []
    for c, subs in enumerate(lay):
        lo, hi = subs[0][0], subs[-1][1]
        copies = [np.concatenate([decode(encode_payload(x[a:b], cfg), b - a, cfg) for a, b in subs]) for x in xs]
        _, result[lo:hi], scores = owner_reduce(copies, subs, cfg, rcfg, idle)
        rows.append(scores)
    return result, rows


@dataclass
class Checker:
    """Holds each step-0 frame to its sender's signed header: finite values, and once a
    sender's copy of the chunk is complete, its `chunk_digest` equal to the signed one
    (`headers[peer].own_digests` = `chunk_digests` of its payloads). The owner combines only
    after every copy is complete, so nothing unverified is ever used."""

    members: list[str]
    headers: dict
    sub_counts: list[int]
    slack: float = 1.05
    _seen: dict = field(default_factory=dict)
    _result_sq: dict = field(default_factory=dict)

    def check_result(self, owner: int, chunk: int, values: np.ndarray) -> None:
        """An owner's published chunk, sub-chunk by sub-chunk: every robust rule here puts
        each coordinate of its output between the members' values for it (CenteredClip: a
        convex combination), so its norm is at most sqrt(sum of the members' signed chunk
        norms squared). An owner that publishes anything larger (scaling its 1/W of the
        model, or its own values in place of the aggregate) is caught by every member alike."""
        from p2ptrain.run.contribution import BadContribution

        peer = self.members[owner]
        if owner != chunk:
            raise BadContribution(peer, f"sent chunk {chunk}, which it does not own")
        v = values.astype(np.float64)
        self._result_sq[chunk] = self._result_sq.get(chunk, 0.0) + float(np.dot(v, v))
        bound = math.sqrt(math.fsum(self.headers[m].chunk_norms[chunk] ** 2 for m in self.members))
        if math.sqrt(self._result_sq[chunk]) > self.slack * bound + 1e-6:
            raise BadContribution(peer, f"published chunk {chunk} exceeds the members' signed norms")

    @property
    def idle(self) -> frozenset[int]:
        """Members whose signed norm is 0 (joiners): no owner combines their copies."""
        return frozenset(i for i, m in enumerate(self.members) if self.headers[m].norm == 0)

    def check(self, sender: int, chunk: int, sub: int, payload, values: np.ndarray) -> None:
        from p2ptrain.run.contribution import BadContribution

        peer = self.members[sender]
        if not np.isfinite(values).all():
            raise BadContribution(peer, "non-finite values")
        subs = self._seen.setdefault((sender, chunk), {})
        subs[sub] = hashlib.sha256(payload).digest()
        if len(subs) < self.sub_counts[chunk]:
            return
        own = self.headers[peer].own_digests
        got = chunk_digest(subs[j] for j in range(self.sub_counts[chunk]))
        if chunk >= len(own) or own[chunk] != got:
            raise BadContribution(peer, "payload does not match its signed digest")


# ----------------------------------------------------------------------------- data plane
def allreduce(vec: np.ndarray, rank: int, world: int, sends: dict[int, Channel], recvs: dict[int, Channel],
              cfg: RingConfig, rcfg: robust.RobustConfig, timeout: float = 30.0,
              own: list[list[bytearray]] | None = None, check=None
              ) -> tuple[np.ndarray, int, str, list[np.ndarray]]:
    """Robust aggregate of every member's `vec`: (new array, payload bytes sent, digest,
    score rows: owner -> float32[W]). `sends[p]` / `recvs[p]`: channels to / from member p.

    `check(sender, chunk, sub, payload, values)` sees every step-0 frame before it is used;
    an exception with a `peer` attribute aborts the round blaming that peer. The digest is
    SHA-256 over the SHA-256 of every final payload and score frame. Raises RingError."""
    vec = np.ascontiguousarray(vec, dtype=np.float32).ravel()
    if world == 1:
        return vec.copy(), 0, hashlib.sha256(vec.data).hexdigest(), [np.zeros(1, np.float32)]
    _set_kernel_threads(cfg.kernel_threads)
    own = own if own is not None else own_payloads(vec, world, cfg)
    return _Butterfly(vec, rank, world, sends, recvs, cfg, rcfg, own, check).run(timeout)


class _Butterfly:
    """One member's butterfly round: a compute loop (the caller's thread) fed by pumps."""

    def __init__(self, vec, rank, world, sends, recvs, cfg: RingConfig, rcfg, own, check) -> None:
        self.rank, self.world, self.sends, self.recvs = rank, world, sends, recvs
        # `check`: a callable for the members' copies, or a `Checker` (copies and owners' results)
        self.cfg, self.rcfg, self.own, self.check = cfg, rcfg, own, getattr(check, "check", check)
        self.check_result = getattr(check, "check_result", None)
        self.idle = getattr(check, "idle", frozenset())
        self.lay = lay = layout(vec.size, world, cfg)
        self.others = [p for p in range(world) if p != rank]
        self.inq: queue.Queue = queue.Queue()
        self.outqs = {p: queue.Queue() for p in self.others}
        self.stop = threading.Event()
        self.sent = 0
        self.pumps = [_Pump(f"bfly-send-{p}", self._send_loop(p)) for p in self.others]
        self.pumps += [_Pump(f"bfly-recv-{p}", self._recv_loop(p)) for p in self.others]
        self.result = np.empty_like(vec)
        self.final: dict[tuple[int, int], bytes] = {}
        self.rows: dict[int, np.ndarray] = {}
        self.mine = mine = lay[rank]
        self.copies: dict[int, list] = {rank: [decode(b, hi - lo, cfg) for b, (lo, hi) in zip(own[rank], mine)]}
        for p in self.others:
            self.copies[p] = [None] * len(mine)
        self.waiting = (world - 1) * len(mine)
        self.expected = self.waiting + sum(len(lay[p]) + 1 for p in self.others)

    def _send_loop(self, p: int):
        def loop() -> None:
            while not self.stop.is_set():
                item = self.outqs[p].get()
                if item is None:
                    return
                self.sends[p].send(*item)
        return loop

    def _recv_loop(self, p: int):
        lay, cfg, rank = self.lay, self.cfg, self.rank

        def loop() -> None:
            plan = [(FrameId(0, rank * 1000 + j), wire_bytes(hi - lo, cfg)) for j, (lo, hi) in enumerate(lay[rank])]
            plan += [(FrameId(1, p * 1000 + j), wire_bytes(hi - lo, cfg)) for j, (lo, hi) in enumerate(lay[p])]
            plan.append((FrameId(SCORES, p * 1000), 4 * self.world))
            for fid, size in plan:
                buf = bytearray(size)
                got = self.recvs[p].recv(fid, memoryview(buf))
                if got != size:
                    raise RingError(f"frame {fid} from member {p} has {got} bytes, expected {size}")
                self.inq.put((p, fid, buf))
                if self.stop.is_set():
                    return
        return loop

    def put(self, p: int, fid: FrameId, payload) -> None:
        self.outqs[p].put((fid, memoryview(payload)))
        self.sent += len(payload)

    def run(self, timeout: float) -> tuple[np.ndarray, int, str, list[np.ndarray]]:
        others = self.others
        try:
            for pump in self.pumps:
                pump.start()
            for p in others:
                for j, payload in enumerate(self.own[p]):
                    self.put(p, FrameId(0, p * 1000 + j), payload)
            for _ in range(self.expected):
                p, fid, buf = _get(self.inq, timeout, self.pumps)
                c, j = divmod(fid.chunk, 1000)
                if fid.step == 0:
                    self.on_copy(p, j, buf)
                elif fid.step == 1:
                    self.on_result(p, c, j, buf)
                else:
                    self.on_scores(p, c, buf)
            for q in others:
                self.outqs[q].put(None)
            for pump in self.pumps[: len(others)]:
                pump.join(timeout)
                if pump.is_alive() or pump.error is not None:
                    raise RingError(f"send failed: {pump.error or 'timeout'}")
        except RingError:
            raise
        except Exception as exc:
            raise RingError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self.stop.set()
            for q in others:
                self.outqs[q].put(None)
        final = self.final
        if len(final) != sum(len(s) + 1 for s in self.lay):
            raise RingError("result incomplete")
        digest = hashlib.sha256(b"".join(final[k] for k in sorted(final))).hexdigest()
        return self.result, self.sent, digest, [self.rows[c] for c in range(self.world)]

    def on_copy(self, p: int, j: int, buf: bytearray) -> None:
        """Member p's copy of sub-chunk j of our chunk: checked, kept; the last one publishes."""
        lo, hi = self.mine[j]
        values = decode(buf, hi - lo, self.cfg)
        if self.check is not None:
            try:
                self.check(p, self.rank, j, buf, values)
            except Exception as exc:
                if getattr(exc, "peer", None):
                    raise RingError(f"bad frame: {exc}", blame=exc.peer, reason=getattr(exc, "reason", "")) from exc
                raise
        self.copies[p][j] = values
        self.waiting -= 1
        if self.waiting == 0:  # every copy of our chunk is in: combine, publish
            self.publish()

    def publish(self) -> None:
        rank, mine = self.rank, self.mine
        chunk = [np.concatenate(self.copies[q]) for q in range(self.world)]
        payloads, res, scores = owner_reduce(chunk, mine, self.cfg, self.rcfg, self.idle)
        self.result[mine[0][0]:mine[-1][1]] = res
        self.rows[rank] = scores
        self.final[(rank, -1)] = hashlib.sha256(scores.tobytes()).digest()
        for sj, pl in enumerate(payloads):
            self.final[(rank, sj)] = hashlib.sha256(pl).digest()
        for q in self.others:
            for sj, pl in enumerate(payloads):
                self.put(q, FrameId(1, rank * 1000 + sj), pl)
            self.put(q, FrameId(SCORES, rank * 1000), scores.tobytes())
        self.copies.clear()

    def on_result(self, p: int, c: int, j: int, buf: bytearray) -> None:
        lo, hi = self.lay[c][j]
        values = decode(buf, hi - lo, self.cfg)
        if not np.isfinite(values).all():
            raise RingError(f"member {p} sent a non-finite result", reason="non-finite result")
        if self.check_result is not None:
            try:
                self.check_result(p, c, values)
            except Exception as exc:
                if getattr(exc, "peer", None):
                    raise RingError(f"bad result: {exc}", blame=exc.peer, reason=getattr(exc, "reason", "")) from exc
                raise
        self.result[lo:hi] = values
        self.final[(c, j)] = hashlib.sha256(buf).digest()

    def on_scores(self, p: int, c: int, buf: bytearray) -> None:
        scores = np.frombuffer(bytes(buf), np.float32)
        if not (np.isfinite(scores).all() and (scores >= 0).all() and (scores <= 1).all()):
            raise RingError(f"member {p} sent malformed scores", reason="malformed scores")
        self.rows[c] = scores
        self.final[(c, -1)] = hashlib.sha256(buf).digest()


def _get(inq: queue.Queue, timeout: float, pumps: list[_Pump]):
    waited = 0.0
    while True:
        try:
            return inq.get(timeout=0.2)
        except queue.Empty:
            waited += 0.2
        for pump in pumps:
            if pump.error is not None:
                err = pump.error  # a receive pump's blame (a frame trickled past its budget) stays
                raise RingError(f"{pump.name}: {err}", blame=getattr(err, "blame", None),
                                reason=getattr(err, "reason", "")) from err
        if waited >= timeout:
            raise RingError(f"no frame for {timeout:.0f}s")
