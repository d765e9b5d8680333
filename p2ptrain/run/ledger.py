"""Whom this peer no longer trusts in a run, and why.

A member caught cheating (a bad header, a blamed frame, a robust-rule outlier) is rejected:
logged (`contribution_rejected`) and ignored for the rest of the run. The ledger also keeps
every member's signed digests (a replayed header is caught by `verify_headers`) and the
peers the robust rule flagged, which it reports in our DHT reputation entry; peers enough
others report are left out of our groups (`p2ptrain.run.reputation`).
"""

from __future__ import annotations

import logging

from p2ptrain.run import reputation

log = logging.getLogger("p2ptrain.run.ledger")


class Ledger:
    def __init__(self, me: str, events) -> None:
        self.me = me
        self.events = events
        self.ignored: set[str] = set()
        self.history: dict[str, set[tuple[str, ...]]] = {}
        self.flagged: dict[str, int] = {}  # peers the robust rule flagged -> step (our report)

    def reject(self, t: int, peer: str, reason: str) -> None:
        if peer == self.me or peer in self.ignored:
            return
        self.ignored.add(peer)
        log.warning("contribution rejected: step=%d peer=%s reason=%s", t, peer, reason)
        self.events.emit("contribution_rejected", step=t, remote=peer, reason=reason)

    def remember(self, headers: dict) -> None:
        """The committed round's signed digests: the same header again is a replay."""
        for peer, h in headers.items():
            self.history.setdefault(peer, set()).add(h.own_digests)

    async def note_outliers(self, dht, run_id: str, t: int, roster: list[str], headers: dict, scores: list) -> None:
        """Members the robust rule threw away far more than the others, by the committed scores
        (the same on every member): ignored from now on and reported in our DHT record."""
        out = [p for p in reputation.outliers(roster, headers, scores) if p != self.me]
        for peer in out:
            self.reject(t, peer, "robust-outlier")
            self.flagged[peer] = t
        if out:
            acked = await reputation.publish(dht, run_id, self.flagged)
            self.events.emit("reputation_published", step=t, flagged=sorted(self.flagged), replicas=acked)

    async def apply_reputation(self, dht, run_id: str, t: int) -> None:
        """Leave out of our groups the peers that enough others reported."""
        for peer, reporters in reputation.excluded(await reputation.read(dht, run_id)).items():
            if peer != self.me and peer not in self.ignored:
                self.ignored.add(peer)
                self.events.emit("peer_excluded", step=t, remote=peer, reason="reputation", reporters=reporters)
