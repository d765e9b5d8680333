"""Node identity: one Ed25519 key per node, its libp2p peer id, and signatures.

The same key is the libp2p host key (so the Noise handshake proves the peer id) and the
key that signs every record and contribution the node publishes, so "who sent this" and
"who signed this" can never disagree.

Peer ids are computed here without libp2p (identity multihash of the protobuf-encoded
public key, as the libp2p spec defines for Ed25519), so pure modules such as the DHT
record layer can verify them; tests check the result against libp2p's own `ID`.
"""

from __future__ import annotations

import functools

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

# protobuf PublicKey{Type: Ed25519 (1), Data: 32 bytes}, wrapped in an identity multihash
# (code 0x00, length 36): libp2p inlines keys this short into the peer id.
_PB_ED25519_PREFIX = b"\x08\x01\x12\x20"
_PEER_ID_PREFIX = b"\x00\x24" + _PB_ED25519_PREFIX
PEER_ID_LEN = len(_PEER_ID_PREFIX) + 32


class IdentityError(Exception):
    """A key file that cannot be used; never answered with a silent new identity."""


def peer_id_bytes_from_public(public: bytes) -> bytes:
    if len(public) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, not {len(public)}")
    return _PEER_ID_PREFIX + public


def public_from_peer_id_bytes(peer_id: bytes) -> bytes:
    """The Ed25519 public key inlined in a peer id (raises ValueError for other kinds)."""
    if len(peer_id) != PEER_ID_LEN or not peer_id.startswith(_PEER_ID_PREFIX):
        raise ValueError("not an Ed25519 libp2p peer id")
    return peer_id[len(_PEER_ID_PREFIX):]


@functools.lru_cache(maxsize=1 << 16)
def peer_id_to_str(peer_id: bytes) -> str:
    # cached: every record read names its writer this way, many times a second
    return base58.b58encode(peer_id).decode()


@functools.lru_cache(maxsize=1 << 16)
def peer_id_from_str(text: str) -> bytes:
    # cached (a failure raises and is not cached): rounds name members by string
    try:
        raw = base58.b58decode(text)
    except ValueError as exc:
        raise ValueError(f"not a base58 peer id: {text!r}") from exc
    public_from_peer_id_bytes(raw)
    return raw


def verify(public: bytes, signature: bytes, message: bytes) -> bool:
    """True when `signature` is a valid Ed25519 signature of `message` by `public`."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
        return True
    except (InvalidSignature, ValueError):
        return False


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair with its derived libp2p peer id."""

    private: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "Identity":
        """Deterministic identity (tests, benches); never for real nodes."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def seed(self) -> bytes:
        return self.private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    @functools.cached_property
    def public(self) -> bytes:
        # cached (the key never changes): the DHT compares every contact with our id
        return self.private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @functools.cached_property
    def peer_id(self) -> bytes:
        return peer_id_bytes_from_public(self.public)

    @property
    def peer_id_str(self) -> str:
        return peer_id_to_str(self.peer_id)

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)


def load_or_create(path: Path) -> Identity:
    """Load the node key at `path`, creating it (mode 0600) only if it does not exist.

    A file that exists but is unreadable, corrupt, or readable by group/others is an
    error: replacing it would silently give the node a new peer id and orphan everything
    it signed before.
    """
    path = Path(path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        ident = Identity.generate()
        pem = ident.private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # O_EXCL: two processes racing to create the same key must not both win.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return load_or_create(path)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        return ident

    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(
            f"key file {path} is accessible by other users (mode {stat.S_IMODE(mode):o}); "
            f"run `chmod 600 {path}`"
        )
    data = path.read_bytes()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(
            f"key file {path} is not a readable Ed25519 PEM key ({exc.__class__.__name__}); "
            "restore it from a backup, or point --key at a new path to start a new identity"
        ) from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"key file {path} holds a {type(key).__name__}, not an Ed25519 key")
    return Identity(key)
