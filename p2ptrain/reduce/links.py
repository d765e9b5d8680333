"""Persistent direct bulk links: one raw TCP connection per (neighbour, direction), kept
between rounds so a round with a familiar neighbour opens without touching libp2p.

Why: opening a bulk session over libp2p (a new stream, multistream-select, a request and an
answer) cost 20-50 ms per round on this machine, a third of what the raw-socket ceiling
needs for a whole 64 MiB round. A link is made by that session once (`AllReduceService`),
keeps the session's secret, and later rounds open on it with one frame and no round trip:

    OPEN = header(kind OPEN, session tag, length 16) | salt (16 random bytes) | GCM tag (16)

The round's key is HKDF(secret, sender | receiver | session tag | salt) (`bulk.derive_key`),
and the OPEN frame is an empty plaintext sealed under it with header and salt as AAD: the
receiver derives the same key from the salt it read and the tag proves the sender holds the
secret. The random salt makes every round's key fresh even if a round id were ever reused,
so the (step, chunk) nonces never repeat under one key.

A link carries bytes one way only and is either idle (in its table) or owned by exactly one
round (taken out). A round that commits leaves both ends at a frame boundary (every frame
sent was received), so it hands its links back; any other ending closes them, and the peer
notices the closed socket before its next use. Nothing here imports trio: the service owns
the waiting.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from p2ptrain.reduce.bulk import HEADER, MAGIC, TAG, VERSION, SocketIO, derive_key

KIND_OPEN = 2
SALT = 16
OPEN_LEN = HEADER.size + SALT + TAG
_OPEN_NONCE = struct.pack(">III", 0x6F70656E, 0xFFFFFFFF, 0)  # data frames' nonces start 0x70327462


class LinkError(Exception):
    """An OPEN frame that does not open the expected round on this link."""


@dataclass(eq=False)
class Link:
    """One direction of a persistent raw connection to `peer` (raw peer id bytes)."""

    peer: bytes
    io: SocketIO
    secret: bytes
    rounds: int = field(default=0)

    @property
    def sock(self) -> socket.socket:
        return self.io.sock

    def alive(self) -> bool:
        """False when the other end closed or reset. Links carry nothing back, so a socket
        that is readable at all (EOF, RST or stray bytes) is unusable. select, not a
        MSG_DONTWAIT peek: CPython polls a socket with a timeout before any recv."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def close(self) -> None:
        self.io.close()


def seal_open(link: Link, me: bytes, tag: bytes) -> tuple[bytes, bytes]:
    """(OPEN frame, the round's key) for a round we send on `link`."""
    salt = os.urandom(SALT)
    key = derive_key(link.secret, me, link.peer, tag + salt)
    hdr = HEADER.pack(MAGIC, VERSION, KIND_OPEN, tag, 0xFFFFFFFF, 0, SALT)
    sealed = AESGCM(key).encrypt(_OPEN_NONCE, b"", hdr + salt)
    return hdr + salt + sealed, key


def check_open(link: Link, me: bytes, tag: bytes, frame: bytes) -> bytes:
    """The round's key if `frame` opens round `tag` from `link.peer`; LinkError otherwise."""
    if len(frame) != OPEN_LEN:
        raise LinkError(f"OPEN frame has {len(frame)} bytes")
    hdr, salt, sealed = frame[:HEADER.size], frame[HEADER.size:HEADER.size + SALT], frame[HEADER.size + SALT:]
    magic, version, kind, got_tag, step, chunk, length = HEADER.unpack(hdr)
    if magic != MAGIC or version != VERSION or kind != KIND_OPEN or length != SALT:
        raise LinkError("not an OPEN frame")
    if got_tag != tag:
        raise LinkError("OPEN for another round")
    key = derive_key(link.secret, link.peer, me, tag + salt)
    try:
        AESGCM(key).decrypt(_OPEN_NONCE, sealed, hdr + salt)
    except InvalidTag:
        raise LinkError("OPEN frame fails authentication") from None
    return key


class LinkTable:
    """Idle links by peer for one direction, bounded: the oldest is closed past `limit`."""

    def __init__(self, limit: int = 32) -> None:
        self.limit = limit
        self._idle: OrderedDict[bytes, Link] = OrderedDict()

    def take(self, peer: bytes) -> Link | None:
        return self._idle.pop(peer, None)

    def put(self, link: Link) -> None:
        old = self._idle.pop(link.peer, None)
        if old is not None and old is not link:
            old.close()
        self._idle[link.peer] = link
        while len(self._idle) > self.limit:
            self._idle.popitem(last=False)[1].close()

    def close_all(self) -> None:
        while self._idle:
            self._idle.popitem()[1].close()

    def __len__(self) -> int:
        return len(self._idle)
