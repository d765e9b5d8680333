"""Content-addressed blobs between peers: manifests and checkpoints, fetched by hash.

A peer serves the blobs it holds (`/p2ptrain/fetch/1.0.0`, request {sha256}); `request`
names the hash it wants and enforces a size limit before reading. The caller checks the
hash of what arrived (`p2ptrain.ckpt.download` verifies every chunk and tells a lying donor from
a failing one), so a provider can waste a fetcher's time but never feed it wrong bytes.

Serving is bounded so it never starves the node's own rounds (hivemind's donors time out
newcomers, or their own averaging, when both compete): at most `max_concurrent` requests
at a time, and all of them together share a token bucket of `upload_mbps` (a bandwidth
share, like a home uplink). Bytes leave in 256 KiB slices, each paced by the bucket.

Nor can one requester take the slots from the rest (issue 32: one identity held all four
and an honest request's first byte came after its own timeout). A request is read before it
may wait for a slot (`request_timeout`: a trickled request holds none); slots are shared out
per identity, in turn, with bounded queues (`p2ptrain.ckpt.slots`); and a request holds its
slot only while its reader keeps up: the time our writes wait on it is bounded by
`slot_allowance` plus the blob's size at `slot_min_mbps` (the bucket's own pacing is ours
and does not count), past which the stream is reset with a logged reason.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass

import msgpack
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2ptrain.ckpt.slots import FairSlots, SlotConfig
from p2ptrain.dht.libp2p_rpc import read_exactly
from p2ptrain.identity import peer_id_from_str

log = logging.getLogger("p2ptrain.ckpt.fetch")
PROTOCOL = TProtocol("/p2ptrain/fetch/1.0.0")


SLICE = 256 << 10


MAX_REQUEST = 256


class FetchError(Exception):
    pass


class NotServed(FetchError):
    """The peer answered that it does not hold the blob (for a provider, whose record says
    it does: a record that does not match what it serves)."""


@dataclass
class ServeConfig:
    max_concurrent: int = 4
    """Blob/chunk requests served at once; more wait their turn."""
    upload_mbps: float = 25.0
    """Upload cap in MB/s shared by all requests served (0 = uncapped): the share of the
    uplink a peer gives newcomers; its own rounds keep the rest."""
    burst_mb: float = 4.0
    """Bytes (MB) the bucket may send at once after being idle."""
    chunk_kib: int = 4096
    """Checkpoints are served as chunks of this many KiB (p2ptrain.ckpt.chunks)."""
    per_peer: int = 2
    """Requests of one identity served at once (a downloader asks a donor for 2 at a time)."""
    per_peer_waiting: int = 4
    """Further requests of one identity that wait their turn; more are refused at once."""
    max_waiting: int = 64
    """Requests waiting for a slot, all identities together; more are refused at once."""
    request_timeout: float = 5.0
    """Seconds a requester has to send its (at most 258-byte) request, before any slot."""
    queue_timeout: float = 60.0
    """Seconds a request waits for its turn at most (a fetcher's own timeout is 60 s)."""
    slot_allowance: float = 10.0
    """Seconds our writes of one blob may wait on its reader, plus its size at `slot_min_mbps`:
    a slow reader gives its slot back."""
    slot_min_mbps: float = 1.0
    """The slowest (MB/s) a reader may take a blob, once the allowance is spent."""

    def __post_init__(self) -> None:
        if self.max_concurrent < 1 or self.upload_mbps < 0 or self.burst_mb <= 0:
            raise ValueError("max_concurrent must be >= 1, upload_mbps >= 0, burst_mb > 0")
        SlotConfig(self.max_concurrent, self.per_peer, self.per_peer_waiting, self.max_waiting)
        if not (self.request_timeout > 0 and self.queue_timeout > 0 and self.slot_allowance > 0
                and self.slot_min_mbps > 0):
            raise ValueError("request_timeout, queue_timeout, slot_allowance and slot_min_mbps must be > 0")
        if not 4 <= self.chunk_kib <= 65536:
            raise ValueError("chunk_kib must be in [4, 65536]")


class TokenBucket:
    """Paces bytes to `rate` bytes/s with a burst allowance; shared by all serving tasks."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.next_free = 0.0  # trio time at which the bucket is empty again

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = trio.current_time()
        start = max(now - self.burst / self.rate, self.next_free)
        self.next_free = start + n / self.rate
        if self.next_free > now:
            await trio.sleep(self.next_free - now)


def decode_request(body: bytes) -> str:
    """The hex digest a fetcher asks for (pure); raises FetchError for anything else."""
    if len(body) > MAX_REQUEST:
        raise FetchError("oversize request")
    try:
        req = msgpack.unpackb(body, raw=False, max_str_len=128, max_bin_len=0, max_array_len=4,
                              max_map_len=4, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise FetchError(f"malformed request: {type(exc).__name__}") from None
    digest = req.get("sha256") if isinstance(req, dict) else None
    if not isinstance(digest, str) or len(digest) != 64:
        raise FetchError("malformed request: no sha256")
    return digest


class BlobServer:
    def __init__(self, host, max_concurrent: int = 4, config: ServeConfig | None = None) -> None:
        self.host = host
        self.config = config or ServeConfig(max_concurrent=max_concurrent)
        self.blobs: dict[str, bytes | memoryview] = {}
        cfg = self.config
        self.slots = FairSlots(SlotConfig(cfg.max_concurrent, cfg.per_peer, cfg.per_peer_waiting, cfg.max_waiting))
        self.bucket = TokenBucket(self.config.upload_mbps * 1e6, self.config.burst_mb * 1e6)
        self.served_bytes = 0
        self.served_requests = 0
        self.chunk_digests: set[str] = set()  # owned by p2ptrain.ckpt.download.CheckpointServer
        host.set_stream_handler(PROTOCOL, self._handle)

    def add(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return digest

    def add_known(self, digest: str, data: bytes | memoryview) -> None:
        """Serve `data` under `digest` already computed by the caller (chunks)."""
        self.blobs[digest] = data

    def remove(self, digest: str) -> None:
        self.blobs.pop(digest, None)

    def view(self, blob: bytes | memoryview) -> memoryview:
        """The bytes served for `blob` (tests subclass this to serve corrupt ones)."""
        return memoryview(blob)

    async def _handle(self, stream) -> None:
        who = stream.muxed_conn.peer_id
        peer = who.to_bytes()
        try:
            with trio.fail_after(self.config.request_timeout):  # before any slot: a trickled request holds none
                n = int.from_bytes(await read_exactly(stream, 2), "big")
                if n > MAX_REQUEST:
                    raise FetchError("oversize request")
                digest = decode_request(await read_exactly(stream, n))
            if not await self._take_slot(peer):
                raise FetchError("busy: no serving slot for this requester")
            try:
                await self._serve(stream, self.blobs.get(digest))
            finally:
                self._release(peer)
            await stream.close()
        except Exception as exc:
            log.info("fetch request from %s failed: %r", who, exc)
            with trio.move_on_after(1):
                await stream.reset()

    async def _take_slot(self, peer) -> bool:
        """Until `peer`'s request holds a slot (True), or was refused or waited too long."""
        ticket = trio.Event()
        verdict = self.slots.ask(peer, ticket)
        if verdict is not False:
            return bool(verdict)
        granted = False
        try:
            with trio.move_on_after(self.config.queue_timeout):
                await ticket.wait()
                granted = True
        finally:
            if not granted and not self.slots.leave(peer, ticket):
                self._release(peer)  # granted as we gave up: hand it on
        return granted

    def _release(self, peer) -> None:
        for ticket in self.slots.release(peer):
            ticket.set()

    async def _serve(self, stream, blob) -> None:
        size = len(blob) if blob is not None else -1
        # Our writes wait on the reader only: past this budget it is too slow for its slot.
        budget = self.config.slot_allowance + max(size, 0) / (self.config.slot_min_mbps * 1e6)
        waited = 0.0

        async def write(data: bytes) -> None:
            nonlocal waited
            t0 = trio.current_time()
            try:
                with trio.fail_after(max(budget - waited, 0.001)):
                    await stream.write(data)
            except trio.TooSlowError:
                raise FetchError(f"slow reader: blob not taken within {budget:.1f}s") from None
            waited += trio.current_time() - t0

        await write(size.to_bytes(8, "big", signed=True))
        if blob is None:
            return
        self.served_requests += 1
        view = self.view(blob)
        for off in range(0, len(view), SLICE):
            piece = bytes(view[off:off + SLICE])
            await self.bucket.take(len(piece))
            await write(piece)
            self.served_bytes += len(piece)


async def request(host, peer: bytes, digest: str, max_bytes: int, timeout: float,
                  first_byte: float | None = None) -> bytes:
    """The bytes `peer` serves under `digest`, NOT verified (callers that need to tell a
    lying donor from a failing one verify themselves); raises FetchError (NotServed when
    the peer says it lacks it). `timeout` bounds the whole request; `first_byte`, if given,
    the time until the peer's answer starts (its size header), so a peer that accepts the
    stream and says nothing is given up on early. A request abandoned (cancelled) midway
    resets its stream, so the donor stops sending at once."""
    stream = None
    try:
        with trio.fail_after(timeout):
            with trio.move_on_after(math.inf if first_byte is None else first_byte) as first:
                stream = await host.new_stream(ID(peer), [PROTOCOL])
                req = msgpack.packb({"sha256": digest})
                await stream.write(len(req).to_bytes(2, "big") + req)
                head = await read_exactly(stream, 8)
            if first.cancelled_caught:
                raise FetchError(f"no answer within {first_byte:g}s")
            size = int.from_bytes(head, "big", signed=True)
            if size < 0:
                raise NotServed("provider does not have it")
            if size > max_bytes:
                raise FetchError(f"provider offers {size} bytes, over the limit {max_bytes}")
            data = await read_exactly(stream, size)
            await stream.close()
            stream = None
            return data
    except FetchError:
        raise
    except (Exception, trio.TooSlowError) as exc:
        raise FetchError(f"{type(exc).__name__}: {exc}") from None
    finally:
        if stream is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                try:
                    await stream.reset()
                except Exception:
                    pass


async def race(host, donors: list[str], digest: str, max_bytes: int, accept, *, width: int,
               first_byte: float, timeout: float) -> tuple[str | None, object, dict[str, str]]:
    """Ask `donors` (in this order, `width` at a time) for blob `digest`; the first answer
    `accept(bytes)` turns into a value wins and the requests still running are cancelled.
    Returns (winner, value, bad): `bad` names each donor whose record does not match what it
    serves, and why -- it said it lacks the blob, or served bytes `accept` refused (any
    exception). (None, None, bad) if nobody served it. A donor that did not start answering
    within `first_byte` seconds, or failed outright, is logged, not judged: it may be
    loaded, and a download's chunk phase copes with slow donors. Either way it held one
    slot for at most `first_byte` seconds, not the request's whole `timeout`, and the next
    donor starts as soon as a slot frees up."""
    slots = trio.Semaphore(width)
    won: list[tuple[str, object]] = []
    failed: dict[str, str] = {}

    async def one(donor: str, nursery: trio.Nursery, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with slots:
            task_status.started()
            try:
                raw = await request(host, peer_id_from_str(donor), digest, max_bytes, timeout, first_byte)
            except NotServed:
                failed[donor] = f"does not serve {digest[:12]}... that its record names"
                return
            except FetchError as exc:
                log.info("%s did not serve %s...: %s", donor, digest[:12], exc)
                return
            try:
                value = accept(raw)
            except Exception as exc:  # whatever `accept` refuses: the donor lied
                failed[donor] = f"served a {digest[:12]}... that does not verify: {exc}"
                return
            if not won:
                won.append((donor, value))
                nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for donor in donors:
            await nursery.start(one, donor, nursery)  # in order: a slot is free before the next
    if won:
        return won[0][0], won[0][1], failed
    return None, None, failed
