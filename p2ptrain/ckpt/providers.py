"""The quorum rule a newcomer trusts among checkpoint provider records (pure: no I/O).

After each committed outer step, every member of a group stores a provider record under
`/p2ptrain/<run>/providers` in the DHT. DHT records are multi-writer and signed by their
writer (`p2ptrain.dht.record`), so each record is one peer's signed statement: "after step
`step`, the checkpoint whose chunk manifest hashes to `manifest` (whole blob `sha256`,
parameters `params`) is what my group `members` committed, and I serve it" (its codec:
`p2ptrain.records.codecs.Provider`; read and written through `p2ptrain.records.RunRecords`).

A newcomer must not trust one peer's word (a single hostile peer could advertise any
state). `choose` accepts a (step, manifest) only when at least half of the group that
committed it signed the same manifest hash: members are named by the records themselves,
and only a signer that is in the member list it names counts. The member list must name
distinct peers, and while more than one peer advertises anything, one self-attesting peer
is its own quorum (a peer that trained alone: its state is the run's until others
commit with it). At step 0 there is no group yet; the genesis hash in the run manifest
(signed by the run's initiator) is the authority instead, so a step-0 record counts only
if its whole-blob hash is the genesis hash.

This is the run's *head* (docs/PROTOCOL.md, rule H1): the state a newcomer, a restarted
peer and a peer catching up adopt. Ranking (issue 15, hole 3): first by attesters the
caller has itself seen do verified work (`trusted`: peers it committed rounds with,
p2ptrain.run.standing), then any trained state over the genesis (genesis records are
published by every peer that has not trained yet: before, three joiners' genesis records
outvoted the one peer that had trained 116 steps, issue 31), then by attesters, and only
then by step -- so a few fresh identities that claim step 10**6 cannot outbid the group
that actually trained. The caller's own records are not votes (`ignore`): a restarted
peer's old record outranked the state its partner trained on without it (issue 31).
Checkpoints whose whole-blob hash the caller already found unloadable (`reject`) are
never chosen again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2ptrain.records.codecs import MAX_MEMBERS, Provider

__all__ = ["Choice", "Provider", "MAX_MEMBERS", "choose"]


@dataclass(frozen=True)
class Choice:
    step: int
    manifest: str
    sha256: str
    params: str
    providers: tuple[str, ...]   # every peer advertising this manifest (attesters or not)
    attesters: tuple[str, ...]   # members that signed it (empty at step 0)


def choose(records: list[Provider], genesis_sha256: str, min_step: int = 0,
           max_group: int = MAX_MEMBERS, trusted: frozenset[str] | set[str] = frozenset(),
           reject: frozenset[str] | set[str] = frozenset(),
           ignore: frozenset[str] | set[str] = frozenset()) -> Choice | None:
    """The head: the best-attested checkpoint (or genesis at step 0) at `min_step` or later.
    Groups larger than the run's group size (`max_group`) are not groups of this run; records
    signed by `ignore` (the caller itself) are not read."""
    by_key: dict[tuple[int, str], list[Provider]] = {}
    for r in records:
        if r.peer in ignore:
            continue
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
            attesters = _quorum(recs)
            if not attesters:
                continue
            ref = next(r for r in recs if r.peer in attesters)
            choice = Choice(step, manifest, ref.sha256, ref.params, providers, attesters)
            vouch = attesters
        rank = (len(set(vouch) & set(trusted)), step > 0, len(vouch), step)
        if best is None or rank > best[0]:
            best = (rank, choice)
    return best[1] if best else None


def _quorum(recs: list[Provider]) -> tuple[str, ...]:
    """Signers of one (step, manifest) that form at least half of the group they name.

    Records naming different member lists are counted separately: a peer that lists a
    group of its own inventing is a group of one that nobody else confirms, and ranks below
    every state two or more signers attest. Listed members must be distinct (padding the
    list with invented names only raises the bar)."""
    groups: dict[tuple[str, ...], set[str]] = {}
    for r in recs:
        if r.members and r.peer in r.members and len(set(r.members)) == len(r.members):
            groups.setdefault(r.members, set()).add(r.peer)
    best: tuple[str, ...] = ()
    for members, signers in groups.items():
        if len(signers) >= math.ceil(len(members) / 2) and len(signers) > len(best):
            best = tuple(sorted(signers))
    return best


def own_roster(records: list[Provider], me: str, step: int, params: str) -> tuple[str, ...]:
    """Rule J3: the group an earlier incarnation of `me` named in its provider record for the
    state (step, params) we resume, if we were in it; () otherwise. A restart re-attests what
    it committed: its first provider record used to name no group (a new process knows no
    roster), and replaced its attesting one, so once a state's committers had all restarted
    nobody attested it: no head, and nobody could adopt it (simulator seed 124021)."""
    for r in records:
        if r.peer == me and r.step == step and r.params == params and me in r.members:
            return r.members
    return ()
