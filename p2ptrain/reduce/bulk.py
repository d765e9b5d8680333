"""Bulk channels: large AES-GCM frames for all-reduce traffic, keyed over libp2p.

py-libp2p's Noise+Yamux stream tops out near 75-100 MB/s here, while a raw socket sealing
~1 MiB frames with AES-GCM reaches ~1,170 MB/s (FACTS.md). So bulk bytes take a raw TCP
connection when the peer's bulk port is reachable, and fall back to the libp2p stream (same
frames, same keys) when it is not (relayed or otherwise unreachable peers).

Trust comes from libp2p: the receiver picks a fresh 32-byte secret per session and sends it
over the Noise-encrypted stream, which authenticates both peer ids. Keys are
HKDF(secret, info = sender id | receiver id | session), one per direction, so a frame sealed
for one pair, round or direction opens nowhere else. The raw TCP connection presents a
one-time token only to be routed to its session; it proves nothing by itself, the AEAD tag
of every frame does.

Frame: 32-byte header (sent in clear, authenticated as AAD) + ciphertext + 16-byte tag.
  magic "P2" | version | kind | session tag (8) | step (u32) | chunk (u32) | length (u32) | pad
The nonce is (step, chunk): unique per key because each frame id is sent once per session.
A frame whose header is not the one expected next (another round, a replay, a stranger) or
whose tag fails is dropped with a logged reason; after `max_bad_frames` the channel fails.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import struct
import termios
import time
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2ptrain.reduce.ring import FrameId, RingError

log = logging.getLogger("p2ptrain.reduce.bulk")

HEADER = struct.Struct(">2sBB8sIIIxxxxxxxx")
assert HEADER.size == 32
MAGIC = b"P2"
VERSION = 1
KIND_DATA = 1
TAG = 16
MAX_FRAME = 64 << 20


def session_tag(run_id: str, round_id: str) -> bytes:
    return hashlib.sha256(f"{run_id}\0{round_id}".encode()).digest()[:8]


def derive_key(secret: bytes, sender: bytes, receiver: bytes, tag: bytes) -> bytes:
    info = b"p2ptrain-bulk-v1" + sender + receiver + tag
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=tag, info=info).derive(secret)


@dataclass
class BulkStats:
    frames: int = 0
    bytes: int = 0
    dropped: dict | None = None

    def drop(self, reason: str) -> None:
        self.dropped = self.dropped or {}
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


class SocketIO:
    """Blocking socket I/O with a per-operation timeout (so a dead peer cannot hang a round)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        for level, opt, val in ((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
                                (socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20),
                                (socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)):
            try:
                sock.setsockopt(level, opt, val)
            except OSError:
                pass  # not a TCP socket (tests), or the kernel caps it
        self.sock = sock
        self.set_timeout(timeout)

    def set_timeout(self, timeout: float) -> None:
        """The kernel enforces it (SO_RCVTIMEO / SO_SNDTIMEO) on a blocking socket. A Python
        socket timeout would make every recv a poll plus a recv on a non-blocking fd and rule
        out MSG_WAITALL: one syscall per ~64 KiB of a frame instead of one per frame."""
        self.sock.settimeout(None)
        tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6))
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, tv)

    def sendall(self, parts: list) -> None:
        # One sendmsg for header and body: with TCP_NODELAY two sendall calls would put the
        # 32-byte header in a segment of its own.
        views = [memoryview(p).cast("B") for p in parts]
        try:
            while views:
                n = self.sock.sendmsg(views)
                while views and n >= len(views[0]):
                    n -= len(views.pop(0))
                if views and n:
                    views[0] = views[0][n:]
        except BlockingIOError:
            raise RingError("send: timed out") from None
        except OSError as exc:
            raise RingError(f"send: {exc or type(exc).__name__}") from None

    def available(self) -> int:
        """Bytes the kernel holds for us to read (FIONREAD); a broken socket says "plenty",
        so the caller's read runs and reports the error."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
        except (OSError, ValueError):
            return 1 << 62

    def recv_into(self, view: memoryview) -> None:
        got = 0
        try:
            while got < len(view):
                n = self.sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
                if n == 0:
                    raise RingError("peer closed the connection")
                got += n
        except BlockingIOError:
            raise RingError("recv: timed out") from None
        except OSError as exc:
            raise RingError(f"recv: {exc or type(exc).__name__}") from None

    def close(self, graceful: bool = False) -> None:
        # Either way what we already sent is delivered before the FIN (links carry no
        # bytes back, so nothing unread turns the close into a reset).
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class FrameChannel:
    """One direction of a bulk session: implements `p2ptrain.reduce.ring.Channel`."""

    def __init__(self, io, key: bytes, tag: bytes, peer: str, max_bad_frames: int = 16) -> None:
        self.io = io
        self.aead = AESGCM(key)
        self.tag = tag
        self.peer = peer
        self.max_bad_frames = max_bad_frames
        self.stats = BulkStats()
        self._bad = 0
        self._sealed = bytearray()  # reused: sends on one channel are sequential
        self._body = bytearray()

    @staticmethod
    def _nonce(fid: FrameId) -> bytes:
        return struct.pack(">III", 0x70327462, fid.step, fid.chunk)

    def header(self, fid: FrameId, length: int) -> bytes:
        return HEADER.pack(MAGIC, VERSION, KIND_DATA, self.tag, fid.step, fid.chunk, length)

    def send(self, fid: FrameId, payload: memoryview) -> None:
        hdr = self.header(fid, len(payload))
        if len(self._sealed) < len(payload) + TAG:
            self._sealed = bytearray(len(payload) + TAG)
        sealed = memoryview(self._sealed)[: len(payload) + TAG]
        self.aead.encrypt_into(self._nonce(fid), payload, hdr, sealed)
        self.io.sendall([hdr, sealed])
        self.stats.frames += 1
        self.stats.bytes += len(hdr) + len(sealed)

    def buffered(self, nbytes: int) -> bool:
        """Whether a whole frame of `nbytes` payload is already in the kernel (a recv of it
        would not block); True where the transport cannot tell."""
        available = getattr(self.io, "available", None)
        return available is None or available() >= HEADER.size + nbytes + TAG

    def recv(self, fid: FrameId, out: memoryview) -> int:
        expected = self.header(fid, len(out))
        hdr = bytearray(HEADER.size)
        while True:
            self.io.recv_into(memoryview(hdr))
            magic, version, kind, tag, step, chunk, length = HEADER.unpack(hdr)
            if magic != MAGIC or version != VERSION or length > min(MAX_FRAME, len(out)):
                # Framing itself is broken (or a frame longer than any this round sends):
                # nothing after this can be trusted, and nothing is allocated for it.
                raise RingError(f"frame from {self.peer}: malformed header")
            # One ciphertext buffer per channel, reused: frames arrive one at a time.
            if len(self._body) < length + TAG:
                self._body = bytearray(length + TAG)
            body = memoryview(self._body)[: length + TAG]
            self.io.recv_into(body)
            if bytes(hdr) != expected:
                reason = ("wrong-session" if tag != self.tag else
                          "unexpected-frame" if (step, chunk) != (fid.step, fid.chunk) else "wrong-length")
                self._reject(reason, fid, step, chunk)
                continue
            try:
                self.aead.decrypt_into(self._nonce(fid), body, bytes(hdr), out)
            except InvalidTag:
                self._reject("bad-tag", fid, step, chunk)
                continue
            self.stats.frames += 1
            self.stats.bytes += len(hdr) + len(body)
            return length

    def _reject(self, reason: str, fid: FrameId, step: int, chunk: int) -> None:
        self._bad += 1
        self.stats.drop(reason)
        log.warning("bulk frame dropped: reason=%s from=%s got=(%d,%d) expected=(%d,%d)",
                    reason, self.peer, step, chunk, fid.step, fid.chunk)
        if self._bad > self.max_bad_frames:
            raise RingError(f"{self._bad} bad frames from {self.peer}")

    def close(self, graceful: bool = False) -> None:
        """graceful: after a committed round, whose last vote frame may still be in flight."""
        self.io.close(graceful)


class RateLimitedIO:
    """Wraps an IO object to cap its send rate (token bucket on whole frames)."""

    def __init__(self, io, mbps: float) -> None:
        self.io = io
        self.rate = mbps * 1e6
        self.next_free = 0.0

    def sendall(self, parts: list) -> None:
        size = sum(len(p) for p in parts)
        now = time.monotonic()
        if self.next_free > now:
            time.sleep(self.next_free - now)
        self.next_free = max(now, self.next_free) + size / self.rate
        self.io.sendall(parts)

    def recv_into(self, view: memoryview) -> None:
        self.io.recv_into(view)

    def available(self) -> int:
        return self.io.available()

    def close(self, graceful: bool = False) -> None:
        self.io.close(graceful)


def new_secret() -> bytes:
    return os.urandom(32)
