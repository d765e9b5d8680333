"""What a contribution round is built from: the all-reduce service it runs on
(`ReduceService`: the real `p2ptrain.reduce.service.AllReduceService`, the simulator's
`p2ptrain.sim.service.SimReduceService`, tests' fakes) and what this peer contributes
(`Contributor`: hostile-peer tests subclass it), and how it encodes what it sends
(`prepare`), its settings (`RoundConfig`) and what it leaves (`Outcome`). Split from
`p2ptrain.run.round`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import trio

from p2ptrain.reduce import butterfly, ring
from p2ptrain.reduce.robust import RobustConfig
from p2ptrain.run.contribution import Header, chunk_norms, frame_digest, sign_header


class ReduceService(Protocol):
    """The slice of `p2ptrain.reduce.service.AllReduceService` a round uses."""

    async def exchange(self, run_id: str, round_id: str, members: list[str], payload: bytes,
                       timeout: float, unreachable_silent: bool = False,
                       answer_strangers: bool = False, absent=None, cut=None, split=None) -> dict[str, bytes | None]:
        """`absent(peers)` -> those of the awaited `peers` that will not come (rule E13),
        asked every probe second while someone is awaited; their payloads still count.
        `cut`: once any member's payload has arrived, wait at most `cut` seconds more (R4a).
        `split`: (seconds, test): once a payload passing `test` arrived, at most that much more (R6)."""

    async def allreduce(self, vec: np.ndarray, run_id: str, round_id: str, members: list[str],
                        own=None, check=None, robust=None, on_own=None, gate=None):
        """Returns an object with `result`, `sent_bytes` and `scores`; raises RoundFailed
        (`refused` set when `gate(result)` gave a reason not to sign: `p2ptrain.run.lossgate`).
        `on_own(j, payload)` is called with each of our step-0 frames as it is encoded, then
        `on_own(-1, None)` (`p2ptrain.reduce.ring.allreduce`)."""

    async def abort(self, run_id: str, round_id: str, reason: str) -> None:
        """Abort our running round `round_id` (it cannot commit): its data plane stops now."""


class Contributor:
    """What this peer puts into a round: its pseudo-gradient, under a true signed header, and
    the ready time it claims."""

    def payload(self, delta: np.ndarray) -> np.ndarray:
        return delta

    def sign(self, header: Header, identity) -> bytes:
        return sign_header(header, identity)

    def ready_at(self, now: float) -> float:
        """The ready time this peer claims for a step (readers clamp it: `run.elect`)."""
        return now


@dataclass
class _Prepared:
    send: np.ndarray
    own: list
    digests: tuple[str, ...]
    norms: tuple[float, ...]
    norm: float
    lay: list


def prepare(delta: np.ndarray, send: np.ndarray, rank: int, world: int, cfg: ring.RingConfig,
            robust: bool) -> _Prepared:
    """Encode and hash what we send, and the norms we sign (blocking: numba and hashing)."""
    if not robust:
        own = ring.own_payloads(send, rank, world, cfg)
        digests = tuple(frame_digest(p) for p in own)
    else:  # a copy of every chunk, each signed: every owner checks what it receives
        own = butterfly.own_payloads(send, world, cfg)
        digests = butterfly.chunk_digests(own)
    lay = ring.layout(delta.size, world, cfg)
    norms = chunk_norms(delta, lay)
    return _Prepared(send, own, digests, norms, math.sqrt(math.fsum(x * x for x in norms)), lay)


def transfer_budget(svc, nbytes: int, least: float) -> float:
    """Seconds a bulk transfer of `nbytes` may take: its bytes at the bulk floor rate
    (`frame_min_rate_mbps`, 1 Mbit/s) plus `round_allowance`, as the data plane's own budget
    (`AllReduceConfig.data_budget`), never under `least`. `svc`: an `AllReduceConfig`."""
    return max(least, svc.round_allowance + svc.at_floor(nbytes))


def merge_budget(svc, exchange: float, state_bytes: int) -> float:
    """Seconds a merge round's state fetches may take (rule M1): `transfer_budget` of a state
    (the genesis's size: the same arrays), at least six exchange timeouts. Before, a fixed
    six exchange timeouts (30 s): a fetch of a 100M-parameter state (~400 MB) then needed
    107 Mbit/s, so at real model sizes lineages never merged."""
    return transfer_budget(svc, state_bytes, 6.0 * exchange)


def attempt_span(svc, before_data: float, nbytes: int, world: int) -> float:
    """The longest an attempt can run once its roster is confirmed: `before_data` (a merge's
    state fetches and the headers), the service's bulk setup, its data plane (closed at the
    round's data budget, or failed earlier by a frame's timeout: the larger of the two is a
    safe bound for either) and its commit vote. `svc`: an `AllReduceConfig`; `nbytes`: the
    float32 vector's size."""
    return (before_data + svc.setup_timeout + max(svc.frame_timeout, svc.data_budget(nbytes, world))
            + svc.commit_timeout)


@dataclass(frozen=True)
class RoundConfig:
    mode: str
    """'int8' or 'fp32' (the ring's wire format), or 'sparse' (the run's train.allreduce)."""
    sub_chunk_bytes: int
    """Must be the service's data-plane frame size: members cut the tensor the same way."""
    exchange_timeout: float
    robust: RobustConfig | None = None
    """Robust runs: butterfly + CenteredClip instead of the ring's mean."""
    max_attempts: int = 4
    abort_skew: float = 0.0
    """Seconds one member may still spend in an attempt after another left it: the
    service's `commit_timeout` (a member that signed waits that long for a certificate;
    one that signed nothing aborts at once) plus `exchange_timeout` (a member that went on
    with a roster another did not confirm waits that long for its header). Confirmations
    after the first wait this much longer than `exchange_timeout`; before, the member that
    left first gave up on the other and both skipped the step (issue 17)."""
    attempt_span: float = 0.0
    """The longest an attempt runs once its roster is confirmed (`attempt_span`). A member
    that R4's probe leaves out of an attempt waits this much longer at the next
    confirmation: the others come back only when the attempt they ran without it failed,
    and one held by a withholder ran 31 s where the member left out waited 20 s, skipped,
    and the others then waited for it in vain (simulator seed 30047)."""

    def __post_init__(self) -> None:
        ring.RingConfig(self.ring_mode, sub_chunk_bytes=self.sub_chunk_bytes)  # validates both
        if not (self.exchange_timeout > 0 and self.max_attempts >= 1 and self.abort_skew >= 0
                and self.attempt_span >= 0):
            raise ValueError("exchange_timeout must be > 0, max_attempts >= 1, abort_skew and attempt_span >= 0")

    @property
    def ring_mode(self) -> str:
        return "int8" if self.mode == "sparse" else self.mode


@dataclass
class Outcome:
    result: np.ndarray | None
    """The committed mean over the roster (the outer step applies `average`); None when no
    round committed (the step is skipped)."""
    members: list[str]
    bytes_sent: int = 0
    bytes_recv: int = 0
    headers: dict = field(default_factory=dict)
    scores: list | None = None
    payload_bytes: int | None = None
    """Sparse runs: our compressed contribution's size (computed), beside the counted bytes."""
    alone: bool = False
    """The result is our own delta: every other member dropped out. The caller must not
    commit it while others are near (rule H2: `Trainer.commit_step`)."""
    merged: tuple[bytes, str] | None = None
    """A merge round's merged base (checkpoint bytes, params hash): the committed state is
    the outer step applied to it, not to our own base (`p2ptrain.run.merge`)."""
    weight: int = 1
    """The new state's weight in later merges: the members that trained this round."""
    parents: tuple[str, ...] = ()
    """A merge round's bases (params hashes, sorted): the new state's parents."""
    scale: float = 1.0  # average = result x scale: the mean over those that trained (trained_scale)
    seconds: dict = field(default_factory=dict)
    """Where the round's time went (roster, prepare, headers, reduce; summed over attempts;
    the trainer's `step_timing` event). In ring rounds the parts overlap."""

    def average(self) -> np.ndarray:
        """What the outer step applies (a model-sized multiply: call it in a worker thread)."""
        return self.result if self.scale == 1.0 else self.result * np.float32(self.scale)

    def took(self, part: str, since: float) -> float:
        now = trio.current_time()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - since
        return now


def attempt_waits(config: RoundConfig, nth: int, first_wait: float | None, sat_out: bool = False,
                  first_cut: float | None = None) -> tuple[float, float | None]:
    """Seconds a try's `nth` roster confirmation waits (`ContributionRound.run`; later ones
    add `abort_skew`; after an attempt we sat out, also as long as it may run: R4a), and its
    cut (`_confirm`'s `short`: once anyone answered, wait at most this much more): R4a's
    usual wait, or E14's `first_cut` at the first confirmation; None for no cut."""
    first = config.exchange_timeout if first_wait is None else first_wait
    wait = first if nth == 0 else config.exchange_timeout + config.abort_skew
    if sat_out:
        return wait + config.attempt_span, wait
    return wait, first_cut if nth == 0 else None
