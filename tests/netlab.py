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
of our prefix whose pid is dead are removed on entry. Everything is removed in `finally`.
Only addresses inside these namespaces are ever dialed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field

PREFIX = "p2pt"
PUBLIC_NET = "10.77.0"


class LabUnavailable(Exception):
    """The machine cannot build the lab (not root, no `ip netns`, no nft); message says why."""


def _sh(*args: str, ns: str | None = None, check: bool = True, input: str | None = None) -> str:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, input=input)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    return out.stdout


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "NAT lab needs root (network namespaces)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"NAT lab needs `{tool}` (apt-get install iproute2 nftables)"
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        _sh("ip", "netns", "add", probe)
        _sh("nft", "list", "tables", ns=probe)
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot build the lab here"
        return f"network namespaces unavailable: {str(exc)[:200]}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return None


def _remove_stale() -> None:
    """Delete namespaces of our prefix left by a dead run (their pid no longer exists)."""
    for line in _sh("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("_")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


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
    name = lab.ns(role)
    _sh("ip", "netns", "add", name)
    lab.namespaces.append(name)
    _sh("ip", "link", "set", "lo", "up", ns=name)
    return name


def _veth(a_ns: str, a_if: str, b_ns: str, b_if: str) -> None:
    tmp_a, tmp_b = f"a{os.getpid() % 100000}{a_if}"[:15], f"b{os.getpid() % 100000}{b_if}"[:15]
    _sh("ip", "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
    _sh("ip", "link", "set", tmp_a, "netns", a_ns)
    _sh("ip", "link", "set", tmp_b, "netns", b_ns)
    _sh("ip", "link", "set", tmp_a, "name", a_if, ns=a_ns)
    _sh("ip", "link", "set", tmp_b, "name", b_if, ns=b_ns)
    _sh("ip", "link", "set", a_if, "up", ns=a_ns)
    _sh("ip", "link", "set", b_if, "up", ns=b_ns)


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


def _teardown(lab: Lab) -> list[str]:
    failed = []
    for name in reversed(lab.namespaces):
        # Deleting a namespace destroys its veth ends (and their peers) with it.
        out = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=20)
        if out.returncode != 0 and "No such file" not in out.stderr:
            failed.append(f"{name}: {out.stderr.strip()}")
    return failed


@contextlib.contextmanager
def nat_lab():
    """Build the lab, yield a `Lab`, and always remove every namespace it made.

    Raises LabUnavailable (with the reason) where namespaces cannot be built."""
    reason = unavailable_reason()
    if reason:
        raise LabUnavailable(reason)
    _remove_stale()
    lab = Lab(tag=f"{os.getpid()}_{os.urandom(2).hex()}")
    try:
        _build(lab)
        yield lab
    finally:
        failed = _teardown(lab)
        if failed:
            print("netlab: teardown problems:", "; ".join(failed))
