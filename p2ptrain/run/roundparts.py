"""What a contribution round is built from: the all-reduce service it runs on
(`ReduceService`: the real `p2ptrain.reduce.service.AllReduceService`, the simulator's
`p2ptrain.sim.service.SimReduceService`, tests' fakes) and what this peer contributes
(`Contributor`: hostile-peer tests subclass it), and how it encodes what it sends
(`prepare`). Split from `p2ptrain.run.round`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from p2ptrain.reduce import butterfly, ring
from p2ptrain.run.contribution import Header, chunk_norms, frame_digest, sign_header


class ReduceService(Protocol):
    """The slice of `p2ptrain.reduce.service.AllReduceService` a round uses."""

    async def exchange(self, run_id: str, round_id: str, members: list[str], payload: bytes,
                       timeout: float, unreachable_silent: bool = False,
                       answer_strangers: bool = False) -> dict[str, bytes | None]: ...

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
