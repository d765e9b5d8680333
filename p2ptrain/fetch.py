"""Content-addressed blobs between peers: manifests and checkpoints, fetched by hash.

A peer serves the blobs it holds (`/p2ptrain/fetch/1.0.0`, request {sha256}); a fetcher
names the hash it wants, enforces a size limit before reading, and checks the hash of what
arrived, so a provider can waste a fetcher's time but never feed it wrong bytes. Serving is
bounded (a few concurrent requests) so it never starves the node's own rounds.
"""

from __future__ import annotations

import hashlib
import logging

import msgpack
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2ptrain.dht.libp2p_rpc import read_exactly

log = logging.getLogger("p2ptrain.fetch")
PROTOCOL = TProtocol("/p2ptrain/fetch/1.0.0")
CHUNK = 1 << 20


class FetchError(Exception):
    pass


class BlobServer:
    def __init__(self, host, max_concurrent: int = 4) -> None:
        self.host = host
        self.blobs: dict[str, bytes] = {}
        self.limiter = trio.CapacityLimiter(max_concurrent)
        host.set_stream_handler(PROTOCOL, self._handle)

    def add(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return digest

    def remove(self, digest: str) -> None:
        self.blobs.pop(digest, None)

    async def _handle(self, stream) -> None:
        try:
            async with self.limiter:
                with trio.fail_after(60):
                    n = int.from_bytes(await read_exactly(stream, 2), "big")
                    if n > 256:
                        raise ValueError("request too large")
                    req = msgpack.unpackb(await read_exactly(stream, n), raw=False, max_str_len=128)
                    blob = self.blobs.get(req.get("sha256")) if isinstance(req, dict) else None
                    size = len(blob) if blob is not None else -1
                    await stream.write(size.to_bytes(8, "big", signed=True))
                    if blob is not None:
                        view = memoryview(blob)
                        for off in range(0, len(blob), CHUNK):
                            await stream.write(bytes(view[off:off + CHUNK]))
            await stream.close()
        except Exception as exc:
            log.info("fetch request from %s failed: %r", stream.muxed_conn.peer_id, exc)
            with trio.move_on_after(1):
                await stream.reset()


async def fetch(host, peer: bytes, digest: str, max_bytes: int, timeout: float, progress=None) -> bytes:
    """The blob with `digest` from `peer`, verified; raises FetchError.
    `progress(done, total)` is called as bytes arrive."""
    try:
        with trio.fail_after(timeout):
            stream = await host.new_stream(ID(peer), [PROTOCOL])
            req = msgpack.packb({"sha256": digest})
            await stream.write(len(req).to_bytes(2, "big") + req)
            size = int.from_bytes(await read_exactly(stream, 8), "big", signed=True)
            if size < 0:
                raise FetchError("provider does not have it")
            if size > max_bytes:
                raise FetchError(f"provider offers {size} bytes, over the limit {max_bytes}")
            data = await read_exactly(stream, size) if progress is None else \
                await _read_reporting(stream, size, progress)
            await stream.close()
    except FetchError:
        raise
    except (Exception, trio.TooSlowError) as exc:
        raise FetchError(f"{type(exc).__name__}: {exc}") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise FetchError("content does not match its hash")
    return data


async def _read_reporting(stream, size: int, progress, chunk: int = 1 << 20) -> bytes:
    buf = bytearray()
    progress(0, size)
    while len(buf) < size:
        buf += await read_exactly(stream, min(chunk, size - len(buf)))
        progress(len(buf), size)
    return bytes(buf)


async def fetch_any(host, providers: list[bytes], digest: str, max_bytes: int, timeout: float,
                    progress=None) -> bytes:
    """Try providers in turn until one delivers verified bytes."""
    errors = []
    for peer in providers:
        try:
            return await fetch(host, peer, digest, max_bytes, timeout, progress)
        except FetchError as exc:
            log.warning("fetch of %s from %s failed: %s", digest[:12], ID(peer), exc)
            errors.append(str(exc))
    raise FetchError(f"no provider delivered {digest[:12]}... ({'; '.join(errors) or 'no providers'})")
