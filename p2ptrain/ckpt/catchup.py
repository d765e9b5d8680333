"""Catching up to the run's head: find the best-attested checkpoint (`find`, through
`providers.choose`), download it (`p2ptrain.ckpt.download`), and adopt it (`adopt`): a
choice nobody serves, or whose bytes do not load, is passed over for the next best.

Split from `download.py`, which moves one chosen checkpoint's bytes: this module decides
which checkpoint, and how long a catch-up keeps trying.
"""

from __future__ import annotations

import hashlib
import logging

import trio

from p2ptrain.ckpt import checkpoint
from p2ptrain.ckpt import providers
from p2ptrain.ckpt.download import DownloadConfig, Resume, download
from p2ptrain.ckpt.fetch import FetchError
from p2ptrain.records import RunRecords
from p2ptrain.train import progress

log = logging.getLogger("p2ptrain.ckpt.catchup")


async def find(dht, run_id: str, genesis_sha256: str, min_step: int = 0,
               max_group: int = providers.MAX_MEMBERS, trusted: frozenset[str] = frozenset(),
               reject: frozenset[str] | set[str] = frozenset(),
               ignore: frozenset[str] | set[str] = frozenset()) -> providers.Choice | None:
    """The run's head (see `providers.choose`) at `min_step` or later, `ignore`'s records
    unread (our own: not a vote)."""
    recs = await RunRecords(dht, run_id).read_providers()
    return providers.choose(recs, genesis_sha256, min_step, max_group, trusted, reject, ignore)


async def own_roster(dht, run_id: str, step: int, params: str) -> set[str]:
    """Rule J3 (`providers.own_roster`): the group we named for this state before a restart."""
    recs = await RunRecords(dht, run_id).read_providers(step, params)
    return set(providers.own_roster(recs, dht.identity.peer_id_str, step, params))


async def fetch_checkpoint(node, run_id: str, spec, events, min_step: int = 0,
                           have_step: int = -1, config: DownloadConfig | None = None,
                           trusted: frozenset[str] = frozenset(),
                           reject: frozenset[str] | set[str] = frozenset(),
                           tries: int = 4, avoid: set[str] | None = None,
                           resume: Resume | None = None) -> tuple[int, bytes | None] | None:
    """Find and download the run's best-attested checkpoint at `min_step` or later.

    None when nothing acceptable is advertised yet; (step, None) when it is not newer than
    `have_step`; (step, bytes) otherwise. A choice no provider serves (Sybil records can
    advertise checkpoints nobody has) is passed over for the next best, up to `tries`
    choices; then FetchError (its `sha256`: the last choice that failed). `avoid`: donors
    found unresponsive (their dial failed), grown here and skipped by every later choice of
    the caller's catch-up: a donor that just left served no choice, and each new choice
    waited out its chunk timeouts again (a catch-up stalled 120 s that way). `resume`: what a
    cut-short download of the same checkpoint verified (`download.Resume`)."""
    # `spec`: the run's p2ptrain.run.spec.RunSpec (genesis anchor and bound, group size).
    skip = set(reject)
    avoid = set() if avoid is None else avoid
    failed: FetchError | None = None
    for _ in range(tries):
        choice = await find(node.dht, run_id, spec.genesis.sha256, min_step, spec.train.group_size,
                            trusted, skip, ignore={node.identity.peer_id_str})
        if choice is None:
            break
        if choice.step <= have_step:
            return choice.step, None

        def excluded(donor: str, reason: str) -> None:
            events.emit("donor_excluded", remote=donor, reason=reason)
            if reason.startswith("unresponsive"):
                avoid.add(donor)

        try:
            data, rep = await download(node.host, choice, config=config, exclude={node.identity.peer_id_str, *avoid},
                                       on_exclude=excluded, max_bytes=checkpoint.state_size_limit(spec.genesis.bytes),
                                       progress=progress.download(f"checkpoint of step {choice.step}",
                                                                  getattr(events, "json_mode", True)),
                                       resume=resume)
        except FetchError as exc:
            log.info("checkpoint of step %d (%s) not fetched, trying the next best: %s",
                     choice.step, choice.sha256[:16], exc)
            exc.sha256 = choice.sha256  # which choice failed: the caller may look elsewhere
            failed = exc
            skip.add(choice.sha256)
            continue
        events.emit("checkpoint_fetched", step=choice.step, params_sha256=choice.params,
                    attesters=len(choice.attesters), **rep.summary())
        return choice.step, data
    if failed is not None:
        raise failed
    return None


FORGIVE = 10.0
"""Seconds a catch-up keeps a checkpoint nobody served, or a donor that did not answer, out."""


async def adopt(node, run_id: str, spec, events, at_least: int, have_step: int, load, *,
                timeout: float = 120.0, patience: float | None = None, rejected: set[str] | None = None,
                trusted: frozenset[str] = frozenset(), resume: Resume | None = None) -> int | None:
    """Fetch and `load` (blocking, run in a thread) the best-attested checkpoint at `at_least`
    or later; the step adopted, or None (nothing newer, or `timeout`).

    A checkpoint can hash right (its attesters signed those bytes) and still not load --
    another model, hostile metadata. That is a bad donor set, not a reason to crash: its
    hash goes to `rejected` (never chosen again, see `providers.choose`) and the search goes
    on; so does one that no provider serves (Sybil records advertise checkpoints nobody has).
    `patience`: seconds to wait while nothing acceptable is advertised (a step that was only
    claimed, never attested, must not hold a peer for the whole `timeout`). `resume`: the
    caller's `download.Resume`, so a catch-up cut by its `timeout` leaves its verified chunks
    to the next catch-up of the same checkpoint."""
    rejected = set() if rejected is None else rejected
    give_up = trio.current_time() + (timeout if patience is None else patience)
    unserved: set[str] = set()
    avoid: set[str] = set()  # donors found unresponsive during this catch-up
    forgive_at = trio.current_time() + FORGIVE
    with trio.move_on_after(timeout):
        while True:
            if trio.current_time() >= forgive_at:
                # A partition heals: what nobody served may be served now (PROTOCOL H1; kept out
                # for the whole catch-up, a head found while cut off was never fetched: seed 74).
                unserved.clear(), avoid.clear()
                forgive_at = trio.current_time() + FORGIVE
            try:
                got = await fetch_checkpoint(node, run_id, spec, events, at_least, have_step,
                                             trusted=trusted, reject=rejected | unserved, avoid=avoid,
                                             resume=resume)
            except FetchError as exc:
                log.warning("catch-up fetch failed: %s", exc)
                if getattr(exc, "sha256", None):  # for this catch-up only: it may be transient
                    unserved.add(exc.sha256)
                got = None
            if got is not None:
                step, data = got
                if data is None:
                    return None
                try:
                    await trio.to_thread.run_sync(load, data)
                    return step
                except Exception as exc:  # any load failure: the bytes are bad, we are not
                    sha = await trio.to_thread.run_sync(lambda: hashlib.sha256(data).hexdigest())
                    rejected.add(sha)
                    log.warning("checkpoint of step %d (%s) does not load, rejected: %s", step, sha[:16], exc)
                    events.emit("checkpoint_rejected", step=step, sha256=sha, reason=str(exc)[:200])
                    continue
            elif trio.current_time() > give_up:
                return None
            await trio.sleep(0.5)
    return None
