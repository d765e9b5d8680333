"""Reputation records: which members the robust rule kept throwing away, for group forming.

After a committed robust round every member holds the same per-owner scores (they are part of
the round's digest), so every member computes the same `robust.flagged` set: within the group
the verdict is consistent, and each member ignores the flagged peers for the rest of the run.
Each member then publishes what it saw as one signed DHT entry under
/p2ptrain/<run>/reputation (the DHT signs it with the reporter's key; one entry per reporter,
replaced as it grows): {peer id: outer step it was last flagged at}.

Peers read those entries when they elect a group (`excluded`). Identities are free, so a
report counts only when its reporter has standing with the reader (`p2ptrain.run.standing`:
committed rounds of verified work with us; issue 32, item 6: before, two Sybil reports
excluded every honest peer for the rest of the run). A peer is left out when
  - it has no standing with us: at least MIN_REPORTERS reporters with standing name it;
  - it has standing with us: a strict majority of all the peers with standing with us
    (itself aside), and at least MIN_REPORTERS, name it. Our own verified work with it
    outweighs any minority's word, whatever they published.
Only entries flagged within the last HORIZON outer steps count (an entry claiming a later
step than the reader's counts as now), and the verdict is taken again before every election,
so an exclusion by reputation ends once its reports age out (`Ledger.apply_reputation`).
A reporter that the first count excludes does not count in the second.

Known limit: a newcomer (standing with nobody) counts no report at all, and k Sybils that
earned standing by verified work count like anyone else.
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
HORIZON = 16
"""Outer steps a flag counts for after the step it names."""
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


def excluded(reports: dict[str, dict[str, int]], step: int, standing: frozenset[str],
             min_reporters: int = MIN_REPORTERS, horizon: int = HORIZON) -> dict[str, list[str]]:
    """Peers to leave out at outer step `step`: {peer: the reporters that named it}. Only
    reporters in `standing` (peers with standing with us) count, only flags of the last
    `horizon` steps; a peer needs `min_reporters`, and one in `standing` also a strict
    majority of `standing` (less itself). Two passes: reporters that the first pass excludes
    do not count in the second, so liars outnumbered by honest reporters lose their votes;
    an even standoff excludes nobody (conservative)."""

    def tally(skip) -> dict[str, list[str]]:
        votes: dict[str, list[str]] = {}
        for reporter, flagged in sorted(reports.items()):
            if reporter in standing and reporter not in skip:
                for peer, at in flagged.items():
                    if peer != reporter and step - min(at, step) <= horizon:
                        votes.setdefault(peer, []).append(reporter)
        return {p: r for p, r in votes.items()
                if len(r) >= max(min_reporters, len(standing - {p}) // 2 + 1 if p in standing else 0)}

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
