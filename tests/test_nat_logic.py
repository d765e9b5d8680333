"""Fast checks of the NAT pieces that need no network: config validation and the
connection kinds carried in presence records (hostile values are dropped)."""

from __future__ import annotations

import msgpack
import pytest

from p2ptrain.net.nat import NatConfig
from p2ptrain.net.presence import MAX_CONNS, decode_presence, encode_presence


def test_nat_config_rejects_nonsense():
    with pytest.raises(ValueError):
        NatConfig(reachability="maybe")
    with pytest.raises(ValueError):
        NatConfig(punch_dial_timeout=0)
    assert NatConfig().reachability == "auto"


def test_presence_carries_connection_kinds_capped():
    conns = {f"peer{i:03d}": "relayed" for i in range(100)}
    conns["peer000"] = "hole-punched"
    info = decode_presence(encode_presence(["/ip4/10.0.0.1/tcp/1"], "trainer", conns))
    assert len(info["conns"]) == MAX_CONNS
    assert info["conns"]["peer000"] == "hole-punched"
    assert decode_presence(encode_presence(["/ip4/10.0.0.1/tcp/1"], "peer"))["conns"] == {}


def test_presence_drops_hostile_connection_kinds():
    raw = msgpack.packb({"addrs": [], "role": "x", "conns": {"a": "direct", "b": "teleport", "c": 7}})
    assert decode_presence(raw)["conns"] == {"a": "direct"}
    too_many = msgpack.packb({"addrs": [], "conns": {str(i): "direct" for i in range(MAX_CONNS + 1)}})
    assert decode_presence(too_many) is None
    # A list where a map belongs is malformed, the record dropped (issue 32: no loose types);
    # an unknown kind inside the map is only left out (a newer peer may know more kinds).
    assert decode_presence(msgpack.packb({"addrs": [], "conns": ["direct"]})) is None
