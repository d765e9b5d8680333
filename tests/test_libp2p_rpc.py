"""`p2ptrain.dht.libp2p_rpc.Libp2pRpc`'s own address list: every DHT call a server makes
carries it, so it is rebuilt from the host at most once per `ADDRS_TTL`, and a change (a
new listen or observed address, a relay address NAT traversal adds) still shows."""

from __future__ import annotations

from p2ptrain.dht import libp2p_rpc


class _Host:
    def __init__(self) -> None:
        self.addrs = ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWself"]
        self.built = 0

    def get_id(self):
        return type("Id", (), {"to_bytes": lambda _: b"self"})()

    def get_addrs(self):
        self.built += 1
        return list(self.addrs)


def test_own_addresses_are_rebuilt_at_most_once_per_ttl_and_changes_show(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(libp2p_rpc.time, "monotonic", lambda: now[0])
    host = _Host()
    rpc = libp2p_rpc.Libp2pRpc(host)
    for _ in range(50):
        assert rpc.local_addrs() == ["/ip4/127.0.0.1/tcp/4001"]
    assert host.built == 1
    host.addrs.append("/ip4/10.0.0.2/tcp/4001/p2p/12D3KooWself")
    rpc.extra_addrs.append("/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWrelay/p2p-circuit")  # in place, at once
    assert rpc.local_addrs()[-1].endswith("/p2p-circuit") and len(rpc.local_addrs()) == 2
    now[0] += libp2p_rpc.ADDRS_TTL
    assert rpc.local_addrs() == ["/ip4/127.0.0.1/tcp/4001", "/ip4/10.0.0.2/tcp/4001",
                                 "/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWrelay/p2p-circuit"]
    assert host.built == 2
    rpc.local_addrs().clear()  # a caller's copy: the cache is not theirs to change
    assert len(rpc.local_addrs()) == 3
