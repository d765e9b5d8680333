"""How an all-reduce round ends, as its callers see it: `RoundResult` or `RoundFailed`, and
which exceptions of a round's setup mean "the round fails" rather than "a bug"; and, inside
the service, what its data plane left (`Plane`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from libp2p.exceptions import BaseLibp2pError

from p2ptrain.reduce.control import ControlError
from p2ptrain.reduce.schedule import RingError


class RoundFailed(Exception):
    """The round aborted on this member; no tensor was changed.

    `blamed`: members caught sending bad data (peer id -> reason), by our own data plane or
    by a member that received their bytes (`p2ptrain.reduce.blame`). `suspects`: blamers whose
    accusations nobody corroborated (peer id -> count); their blame is not in `blamed`.
    `gone`: members found certainly gone (no connection, and their dial refused): crashed.
    `refused`: our own gate refused the result (`p2ptrain.run.lossgate`), with its reason."""

    def __init__(self, message: str, blamed: dict[str, str] | None = None,
                 suspects: dict[str, int] | None = None, gone: tuple[str, ...] = (), refused: str = "") -> None:
        super().__init__(message)
        self.refused = refused
        self.blamed = blamed or {}
        self.suspects = suspects or {}
        self.gone = tuple(gone)


@dataclass
class RoundResult:
    result: np.ndarray
    digest: str
    sent_bytes: int
    seconds: float
    path: str
    """'direct' or 'libp2p' for our outgoing bulk session."""
    phases: dict = field(default_factory=dict)
    """Seconds spent in setup, data plane and commit votes (for benches)."""
    scores: list | None = None
    """Robust rounds: each owner's per-member scores (identical on every member)."""
    reused: bool = False
    """Both ring channels ran on persistent links (no libp2p session this round)."""


SETUP_ERRORS = (ControlError, EOFError, OSError, BaseLibp2pError, RingError, RoundFailed)
"""What a member that died, refused or answered garbage during setup raises: the round fails."""


def setup_failure(group: BaseExceptionGroup) -> BaseException:
    """The first of a nursery group's exceptions when every one is a setup failure (the
    round fails); anything else (a bug, a KeyboardInterrupt) is re-raised as it came."""
    failures, rest = group.split(SETUP_ERRORS)
    if rest is not None or failures is None:
        raise group
    first: BaseException = failures
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


@dataclass
class Plane:
    """What a round's data plane left (`AllReduceService`): a result and our vote, or the
    error that ended it."""

    result: np.ndarray | None = None
    sent: int = 0
    digest: str = ""
    sigs: list | None = None  # every member's signature: a certificate (ring rounds)
    scores: list | None = None
    t_data: float = 0.0
    error: RingError | None = None  # the data plane failed: we signed nothing
    gather_error: str = ""  # the ring votes failed after we signed
    refused: str = ""  # our gate refused the result: we signed nothing
