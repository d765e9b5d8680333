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

A frame once begun must be whole within its budget (`FrameBudget`: a fixed allowance plus its
size at a minimum rate), counted over every partial read, never restarted by one: an honest
sender writes a frame in one go, so only the sender (or its path) can leave a frame half sent,
and the channel fails blaming it (`RingError.blame`). Silence before a frame's first byte blames
nobody: an honest sender may be waiting for its own predecessor (the per-operation timeout).
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


class FrameLate(RingError):
    """A frame begun but not whole within its budget (raised by an IO's bounded read)."""


@dataclass(frozen=True)
class FrameBudget:
    """How long a frame may take to arrive once its first byte is in: `allowance` seconds plus
    its size at `min_rate` bytes/s. Counted as the time the receiver spent waiting for its
    bytes (its own pauses, to compute or when starved of CPU, are not the sender's)."""

    allowance: float = 10.0
    min_rate: float = 125_000.0

    def __post_init__(self) -> None:
        if not (self.allowance > 0 and self.min_rate > 0):
            raise ValueError("a frame budget needs allowance > 0 and min_rate > 0")

    def seconds(self, nbytes: int) -> float:
        return self.allowance + nbytes / self.min_rate


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
        self.timeout = timeout
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            self._kernel_timeout(opt, timeout)

    def _kernel_timeout(self, opt: int, timeout: float) -> None:
        timeout = max(timeout, 0.001)  # 0 would mean "block forever"
        self.sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", int(timeout), int((timeout % 1) * 1e6)))

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

    def recv_some(self, view: memoryview) -> int:
        """What the kernel already holds, up to len(view) bytes, without blocking (0: none)."""
        if not len(view):
            return 0
        try:
            n = self.sock.recv_into(view, len(view), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise RingError(f"recv: {exc or type(exc).__name__}") from None
        if n == 0:
            raise RingError("peer closed the connection")
        return n

    def recv_wait(self, view: memoryview) -> int:
        """Wait up to the timeout for at least one byte, then take what is there (up to
        len(view)): one syscall, as a whole-frame read would."""
        try:
            n = self.sock.recv_into(view, len(view))
        except BlockingIOError:
            raise RingError("recv: timed out") from None
        except OSError as exc:
            raise RingError(f"recv: {exc or type(exc).__name__}") from None
        if n == 0:
            raise RingError("peer closed the connection")
        return n

    def recv_into(self, view: memoryview, limit: float | None = None) -> None:
        """All of `view`. Without `limit` each wait may last the timeout; with it, all of
        `view` must come within `limit` seconds however it trickles in (FrameLate)."""
        got, end, short = 0, None if limit is None else time.monotonic() + limit, False
        try:
            while got < len(view):
                if end is not None:
                    left = end - time.monotonic()
                    if left < self.timeout or short:
                        self._kernel_timeout(socket.SO_RCVTIMEO, min(left, self.timeout))
                        short = True
                try:
                    n = self.sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
                except BlockingIOError:
                    n = -1
                if n == 0:
                    raise RingError("peer closed the connection")
                got += max(n, 0)
                if end is not None and got < len(view) and (n < 0 or time.monotonic() >= end):
                    raise FrameLate(f"{got} of {len(view)} bytes in {limit:.1f}s")
                if n < 0:
                    raise RingError("recv: timed out")
        except OSError as exc:
            raise RingError(f"recv: {exc or type(exc).__name__}") from None
        finally:
            if short:
                try:
                    self._kernel_timeout(socket.SO_RCVTIMEO, self.timeout)
                except OSError:
                    pass  # closed meanwhile (an abort): the read's own outcome stands

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

    def __init__(self, io, key: bytes, tag: bytes, peer: str, max_bad_frames: int = 16,
                 budget: FrameBudget | None = None) -> None:
        self.io = io
        self.budget = budget or FrameBudget()
        self.aead = AESGCM(key)
        self.tag = tag
        self.peer = peer
        self.max_bad_frames = max_bad_frames
        self.stats = BulkStats()
        self._bad = 0
        self._sealed = bytearray()  # reused: sends on one channel are sequential
        self._body = bytearray()
        # The frame being received (frames arrive one at a time): its header and body so
        # far, so a `pull` can take part of it and a later `pull` or `recv` the rest.
        self._hdr = bytearray(HEADER.size)
        self._hgot = 0
        self._bview: memoryview | None = None
        self._bgot = 0
        self._waited = 0.0  # seconds spent waiting for the frame in progress since its first byte
        self._broken = ""  # framing lost: every later read fails with this

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

    def recv(self, fid: FrameId, out: memoryview) -> int:
        while True:
            while not self._fill(len(out), blocking=True):
                pass  # the first read of a frame may bring only part of its header
            got = self._open(fid, out)
            if got is not None:
                return got

    @property
    def pulls(self) -> bool:
        """Whether `pull` reads without blocking (a raw socket can; a libp2p stream cannot)."""
        return hasattr(self.io, "recv_some")

    def pull(self, fid: FrameId, out: memoryview) -> int | None:
        """`recv` without blocking: takes what the kernel already holds of the frame and
        returns its length once all of it is in (opened into `out`), else None; a later
        `pull` or `recv` goes on where this one stopped. A receiver that leaves bytes in the
        kernel instead (reading only whole frames) slows its sender: on a 1 Gbit/s lab link,
        20 ms of that cost 7 ms of link time, taking bytes as they came 0.1 ms (`p2ptrain
        bench readpause`). Where the transport cannot read without blocking (a libp2p
        stream, which cannot tell what it holds either), this is a plain `recv`."""
        if not self.pulls:
            return self.recv(fid, out)
        while self._fill(len(out), blocking=False):
            got = self._open(fid, out)
            if got is not None:
                return got
        return None

    def _fill(self, limit: int, blocking: bool) -> bool:
        """Read more of the frame in progress: its header, then its body; True once whole."""
        if self._broken:
            raise RingError(self._broken)
        if self._hgot < HEADER.size:
            hdr = memoryview(self._hdr)[self._hgot:]
            if self._hgot == 0:
                self._waited = 0.0
                # Waiting for a frame to begin is the per-operation timeout's, and blames
                # nobody; from its first byte on, the frame's budget runs.
                got = self.io.recv_wait(hdr) if blocking else self.io.recv_some(hdr)
            else:
                got = self._read(hdr, blocking, HEADER.size)
            self._hgot += got
            if self._hgot < HEADER.size:
                return False
            magic, version, _, _, _, _, length = HEADER.unpack(self._hdr)
            if magic != MAGIC or version != VERSION or length > min(MAX_FRAME, limit):
                # Framing itself is broken (or a frame longer than any this round sends):
                # nothing after this can be trusted, and nothing is allocated for it.
                self._broken = f"frame from {self.peer}: malformed header"
                raise RingError(self._broken)
            # One ciphertext buffer per channel, reused: frames arrive one at a time.
            if len(self._body) < length + TAG:
                self._body = bytearray(length + TAG)
            self._bview, self._bgot = memoryview(self._body)[: length + TAG], 0
        self._bgot += self._read(self._bview[self._bgot:], blocking, HEADER.size + len(self._bview))
        return self._bgot == len(self._bview)

    def _read(self, view: memoryview, blocking: bool, frame_bytes: int) -> int:
        """Into `view` (the rest of the frame's header or body): all of it when `blocking`,
        within what is left of the budget of a `frame_bytes` frame, else what is there."""
        if not blocking:
            return self.io.recv_some(view)
        budget = self.budget.seconds(frame_bytes)
        t0 = time.monotonic()
        try:
            self.io.recv_into(view, budget - self._waited)
        except FrameLate as exc:
            # Half a frame is in: framing is lost whatever comes next.
            reason = f"slow frame: not whole within {budget:.1f}s ({exc})"
            self._broken = f"frame from {self.peer}: {reason}"
            raise RingError(self._broken, blame=self.peer, reason=reason) from None
        finally:
            self._waited += time.monotonic() - t0
        return len(view)

    def _open(self, fid: FrameId, out: memoryview) -> int | None:
        """The whole frame in hand, checked and opened into `out`: its length, or None when
        it was dropped (not the frame expected, or its tag fails)."""
        hdr, body = bytes(self._hdr), self._bview
        self._hgot, self._bview = 0, None
        _, _, _, tag, step, chunk, length = HEADER.unpack(hdr)
        if hdr != self.header(fid, len(out)):
            reason = ("wrong-session" if tag != self.tag else
                      "unexpected-frame" if (step, chunk) != (fid.step, fid.chunk) else "wrong-length")
            self._reject(reason, fid, step, chunk)
            return None
        try:
            self.aead.decrypt_into(self._nonce(fid), body, hdr, out)
        except InvalidTag:
            self._reject("bad-tag", fid, step, chunk)
            return None
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
        # Only where the wrapped transport has it: a channel asks with hasattr (`pulls`; a
        # libp2p stream cannot read without blocking).
        if hasattr(io, "recv_some"):
            self.recv_some = io.recv_some

    def sendall(self, parts: list) -> None:
        size = sum(len(p) for p in parts)
        now = time.monotonic()
        if self.next_free > now:
            time.sleep(self.next_free - now)
        self.next_free = max(now, self.next_free) + size / self.rate
        self.io.sendall(parts)

    def recv_wait(self, view: memoryview) -> int:
        return self.io.recv_wait(view)

    def recv_into(self, view: memoryview, limit: float | None = None) -> None:
        self.io.recv_into(view, limit)

    def close(self, graceful: bool = False) -> None:
        self.io.close(graceful)


def new_secret() -> bytes:
    return os.urandom(32)
