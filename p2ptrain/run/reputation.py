"""Reputation records: which members the robust rule kept throwing away, for group forming.

After a committed robust round every member holds the same per-owner scores (they are part of
the round's digest), so every member computes the same `robust.flagged` set: within the group
the verdict is consistent, and each member ignores the flagged peers for the rest of the run.
Each member then publishes what it saw as one signed DHT entry under
/p2ptrain/<run>/reputation (the DHT signs it with the reporter's key; one entry per reporter,
replaced as it grows): {peer id: outer step it was last flagged at}.

Peers in other groups and later joiners read those entries when they elect a group
(`excluded`): a peer named by at least MIN_REPORTERS distinct reporters is left out. One
reporter is not enough, so a single hostile peer cannot get an honest one excluded by
publishing lies; a peer that is itself excluded does not count as a reporter.

Known limit: the DHT has no admission control, so an attacker with MIN_REPORTERS identities
(a Sybil) could still publish false reports; trust in reporters (e.g. only those that shared a
committed round with the accused) is left for later.
"""

from __future__ import annotations

import logging

import msgpack

from p2ptrain.identity import peer_id_to_str
from p2ptrain.run import keys

log = logging.getLogger("p2ptrain.run.reputation")

MAX_REPORT_BYTES = 8 * 1024
MAX_FLAGGED = 64
MIN_REPORTERS = 2
TTL = 3600.0


def encode_report(flagged: dict[str, int]) -> bytes:
    """Our report: the MAX_FLAGGED most recently flagged peers."""
    newest = sorted(flagged.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_FLAGGED]
    return msgpack.packb({"flagged": dict(newest)}, use_bin_type=True)


def decode_report(data: bytes) -> dict[str, int]:
    """{peer: step}; raises ValueError on anything malformed or oversize (checked first)."""
    if len(data) > MAX_REPORT_BYTES:
        raise ValueError(f"report of {len(data)} bytes > {MAX_REPORT_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, max_map_len=MAX_FLAGGED, max_str_len=128, max_bin_len=0,
                              max_array_len=0)
        flagged = obj["flagged"]
        out = {p: s for p, s in flagged.items() if isinstance(p, str) and type(s) is int and s >= 0}
    except Exception:
        raise ValueError("malformed report") from None
    if len(out) != len(flagged):
        raise ValueError("malformed report")
    return out


def excluded(reports: dict[str, dict[str, int]], min_reporters: int = MIN_REPORTERS) -> dict[str, list[str]]:
    """Peers named by >= min_reporters distinct reporters: {peer: its reporters}. Two passes:
    reporters that the first pass excludes do not count in the second, so liars outnumbered by
    honest reporters lose their votes; an even standoff excludes nobody (conservative)."""

    def tally(skip) -> dict[str, list[str]]:
        votes: dict[str, list[str]] = {}
        for reporter, flagged in sorted(reports.items()):
            if reporter not in skip:
                for peer in flagged:
                    if peer != reporter:
                        votes.setdefault(peer, []).append(reporter)
        return {p: r for p, r in votes.items() if len(r) >= min_reporters}

    return tally(set(tally(set())))


def outliers(roster: list[str], headers: dict, scores: list) -> list[str]:
    """The members of a committed robust round that `robust.flagged` names, except those whose
    signed header declares no training (tokens == 0: a newcomer joining with a zero update is
    clipped like a free-rider, but said so up front)."""
    from p2ptrain.reduce import robust

    return [roster[i] for i in robust.flagged(scores)
            if i < len(roster) and getattr(headers.get(roster[i]), "tokens", 1) != 0]


async def read(dht, run_id: str) -> dict[str, dict[str, int]]:
    """Every reporter's verified entry: {reporter: {peer: step}}; malformed ones are dropped."""
    out = {}
    for sub, rec in (await dht.get(keys.reputation(run_id))).items():
        try:
            out[peer_id_to_str(sub)] = decode_report(rec.value)
        except ValueError as exc:
            log.warning("reputation record dropped: reporter=%s reason=%s", peer_id_to_str(sub), exc)
    return out


async def publish(dht, run_id: str, flagged: dict[str, int]) -> int:
    """Store our report (signed by the DHT with our key); returns the replicas that acked."""
    return await dht.store(keys.reputation(run_id), encode_report(flagged), ttl=TTL)
