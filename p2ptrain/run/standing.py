"""Standing: trust earned only by verified work (pure logic: no I/O). Issue 15, hole 6.

Identities are free, so nothing a fresh identity *says* may buy it influence. What this peer
has itself checked is different: a peer that was a member of a round this peer committed
(its signed header verified, every frame it sent held to that header, the result identical
on every member) has done one unit of verified work in our eyes. `Standing` counts those
units per peer, locally; nobody can write to it but our own commits.

It buys, once a peer has `rounds` committed rounds with us (`trusted`):
  - checkpoint choice: attesters we trust outrank any number we do not
    (`p2ptrain.ckpt.providers.choose`), so Sybils cannot plant a state on a peer catching up;
  - contribution size: we list the members we trust in our signed header (`Header.trusts`),
    and every member holds each norm to `probation_factor` x our anchor (our own norm), or
    10x for those we trust (`p2ptrain.run.contribution.objections`). A fresh identity can
    therefore move the mean by at most 3x what each honest member of its round contributes,
    in every group, whoever else is in it;
  - reputation: only reports by peers we trust count (`p2ptrain.run.reputation.excluded`).
What it cannot do: a newcomer with no history trusts nobody, and Sybils that train honestly
for `rounds` steps earn standing like anyone else (they then cost that much compute each).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StandingConfig:
    rounds: int = 2
    """Committed rounds with us before a peer is trusted."""
    probation_factor: float = 3.0
    """A peer on probation signs at most this x each other member's anchor (its own norm)."""

    def __post_init__(self) -> None:
        if self.rounds < 1 or not self.probation_factor >= 1:
            raise ValueError("rounds must be >= 1 and probation_factor >= 1")


@dataclass
class Standing:
    me: str
    config: StandingConfig = field(default_factory=StandingConfig)
    rounds: dict[str, int] = field(default_factory=dict)
    last_step: dict[str, int] = field(default_factory=dict)

    def committed(self, step: int, members: list[str]) -> None:
        """A round of outer step `step` committed with these members (counted once per step)."""
        for p in set(members) - {self.me}:
            if self.last_step.get(p) != step:
                self.rounds[p] = self.rounds.get(p, 0) + 1
                self.last_step[p] = step

    def forget(self, peer: str) -> None:
        """Caught cheating: standing is lost with the peer's exclusion."""
        self.rounds.pop(peer, None)
        self.last_step.pop(peer, None)

    def trusted(self) -> frozenset[str]:
        return frozenset(p for p, n in self.rounds.items() if n >= self.config.rounds)
