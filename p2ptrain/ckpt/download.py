"""Checkpoints between peers: serving them as chunks, finding them, fetching from many donors.

Serving side (`CheckpointServer`): after each committed outer step a member splits its
checkpoint into chunks (`p2ptrain.ckpt.chunks`), serves them and the chunk manifest through its
`BlobServer` (bounded, rate-limited), drops the previous step's chunks, and stores its
signed provider record (`p2ptrain.records.RunRecords.publish_provider`).

Fetching side (`download`; which checkpoint, and the catch-up around it: `p2ptrain.ckpt.catchup`): a newcomer picks the newest checkpoint a quorum of its
group attests, gets the chunk manifest (verified against the attested hash) by racing the
providers (`fetch.race`: a few at a time, attesters first, in a random order, each with a short
first-byte deadline: copied provider records cost nothing, so their order must not decide
how long a fetch waits), then pulls chunks from every provider at once. Each donor has `per_donor` request slots; a free slot
takes the next missing chunk, and once none is left it steals a chunk that has been in
flight on another donor for over twice the typical chunk time (the first verified copy
wins and the other request is cancelled), so a slow or dead donor never stalls the
download, while donors of equal speed do not duplicate each other's work. A donor whose chunk fails verification is
excluded for the rest of the download, as is one that says it lacks a chunk its manifest
names (it moved on, or lies: having answered, it is no "unresponsive" donor that a catch-up's
next choices avoid); one that fails `max_failures` requests is dropped.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import trio

from p2ptrain import entropy
from p2ptrain.ckpt import chunks
from p2ptrain.ckpt import providers
from p2ptrain.ckpt.fetch import BlobServer, FetchError, NotServed, race, request
from p2ptrain.identity import peer_id_from_str
from p2ptrain.records import RunRecords
from p2ptrain.records.board import PROVIDER_TTL

log = logging.getLogger("p2ptrain.ckpt.download")


@dataclass
class DownloadConfig:
    per_donor: int = 2
    """Chunk requests in flight per donor (hides per-request latency)."""
    chunk_timeout: float = 60.0
    """Seconds one chunk request may take before the donor is counted as failing."""
    max_failures: int = 3
    """Failed (not wrong) requests after which a donor is dropped for this download."""
    first_byte_timeout: float = 10.0
    """Seconds a provider may take to start answering a manifest request (`fetch.race`)
    before the next provider is asked in its place."""
    race_width: int = 4
    """Providers asked for the manifest at once."""

    def __post_init__(self) -> None:
        if min(self.per_donor, self.max_failures, self.race_width) < 1 or min(self.chunk_timeout,
                                                                               self.first_byte_timeout) <= 0:
            raise ValueError("per_donor, max_failures and race_width >= 1, chunk_timeout and first_byte_timeout > 0")


@dataclass
class DownloadReport:
    bytes: int = 0
    seconds: float = 0.0
    chunks: int = 0
    per_donor: dict[str, int] = field(default_factory=dict)   # verified chunks delivered
    excluded: dict[str, str] = field(default_factory=dict)    # donor -> reason
    stolen: int = 0                                           # duplicate (stealing) requests
    resumed: int = 0                                          # chunks a cut-short try had verified

    def summary(self) -> dict:
        return {"bytes": self.bytes, "seconds": round(self.seconds, 3), "chunks": self.chunks,
                "per_donor": self.per_donor, "excluded": self.excluded, "stolen": self.stolen,
                "resumed": self.resumed}


class CheckpointServer:
    """Serves the latest committed checkpoint as chunks and advertises it."""

    def __init__(self, blobs: BlobServer, chunk_bytes: int = chunks.CHUNK_BYTES, keep: int = 2) -> None:
        # The previous step's chunks stay served too (`keep`): a newcomer that chose it just
        # before we committed the next step can still finish its download.
        self.blobs, self.chunk_bytes, self.keep = blobs, chunk_bytes, keep
        self.served: list[set[str]] = []
        self.current: tuple[int, str] | None = None

    def serve(self, data: bytes) -> tuple[chunks.ChunkManifest, str]:
        """Split and serve `data` (blocking: hashing; call it in a thread)."""
        manifest, parts = chunks.split(data, self.chunk_bytes)
        digest = manifest.digest()
        new = {digest, *manifest.chunks}
        for h, part in zip(manifest.chunks, parts):
            self.blobs.add_known(h, part)
        self.blobs.add_known(digest, manifest.encode())
        self.served = [*self.served, new][-self.keep:]
        live = set().union(*self.served)
        for old in list(self.blobs.chunk_digests - live):
            self.blobs.remove(old)
        self.blobs.chunk_digests = live
        return manifest, digest

    async def publish(self, dht, run_id: str, data: bytes, step: int, params: str, members: list[str],
                      addrs: list[str], ttl: float = PROVIDER_TTL, blocking=None) -> chunks.ChunkManifest:
        """Serve `data` as chunks and advertise it; returns its chunk manifest (whose
        `sha256` is the whole checkpoint's hash). `blocking(fn, *args)` runs the chunking and
        hashing (default `trio.to_thread.run_sync`)."""
        manifest, digest = await (blocking or trio.to_thread.run_sync)(self.serve, data)
        board = RunRecords(dht, run_id)
        async with trio.open_nursery() as nursery:  # the run's key (the head) and the state's (a merge's fetch)
            for by_state in (False, True):
                nursery.start_soon(functools.partial(board.publish_provider, step, digest, manifest.sha256, params,
                                                     members, addrs, ttl, by_state=by_state))
        self.current = (step, digest)
        return manifest


class Resume:
    """The verified chunks of the last download that did not finish (cancelled at its
    budget, or every donor failed), for the next try of the same checkpoint: chunks are
    content-addressed and checked, so none is fetched twice. One checkpoint at a time, its
    buffer the one the download held anyway; a try of another checkpoint drops it."""

    def __init__(self) -> None:
        self.manifest: str | None = None
        self.asm: chunks.Assembler | None = None

    def take(self, manifest: str) -> chunks.Assembler | None:
        return self.asm if manifest == self.manifest else None

    def keep(self, manifest: str | None, asm: chunks.Assembler | None) -> None:
        self.manifest, self.asm = manifest, asm


async def download(host, choice: providers.Choice, *, max_bytes: int = 1 << 34,
                   config: DownloadConfig | None = None, exclude: set[str] | None = None,
                   on_exclude=None, progress=None, resume: Resume | None = None) -> tuple[bytes, DownloadReport]:
    """The checkpoint `choice` names, every chunk verified; raises FetchError.
    `progress(done_bytes, total_bytes)` is called as verified chunks arrive. With `resume`,
    the chunks a cut-short try of the same checkpoint verified are not fetched again."""
    config = config or DownloadConfig()
    t0 = time.perf_counter()
    donors = [p for p in choice.providers if p not in (exclude or set())]
    if not donors:
        raise FetchError("no providers")
    report = DownloadReport(per_donor={d: 0 for d in donors})
    attesting = set(choice.attesters)
    held = resume.take(choice.manifest) if resume is not None else None
    manifest = held.manifest if held is not None else None  # it hashed to choice.manifest then
    if manifest is None:
        rng = entropy.rng()
        order = sorted(donors, key=lambda d: (d not in attesting, rng.random()))
        _, manifest, bad = await race(host, order, choice.manifest, chunks.MAX_MANIFEST_BYTES,
                                      lambda raw: chunks.decode_manifest(raw, choice.manifest, max_bytes),
                                      width=config.race_width, first_byte=config.first_byte_timeout,
                                      timeout=config.chunk_timeout)
        for donor, reason in bad.items():
            _exclude(report, donor, reason, on_exclude)
    if manifest is None:
        raise FetchError(f"no provider served the chunk manifest {choice.manifest[:12]}...")
    if manifest.sha256 != choice.sha256:
        raise FetchError("chunk manifest names another checkpoint than the attested one")
    fetcher = _Download(host, manifest, [d for d in donors if d not in report.excluded], config, on_exclude,
                        progress, attesting, held)
    if resume is not None:
        resume.keep(choice.manifest, fetcher.asm)  # until this try finishes, whatever ends it
    fetcher.report.excluded.update(report.excluded)
    await fetcher.run()
    try:
        data = await trio.to_thread.run_sync(fetcher.asm.result)
    except chunks.ChunkError as exc:  # true chunks under a false whole hash: the attesters lied
        raise FetchError(f"{exc} (its chunks verified: the manifest lies)") from None
    finally:
        if resume is not None and fetcher.asm.done():
            resume.keep(None, None)  # held only while chunks are missing
    rep = fetcher.report
    rep.per_donor = {**{d: 0 for d in donors}, **rep.per_donor}  # excluded ones too: every donor asked
    rep.bytes, rep.chunks, rep.seconds = len(data), len(manifest.chunks), time.perf_counter() - t0
    return data, rep


def _exclude(report: DownloadReport, donor: str, reason: str, on_exclude) -> None:
    report.excluded[donor] = reason
    log.warning("donor %s excluded from this download: %s", donor, reason)
    if on_exclude is not None:
        on_exclude(donor, reason)


class _Download:
    def __init__(self, host, manifest: chunks.ChunkManifest, donors: list[str], config: DownloadConfig,
                 on_exclude, progress=None, attesters: set[str] = frozenset(),
                 asm: chunks.Assembler | None = None) -> None:
        self.host = host
        self.attesters = set(attesters) & set(donors)
        self.moved_on: set[str] = set()  # donors that said they no longer hold a chunk
        self.stop = trio.CancelScope()
        self.progress, self.manifest, self.donors, self.config = progress, manifest, donors, config
        self.on_exclude = on_exclude
        self.asm = asm or chunks.Assembler(manifest)
        self.done_bytes = sum(manifest.span(i)[1] - manifest.span(i)[0] for i in self.asm.have)
        self.pending: deque[int] = deque(self.asm.missing())
        self.inflight: dict[int, dict[str, trio.CancelScope]] = {}
        self.started: dict[int, float] = {}  # chunk -> when its first request started
        self.times: list[float] = []         # seconds of verified chunk requests
        self.failures: dict[str, int] = {}
        self.report = DownloadReport(per_donor={d: 0 for d in donors}, resumed=len(self.asm.have))
        self.changed = trio.Event()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def _exclude(self, donor: str, reason: str) -> None:
        if donor in self.report.excluded:
            return
        _exclude(self.report, donor, reason, self.on_exclude)
        for requesters in self.inflight.values():
            scope = requesters.get(donor)
            if scope is not None:
                scope.cancel()
        self._notify()

    def _next(self, donor: str) -> int | None:
        if not self.pending and not self.inflight:
            self.pending.extend(self.asm.missing())  # never lose a chunk, whatever the path
        while self.pending:
            i = self.pending.popleft()
            if i not in self.asm.have:
                return i
        # Endgame: help with the chunk in flight longest, once it is clearly late.
        now = trio.current_time()
        typical = sorted(self.times)[len(self.times) // 2] if self.times else 1.0
        late = [(self.started.get(i, now), i) for i, r in self.inflight.items()
                if donor not in r and i not in self.asm.have
                and now - self.started.get(i, now) > max(0.5, 2 * typical)]
        if late:
            self.report.stolen += 1
            return min(late)[1]
        return None

    async def run(self) -> None:
        with self.stop:
            async with trio.open_nursery() as nursery:
                for donor in self.donors:
                    for _ in range(self.config.per_donor):
                        nursery.start_soon(self._worker, donor)
        if self.stop.cancelled_caught:
            # Every member that signed it dropped it: they committed newer states (they keep
            # their last 2), so the catch-up wants the newest, not the slots of providers that
            # never answered (copied records: the red team's `provider`, 60 s a request).
            raise FetchError("its attesters no longer serve it: a newer state replaced it")
        if not self.asm.done():
            raise FetchError(f"{len(self.asm.missing())} chunks could not be fetched "
                             f"(donors excluded: {self.report.excluded})")

    async def _worker(self, donor: str) -> None:
        pid = peer_id_from_str(donor)
        while not self.asm.done() and donor not in self.report.excluded:
            i = self._next(donor)
            if i is None:
                with trio.move_on_after(0.25):
                    await self.changed.wait()
                continue
            scope = trio.CancelScope()
            self.inflight.setdefault(i, {})[donor] = scope
            t0 = trio.current_time()
            self.started.setdefault(i, t0)
            start, end = self.manifest.span(i)
            data, err = None, None
            with scope:
                try:
                    data = await request(self.host, pid, self.manifest.chunks[i], end - start,
                                         self.config.chunk_timeout)
                except NotServed:  # it answered: out of this download only (module doc)
                    err = "not served"
                except FetchError as exc:
                    err = str(exc)
            requesters = self.inflight.get(i, {})
            requesters.pop(donor, None)
            if data is not None:
                if i in self.asm.have:
                    pass  # a stolen duplicate that lost the race
                elif self.asm.put(i, data):
                    self.report.per_donor[donor] = self.report.per_donor.get(donor, 0) + 1
                    self.times.append(trio.current_time() - t0)
                    self.done_bytes += end - start
                    if self.progress is not None:
                        self.progress(self.done_bytes, self.manifest.size)
                    for other in requesters.values():
                        other.cancel()  # someone else's duplicate of a chunk we now have
                    self.inflight.pop(i, None)
                else:
                    self._exclude(donor, f"chunk {i} failed verification")
                    self._requeue(i)
            elif scope.cancelled_caught:
                self._requeue(i)  # our donor was excluded mid-request: the chunk is still needed
            elif err == "not served":
                self._requeue(i)
                self._exclude(donor, f"does not serve chunk {i} of {self.manifest.sha256[:12]}... it names")
                self.moved_on.add(donor)
                if self.attesters and self.attesters <= self.moved_on:
                    self.stop.cancel()
            else:
                self.failures[donor] = self.failures.get(donor, 0) + 1
                log.info("chunk %d from %s failed: %s", i, donor, err)
                self._requeue(i)
                if self.failures[donor] >= self.config.max_failures:
                    self._exclude(donor, f"unresponsive ({err})")
                else:
                    await trio.sleep(0.2)  # a transient failure (e.g. a stream refused under load)
            if not self.inflight.get(i):
                self.inflight.pop(i, None)
            self._notify()
        if not any(d not in self.report.excluded for d in self.donors) and not self.asm.done():
            self._notify()

    def _requeue(self, i: int) -> None:
        if i not in self.asm.have and not self.inflight.get(i) and i not in self.pending:
            self.started.pop(i, None)
            self.pending.appendleft(i)
