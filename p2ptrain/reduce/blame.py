"""Whose accusations a round may act on (pure logic: no I/O, no trio).

A data-plane accusation ("member B sent me bad bytes") can only be judged by a member that
received B's bytes. In a ring round that is B's ring successor alone: frames are sealed
pairwise, so nobody else saw them. In a butterfly (robust) round every member receives from
every other member. An accusation outside that rule is dropped: a hostile member must not get
an honest peer it never received from excluded.

Inside the rule an accusation still cannot be checked by a third party, so blamers are held
to account over time: an accusation is corroborated when another accuser (or this node's own
data plane) also caught the same peer. A blamer with `suspect_after` or more distinct
uncorroborated accusations is a suspect; its further accusations are not acted on, and the
caller (the trainer) reads `suspects()` to leave it out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BlameConfig:
    suspect_after: int = 2
    """Distinct uncorroborated accusations that make a blamer suspect."""
    max_peers: int = 4096
    """Accusations remembered at most (oldest forgotten first): memory stays bounded."""

    def __post_init__(self) -> None:
        if self.suspect_after < 1 or self.max_peers < 1:
            raise ValueError("suspect_after and max_peers must be >= 1")


def may_blame(ids: list[bytes], blamer: bytes, blamed: bytes, ring: bool) -> bool:
    """Whether `blamer` could have received `blamed`'s bytes in this round."""
    if blamer not in ids or blamed not in ids or blamer == blamed:
        return False
    if not ring:
        return True
    return ids[(ids.index(blamer) - 1) % len(ids)] == blamed


class BlameLedger:
    """Accusations seen over a run: who blamed whom, and who is corroborated."""

    def __init__(self, config: BlameConfig | None = None) -> None:
        self.config = config or BlameConfig()
        self._by_blamed: dict[str, set[str]] = {}  # insertion order = age, for the bound
        self._by_blamer: dict[str, set[str]] = {}

    def note(self, blamer: str, blamed: str) -> None:
        accusers = self._by_blamed.pop(blamed, set())
        accusers.add(blamer)
        self._by_blamed[blamed] = accusers  # re-inserted: most recent last
        self._by_blamer.setdefault(blamer, set()).add(blamed)
        while len(self._by_blamed) > self.config.max_peers:
            old = next(iter(self._by_blamed))
            for who in self._by_blamed.pop(old):
                self._by_blamer.get(who, set()).discard(old)
        for who in [b for b, s in self._by_blamer.items() if not s]:
            del self._by_blamer[who]

    def uncorroborated(self, blamer: str) -> int:
        """How many peers `blamer` accused that nobody else (us included) caught."""
        return sum(1 for b in self._by_blamer.get(blamer, ()) if self._by_blamed.get(b, set()) == {blamer})

    def is_suspect(self, blamer: str) -> bool:
        return self.uncorroborated(blamer) >= self.config.suspect_after

    def suspects(self) -> dict[str, int]:
        """Suspect blamer -> its count of uncorroborated accusations."""
        counts = {b: self.uncorroborated(b) for b in self._by_blamer}
        return {b: n for b, n in counts.items() if n >= self.config.suspect_after}
