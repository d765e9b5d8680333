"""Identity (key files, peer ids) and configuration precedence."""

from __future__ import annotations

import dataclasses
import os
import stat

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from p2ptrain.config import ConfigError, resolve
from p2ptrain.identity import Identity, IdentityError, load_or_create, peer_id_from_str, verify
from p2ptrain.net.node import NodeConfig


def test_peer_id_matches_libp2p():
    for i in range(5):
        ident = Identity.from_seed(bytes([i]) * 32)
        lib = ID.from_pubkey(create_new_key_pair(ident.seed).public_key)
        assert ident.peer_id == lib.to_bytes()
        assert ident.peer_id_str == lib.to_base58()
        assert peer_id_from_str(ident.peer_id_str) == ident.peer_id


def test_key_file_created_0600_and_reloaded(tmp_path):
    path = tmp_path / "sub" / "node.key"
    a = load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create(path).peer_id == a.peer_id
    sig = a.sign(b"msg")
    assert verify(a.public, sig, b"msg") and not verify(a.public, sig, b"other")


def test_bad_key_files_are_errors_not_new_identities(tmp_path):
    path = tmp_path / "node.key"
    load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create(path)
    os.chmod(path, 0o600)
    path.write_bytes(b"-----BEGIN PRIVATE KEY-----\ngarbage\n-----END PRIVATE KEY-----\n")
    with pytest.raises(IdentityError, match="not a readable Ed25519"):
        load_or_create(path)
    assert b"garbage" in path.read_bytes()  # never overwritten


@dataclasses.dataclass
class Demo:
    port: int = 1
    name: str = "d"
    addrs: list[str] = dataclasses.field(default_factory=list)
    flag: bool = False

    def __post_init__(self):
        if self.port < 0:
            raise ValueError("port must be >= 0")


def test_precedence_flags_env_toml_defaults():
    toml = {"demo": {"port": 3, "name": "toml", "flag": True}}
    env = {"P2PTRAIN_DEMO_PORT": "4", "P2PTRAIN_DEMO_ADDRS": "a, b"}
    assert resolve(Demo, {}, {}, "demo", {}) == Demo()
    assert resolve(Demo, {}, toml, "demo", {}) == Demo(3, "toml", [], True)
    assert resolve(Demo, {}, toml, "demo", env) == Demo(4, "toml", ["a", "b"], True)
    assert resolve(Demo, {"port": 5, "name": None}, toml, "demo", env) == Demo(5, "toml", ["a", "b"], True)


def test_config_errors_name_the_source():
    with pytest.raises(ConfigError, match="P2PTRAIN_DEMO_PORT"):
        resolve(Demo, {}, {}, "demo", {"P2PTRAIN_DEMO_PORT": "x"})
    with pytest.raises(ConfigError, match="port must be"):
        resolve(Demo, {"port": -1}, {}, "demo", {})
    with pytest.raises(ConfigError, match="unknown setting"):
        resolve(Demo, {}, {"demo": {"prot": 1}}, "demo", {})
    with pytest.raises(Exception, match="cannot parse multiaddr"):
        NodeConfig(bootstrap=["nope"])
