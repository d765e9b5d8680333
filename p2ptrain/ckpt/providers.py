"""Checkpoint provider records and the quorum rule a newcomer trusts (pure: no I/O).

After each committed outer step, every member of a group stores a provider record under
`/p2ptrain/<run>/providers` in the DHT. DHT records are multi-writer and signed by their
writer (`p2ptrain.dht.record`), so each record is one peer's signed statement: "after step
`step`, the checkpoint whose chunk manifest hashes to `manifest` (whole blob `sha256`,
parameters `params`) is what my group `members` committed, and I serve it".

A newcomer must not trust one peer's word (a single hostile peer could advertise any
state). `choose` accepts a (step, manifest) only when at least half of the group that
committed it signed the same manifest hash: members are named by the records themselves,
and only a signer that is in the member list it names counts. The member list must name
distinct peers, and while more than one peer advertises anything, one self-attesting peer
is not a quorum. At step 0 there is no group yet; the genesis hash in
the run manifest (signed by the run's initiator) is the authority instead, so a step-0
record counts only if its whole-blob hash is the genesis hash.

Ranking (issue 15, hole 3): first by attesters the caller has itself seen do verified work
(`trusted`: peers it committed rounds with, p2ptrain.run.standing), then by attesters, and
only then by step -- so a few fresh identities that claim step 10**6 cannot outbid the
group that actually trained. Checkpoints whose whole-blob hash the caller already found
unloadable (`reject`) are never chosen again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack

MAX_MEMBERS = 64
MAX_VALUE_BYTES = 8 * 1024


class ProviderError(ValueError):
    pass


@dataclass(frozen=True)
class Provider:
    peer: str                 # the signer (the DHT record's subkey), as a peer id string
    step: int
    manifest: str             # SHA-256 of the chunk manifest (p2ptrain.ckpt.chunks)
    sha256: str               # SHA-256 of the whole checkpoint blob
    params: str               # params_sha256 after the step (for logs and tests)
    members: tuple[str, ...]  # the group that committed `step` (empty at step 0)
    addrs: tuple[str, ...]


@dataclass(frozen=True)
class Choice:
    step: int
    manifest: str
    sha256: str
    params: str
    providers: tuple[str, ...]   # every peer advertising this manifest (attesters or not)
    attesters: tuple[str, ...]   # members that signed it (empty at step 0)


def encode(step: int, manifest: str, sha256: str, params: str, members: list[str], addrs: list[str]) -> bytes:
    value = msgpack.packb({"step": int(step), "manifest": manifest, "sha256": sha256, "params": params,
                           "members": sorted(members)[:MAX_MEMBERS], "addrs": list(addrs)[:16]})
    if len(value) > MAX_VALUE_BYTES:
        raise ProviderError("provider record is too large")
    return value


def _hex64(x: object) -> str:
    if not isinstance(x, str) or len(x) != 64:
        raise ProviderError("not a sha256 hex digest")
    bytes.fromhex(x)
    return x


def decode(peer: str, value: bytes) -> Provider:
    """One provider record's value, signed by `peer` (already checked by the DHT layer)."""
    if len(value) > MAX_VALUE_BYTES:
        raise ProviderError("provider record is too large")
    try:
        v = msgpack.unpackb(value, raw=False, max_array_len=MAX_MEMBERS, max_map_len=16, max_str_len=512)
        step = v["step"]
        if type(step) is not int or step < 0:  # not a bool
            raise ProviderError("bad step")
        members, addrs = v.get("members", []), v.get("addrs", [])
        # A string is not a list (iterating one gave its characters as members).
        if not all(isinstance(x, list) and all(isinstance(i, str) for i in x) for x in (members, addrs)):
            raise ProviderError("members and addrs must be lists of strings")
        members, addrs = tuple(members), tuple(addrs[:16])
        return Provider(peer, step, _hex64(v["manifest"]), _hex64(v["sha256"]), _hex64(v["params"]),
                        members, addrs)
    except ProviderError:
        raise
    except Exception:
        raise ProviderError("provider record is malformed") from None


def choose(records: list[Provider], genesis_sha256: str, min_step: int = 0,
           max_group: int = MAX_MEMBERS, trusted: frozenset[str] | set[str] = frozenset(),
           reject: frozenset[str] | set[str] = frozenset()) -> Choice | None:
    """The best-attested checkpoint (or genesis at step 0) at `min_step` or later. Groups
    larger than the run's group size (`max_group`) are not groups of this run."""
    known = {r.peer for r in records}
    by_key: dict[tuple[int, str], list[Provider]] = {}
    for r in records:
        if r.step >= min_step and len(r.members) <= max_group and r.sha256 not in reject:
            by_key.setdefault((r.step, r.manifest), []).append(r)
    best: tuple[tuple[int, int, int], Choice] | None = None
    for (step, manifest), recs in by_key.items():
        providers = tuple(sorted({r.peer for r in recs}))
        if step == 0:
            genesis = [r for r in recs if r.sha256 == genesis_sha256]
            if not genesis:
                continue
            choice = Choice(0, manifest, genesis_sha256, genesis[0].params,
                            tuple(sorted({r.peer for r in genesis})), ())
            vouch = choice.providers
        else:
            attesters = _quorum(recs, known)
            if not attesters:
                continue
            ref = next(r for r in recs if r.peer in attesters)
            choice = Choice(step, manifest, ref.sha256, ref.params, providers, attesters)
            vouch = attesters
        rank = (len(set(vouch) & set(trusted)), len(vouch), step)
        if best is None or rank > best[0]:
            best = (rank, choice)
    return best[1] if best else None


def _quorum(recs: list[Provider], known: set[str]) -> tuple[str, ...]:
    """Signers of one (step, manifest) that form at least half of the group they name.

    Records naming different member lists are counted separately: a peer that lists a
    group of its own inventing is a group of one that nobody else confirms. Listed members
    must be distinct (padding the list with invented names only raises the bar), and a lone
    signer is a quorum only when it is the only peer advertising anything."""
    groups: dict[tuple[str, ...], set[str]] = {}
    for r in recs:
        if r.members and r.peer in r.members and len(set(r.members)) == len(r.members):
            groups.setdefault(r.members, set()).add(r.peer)
    need_two = len(known) > 1
    best: tuple[str, ...] = ()
    for members, signers in groups.items():
        if need_two and len(signers) < 2:
            continue
        if len(signers) >= math.ceil(len(members) / 2) and len(signers) > len(best):
            best = tuple(sorted(signers))
    return best


def best_state(votes: dict[tuple[int, str], list]) -> tuple[tuple[int, str], list] | None:
    """The run's current (step, checkpoint hash) from peers' state records: the one the most
    peers publish, the newest among equals. A step only one peer claims is a claim, not a
    state (issue 15: one record at step 10**6 made every newcomer wait 120 s for a checkpoint
    that never comes), and a few identities agreeing on a fake step are outnumbered by the
    group that trains; only when no state has two publishers (a run of one, or a split) does
    a lone record count, and then the lowest such step, which no liar can move past the truth."""
    multi = {k: v for k, v in votes.items() if len(set(v)) >= 2}
    if multi:
        return max(multi.items(), key=lambda kv: (len(set(kv[1])), kv[0][0]))
    if votes:
        return min(votes.items(), key=lambda kv: kv[0])
    return None
