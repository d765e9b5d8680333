"""What a contribution round is built from: the all-reduce service it runs on
(`ReduceService`: the real `p2ptrain.reduce.service.AllReduceService`, the simulator's
`p2ptrain.sim.service.SimReduceService`, tests' fakes) and what this peer contributes
(`Contributor`: hostile-peer tests subclass it). Split from `p2ptrain.run.round`."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from p2ptrain.run.contribution import Header, sign_header


class ReduceService(Protocol):
    """The slice of `p2ptrain.reduce.service.AllReduceService` a round uses."""

    async def exchange(self, run_id: str, round_id: str, members: list[str], payload: bytes,
                       timeout: float, unreachable_silent: bool = False,
                       answer_strangers: bool = False) -> dict[str, bytes | None]: ...

    async def allreduce(self, vec: np.ndarray, run_id: str, round_id: str, members: list[str],
                        own=None, check=None, robust=None, on_own=None):
        """Returns an object with `result`, `sent_bytes` and `scores`; raises RoundFailed.
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
