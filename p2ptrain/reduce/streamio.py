"""The two ways bulk frames travel besides the in-process tests: the libp2p stream itself
(the fallback when a peer's raw bulk port cannot be reached: relayed or NATed links), and the
raw TCP dial with its one-time routing token (the direct path). `p2ptrain.reduce.bulk` seals the
frames; these only move bytes.
"""

from __future__ import annotations

import socket

import trio

from p2ptrain.dht.libp2p_rpc import read_exactly
from p2ptrain.reduce.bulk import FrameLate
from p2ptrain.reduce.ring import RingError


class StreamIO:
    """Bulk frames over the libp2p stream itself (fallback path), driven from a worker
    thread: each call hops back into trio with `trio.from_thread.run`."""

    def __init__(self, stream, timeout: float) -> None:
        self.stream = stream
        self.timeout = timeout
        # The ring's pump threads are plain threads: they reach trio through its token.
        self.token = trio.lowlevel.current_trio_token()

    def sendall(self, parts: list) -> None:
        data = b"".join(bytes(p) for p in parts)
        try:
            trio.from_thread.run(self._write, data, trio_token=self.token)
        except Exception as exc:
            raise RingError(f"send: {exc!r}") from None

    async def _write(self, data: bytes) -> None:
        with trio.fail_after(self.timeout):
            await self.stream.write(data)

    def recv_wait(self, view: memoryview) -> int:
        """At least one byte within the timeout, and whatever else is there (up to len(view))."""
        try:
            data = trio.from_thread.run(self._read_some, len(view), trio_token=self.token)
        except Exception as exc:
            raise RingError(f"recv: {exc!r}") from None
        if not data:
            raise RingError("peer closed the connection")
        view[:len(data)] = data
        return len(data)

    async def _read_some(self, n: int) -> bytes:
        with trio.fail_after(self.timeout):
            return await self.stream.read(n)

    def recv_into(self, view: memoryview, limit: float | None = None) -> None:
        """All of `view` within the timeout, or within `limit` when given (FrameLate)."""
        try:
            data = trio.from_thread.run(self._read, len(view), limit, trio_token=self.token)
        except FrameLate:
            raise
        except Exception as exc:
            raise RingError(f"recv: {exc!r}") from None
        view[:] = data

    async def _read(self, n: int, limit: float | None) -> bytes:
        try:
            with trio.fail_after(self.timeout if limit is None else max(limit, 0.001)):
                return await read_exactly(self.stream, n)
        except trio.TooSlowError:
            if limit is None:
                raise
            raise FrameLate(f"{n} bytes not in within {limit:.1f}s") from None

    async def _close(self) -> None:
        with trio.move_on_after(self.timeout):
            await self.stream.close()

    def close(self, graceful: bool = False) -> None:
        # A reset may drop frames the peer has not read yet: only for aborted rounds.
        try:
            trio.from_thread.run(self._close if graceful else self.stream.reset, trio_token=self.token)
        except Exception:
            pass


def dial(host: str, port: int, token: bytes) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=3)
    sock.sendall(token)
    return sock
