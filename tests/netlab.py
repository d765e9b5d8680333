"""A NAT lab in Linux network namespaces: a public segment and three NATed sites.

    pub  (bridge namespace, 10.77.0.0/24)
     |-- boot    10.77.0.1    bootstrap / relay
     |-- open    10.77.0.2    a public peer
     |-- r1 wan  10.77.0.11   masquerade            -- h1 192.168.1.2
     |-- r2 wan  10.77.0.12   masquerade            -- h2 192.168.2.2
     `-- r3 wan  10.77.0.13   masquerade fully-random -- h3 192.168.3.2

Routers drop unsolicited inbound packets on their WAN side, as home routers do (a router
that answers with RST kills every simultaneous-open SYN; see FACTS.md "NAT traversal").
`fully-random` gives a symmetric-style mapping, so punching through r3 must fail.

Namespace names carry the pid, so a crashed earlier run cannot collide; stale namespaces
of our prefix whose pid is dead are removed on entry (plumbing shared with the emulated
internet: `p2ptrain/net/netns.py`). Everything is removed in `finally`.
Only addresses inside these namespaces are ever dialed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from p2ptrain.net import netns
from p2ptrain.net.netns import LabUnavailable, sh as _sh

__all__ = ["LabUnavailable", "nat_lab", "unavailable_reason", "Lab", "Site"]

PREFIX = "p2pt"
PUBLIC_NET = "10.77.0"


def unavailable_reason() -> str | None:
    return netns.unavailable_reason(PREFIX)


@dataclass
class Site:
    name: str
    router: str
    host: str
    wan_ip: str
    lan_ip: str
    fully_random: bool


@dataclass
class Lab:
    tag: str
    namespaces: list[str] = field(default_factory=list)
    sites: dict[str, Site] = field(default_factory=dict)

    def ns(self, role: str) -> str:
        return f"{PREFIX}{self.tag}-{role}"

    @property
    def boot_ns(self) -> str:
        return self.ns("boot")

    @property
    def open_ns(self) -> str:
        return self.ns("open")

    boot_ip = f"{PUBLIC_NET}.1"
    open_ip = f"{PUBLIC_NET}.2"

    def prefix(self, ns: str) -> list[str]:
        """Command prefix that runs a process inside namespace `ns`."""
        return ["ip", "netns", "exec", ns]

    def conntrack_summary(self, site: str) -> str:
        return _sh("nft", "list", "ruleset", ns=self.sites[site].router, check=False)


def _add_ns(lab: Lab, role: str) -> str:
    return netns.add_ns(lab.namespaces, lab.ns(role))


_veth = netns.veth


def _join_public(lab: Lab, ns: str, ifname: str, ip: str, port: str) -> None:
    pub = lab.ns("pub")
    _veth(ns, ifname, pub, port)
    _sh("ip", "link", "set", port, "master", "br0", ns=pub)
    _sh("ip", "addr", "add", f"{ip}/24", "dev", ifname, ns=ns)


_ROUTER_RULES = """
table ip nat {{
  chain post {{ type nat hook postrouting priority 100; oifname "wan" masquerade{random}; }}
}}
table inet fw {{
  chain input {{ type filter hook input priority 0; iifname "wan" ct state != {{ established, related }} drop; }}
  chain forward {{ type filter hook forward priority 0; iifname "wan" ct state != {{ established, related }} drop; }}
}}
"""


def _build(lab: Lab) -> None:
    pub = _add_ns(lab, "pub")
    _sh("ip", "link", "add", "br0", "type", "bridge", ns=pub)
    _sh("ip", "link", "set", "br0", "up", ns=pub)
    _join_public(lab, _add_ns(lab, "boot"), "eth0", lab.boot_ip, "pboot")
    _join_public(lab, _add_ns(lab, "open"), "eth0", lab.open_ip, "popen")
    for i, (site, fully_random) in enumerate((("s1", False), ("s2", False), ("s3", True)), start=1):
        router, host = _add_ns(lab, f"{site}r"), _add_ns(lab, f"{site}h")
        wan_ip, lan_ip = f"{PUBLIC_NET}.{10 + i}", f"192.168.{i}.2"
        _join_public(lab, router, "wan", wan_ip, f"p{site}")
        _veth(router, "lan", host, "eth0")
        _sh("ip", "addr", "add", f"192.168.{i}.1/24", "dev", "lan", ns=router)
        _sh("ip", "addr", "add", f"{lan_ip}/24", "dev", "eth0", ns=host)
        _sh("ip", "route", "add", "default", "via", f"192.168.{i}.1", ns=host)
        _sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=router)
        _sh("nft", "-f", "-", ns=router, input=_ROUTER_RULES.format(random=" fully-random" if fully_random else ""))
        lab.sites[site] = Site(site, router, host, wan_ip, lan_ip, fully_random)


@contextlib.contextmanager
def nat_lab():
    """Build the lab, yield a `Lab`, and always remove every namespace it made.

    Raises LabUnavailable (with the reason) where namespaces cannot be built."""
    reason = unavailable_reason()
    if reason:
        raise LabUnavailable(reason)
    with netns.session(PREFIX, lambda tag: Lab(tag=tag), _build, "netlab") as lab:
        yield lab
