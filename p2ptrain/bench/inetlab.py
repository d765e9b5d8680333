"""An emulated internet in Linux network namespaces: peers on access links of chosen rates.

    net (bridge namespace br0: the "internet" core, unshaped)
     |-- boot    10.78.0.1          bootstrap (unshaped unless boot_mbit is given)
     |-- peer 0  10.78.0.10         up/down shaped to rates_mbit[0]
     |-- peer 1  10.78.0.11         ...
     `-- peer i  10.78.0.(10+i)

API (stable; `p2ptrain bench allreduce --lab-mbit`, `bench utilization` and tests use it):

    from p2ptrain.bench.inetlab import internet_lab, unavailable_reason, LabUnavailable
    if (why := unavailable_reason()): skip(why)
    with internet_lab(rates_mbit=[100] * 4, boot=True) as lab:   # raises LabUnavailable
        lab.size                    # 4 peers
        lab.prefix(i)               # ["ip", "netns", "exec", NS]: argv prefix running in peer i
        lab.ip(i), lab.ns(i)        # "10.78.0.10", its namespace name
        lab.boot_prefix, lab.boot_ip, lab.boot_ns
        lab.rate_mbit(i)            # (up, down) Mbit/s, None = unshaped
        lab.link_stats(i)           # {"up": {"bytes", "packets", "drops"}, "down": {...}} from tc
        tcp_goodput(lab, 0, 1, 12_000_000)  # {"seconds", "mbit"}: one plain TCP transfer 0 -> 1
    # every namespace (and with it every veth and qdisc) is gone here, even after an exception

An entry of `rates_mbit` is a number (the same rate both ways), an `(up, down)` pair, or None
(unshaped: veth at memory speed). E.g. home links 50-100, datacenter 1000-10000.

Shaping. A peer's upload is a `tbf` on its own veth end (eth0) and its download a `tbf` on
the bridge-side end (the bridge transmits into the peer through it), so every flow A->B
crosses A's uplink shaper and B's downlink shaper; the core is unshaped, as an internet
whose bottlenecks are access links. Sizes (`_tbf_args`):
  - burst = max(128 KiB, 2 ms at the rate): veth carries GSO super-packets of up to 64 KiB
    and tbf must hold at least one of those in its bucket (else it segments or drops them);
    2 ms keeps the hrtimer-driven dequeue from starving the link at 1-10 Gbit/s. Over a
    1 s transfer at 100 Mbit/s the burst is ~1 % of the bytes, so throughput sits at the rate.
  - limit (queue) = max(burst + 128 KiB, 20 ms at the rate), i.e. at least two GSO packets
    wait beyond a full bucket. TCP keeps the link busy after a loss
    as long as the queue is >= ~0.4 x the path's bandwidth-delay product; with no added
    propagation delay that product is tiny, so 20 ms of queue is ample and is also the most
    queueing delay a full link adds (~21 ms at 50 Mbit/s, where the floor rules). tests/test_inetlab.py measures the resulting ratio.
Latency: this kernel has no netem (and no fq, so no EDT-timestamp delay either), so the lab
adds NO propagation latency; the only delay is the queueing a loaded shaper adds (<= 20 ms).
Results here are bandwidth-bound figures, not wide-area RTT figures.

Namespace names carry our pid (`p2pi<pid>_<rand>-<role>`); stale ones of dead pids are removed
on entry. Only addresses inside these namespaces are ever dialed.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from dataclasses import dataclass, field

from p2ptrain.net import netns
from p2ptrain.net.netns import LabUnavailable

__all__ = ["LabConfig", "InternetLab", "LabUnavailable", "internet_lab", "unavailable_reason",
           "bandwidth_bound_s", "tcp_goodput", "FAMILY", "NET"]

FAMILY = "p2pi"
NET = "10.78.0"
BOOT_HOST = 1
FIRST_PEER_HOST = 10
MAX_PEERS = 200

Rate = float | tuple[float | None, float | None] | None


def unavailable_reason() -> str | None:
    """None when the lab can be built here, else one line saying why not (tests skip with it)."""
    return netns.unavailable_reason(FAMILY, tools=("ip", "tc"), probe=("tc", "qdisc", "show"))


def _pair(r: Rate) -> tuple[float | None, float | None]:
    up, down = r if isinstance(r, tuple) else (r, r)
    for v in (up, down):
        if v is not None and not (0.01 <= float(v) <= 100_000):
            raise ValueError(f"link rate {v} Mbit/s out of range [0.01, 100000]")
    return (None if up is None else float(up), None if down is None else float(down))


@dataclass
class LabConfig:
    rates_mbit: list[Rate]
    boot: bool = True
    boot_mbit: Rate = None
    queue_ms: float = 20.0  # shaper queue, in milliseconds at the link rate (see module docstring)

    def __post_init__(self) -> None:
        if not 1 <= len(self.rates_mbit) <= MAX_PEERS:
            raise ValueError(f"rates_mbit: 1..{MAX_PEERS} peers, got {len(self.rates_mbit)}")
        self.rates_mbit = [_pair(r) for r in self.rates_mbit]
        self.boot_mbit = _pair(self.boot_mbit)
        if not 1.0 <= self.queue_ms <= 1000.0:
            raise ValueError("queue_ms must be within [1, 1000]")


def _tbf_args(mbit: float, queue_ms: float) -> list[str]:
    rate_bps = mbit * 1e6 / 8  # bytes per second
    burst = max(128 * 1024, int(rate_bps * 0.002))
    limit = max(burst + 128 * 1024, int(rate_bps * queue_ms / 1000))
    return ["rate", f"{mbit:g}mbit", "burst", str(burst), "limit", str(limit)]


def bandwidth_bound_s(payload_bytes: float, world: int, link_mbit: float) -> float:
    """The ring all-reduce lower bound: each member sends (and receives) 2(W-1)/W x payload
    through its access link."""
    return 2 * (world - 1) / world * payload_bytes * 8 / (link_mbit * 1e6)


@dataclass
class InternetLab:
    config: LabConfig
    tag: str
    namespaces: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.config.rates_mbit)

    def _ns(self, role: str) -> str:
        return f"{FAMILY}{self.tag}-{role}"

    @property
    def net_ns(self) -> str:
        return self._ns("net")

    def ns(self, i: int) -> str:
        self._check(i)
        return self._ns(f"p{i}")

    def ip(self, i: int) -> str:
        self._check(i)
        return f"{NET}.{FIRST_PEER_HOST + i}"

    def prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command inside peer i's namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    def rate_mbit(self, i: int) -> tuple[float | None, float | None]:
        self._check(i)
        return self.config.rates_mbit[i]

    @property
    def boot_ns(self) -> str:
        if not self.config.boot:
            raise LookupError("lab built with boot=False")
        return self._ns("boot")

    @property
    def boot_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.boot_ns]

    @property
    def boot_ip(self) -> str:
        return f"{NET}.{BOOT_HOST}"

    def link_stats(self, i: int) -> dict:
        """Bytes, packets and drops the shapers of peer i counted: "up" on its own veth end,
        "down" on the bridge port (zeros where a direction is unshaped)."""
        return {"up": _qdisc_stats(self.ns(i), "eth0"), "down": _qdisc_stats(self.net_ns, f"p{i}")}

    def _check(self, i: int) -> None:
        if not 0 <= i < self.size:
            raise IndexError(f"peer {i} not in lab of {self.size}")


def _qdisc_stats(ns: str, dev: str) -> dict:
    out = netns.sh("tc", "-s", "-j", "qdisc", "show", "dev", dev, ns=ns, check=False)
    try:
        for q in json.loads(out or "[]"):
            if q.get("kind") == "tbf":
                return {"bytes": q.get("bytes", 0), "packets": q.get("packets", 0), "drops": q.get("drops", 0)}
    except ValueError:
        pass
    return {"bytes": 0, "packets": 0, "drops": 0}


def _shape(ns: str, dev: str, mbit: float | None, queue_ms: float) -> None:
    if mbit is not None:
        netns.sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", *_tbf_args(mbit, queue_ms), ns=ns)


def _attach(lab: InternetLab, ns: str, port: str, ip: str, rate: tuple[float | None, float | None]) -> None:
    """Join `ns` to the core through a veth (eth0 inside, `port` on the bridge) and shape it."""
    netns.veth(ns, "eth0", lab.net_ns, port)
    netns.sh("ip", "link", "set", port, "master", "br0", ns=lab.net_ns)
    netns.sh("ip", "addr", "add", f"{ip}/24", "dev", "eth0", ns=ns)
    _shape(ns, "eth0", rate[0], lab.config.queue_ms)
    _shape(lab.net_ns, port, rate[1], lab.config.queue_ms)


def _build(lab: InternetLab) -> None:
    net = netns.add_ns(lab.namespaces, lab.net_ns)
    netns.sh("ip", "link", "add", "br0", "type", "bridge", ns=net)
    netns.sh("ip", "link", "set", "br0", "up", ns=net)
    if lab.config.boot:
        _attach(lab, netns.add_ns(lab.namespaces, lab.boot_ns), "pboot", lab.boot_ip, lab.config.boot_mbit)
    for i in range(lab.size):
        _attach(lab, netns.add_ns(lab.namespaces, lab.ns(i)), f"p{i}", lab.ip(i), lab.rate_mbit(i))


@contextlib.contextmanager
def internet_lab(rates_mbit: list[Rate], boot: bool = True, boot_mbit: Rate = None, queue_ms: float = 20.0):
    """Build the lab, yield an `InternetLab`, and always remove every namespace it made.

    Raises LabUnavailable (with the reason) where namespaces cannot be built."""
    config = LabConfig(list(rates_mbit), boot, boot_mbit, queue_ms)
    reason = unavailable_reason()
    if reason:
        raise LabUnavailable(reason)
    with netns.session(FAMILY, lambda tag: InternetLab(config, tag=tag), _build, "inetlab") as lab:
        yield lab


_RECV = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1); s.settimeout(60)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.settimeout(60); n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    t0 = t0 or time.monotonic()
    n += len(b)
print(n, time.monotonic() - (t0 or time.monotonic()), flush=True)
"""
_SEND = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
left, block = int(sys.argv[3]), b"x" * (1 << 20)
while left > 0:
    s.sendall(block[:min(left, len(block))]); left -= len(block)
s.close()
"""


def tcp_goodput(lab: InternetLab, src: int, dst: int, nbytes: int, timeout: float = 60.0) -> dict:
    """One plain TCP transfer of `nbytes` from peer src to peer dst (two processes in their
    namespaces); goodput timed at the receiver from its first byte to EOF."""
    recv = subprocess.Popen([*lab.prefix(dst), sys.executable, "-c", _RECV, lab.ip(dst)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = recv.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"tcp_goodput receiver failed: {recv.stderr.read()[-300:]}")
        subprocess.run([*lab.prefix(src), sys.executable, "-c", _SEND, lab.ip(dst), port, str(nbytes)],
                       check=True, timeout=timeout, capture_output=True)
        got, secs = recv.communicate(timeout=timeout)[0].split()
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(5)
    if int(got) != nbytes:
        raise RuntimeError(f"tcp_goodput: received {got} of {nbytes} bytes")
    secs = float(secs)
    return {"bytes": nbytes, "seconds": round(secs, 4), "mbit": round(nbytes * 8 / secs / 1e6, 1)}


TCP_COUNTERS = ("Tcp:RetransSegs", "TcpExt:TCPLossProbes", "TcpExt:TCPTimeouts", "TcpExt:TCPFastRetrans")
"""What `tcp_counters` reads: retransmissions, and which recovery sent them (a tail-loss
probe waits ~2 smoothed RTTs, an RTO at least 200 ms)."""


def tcp_counters(lab: InternetLab) -> dict[str, int]:
    """`TCP_COUNTERS` summed over the lab's peer namespaces (each has its own TCP stack): take
    one before and one after a measurement and subtract."""
    total, seen = dict.fromkeys(TCP_COUNTERS, 0), set()
    for i in range(lab.size):
        out = subprocess.run([*lab.prefix(i), "cat", "/proc/net/snmp", "/proc/net/netstat"],
                             capture_output=True, text=True, timeout=10).stdout.splitlines()
        for head, values in zip(out[::2], out[1::2]):  # "Prefix: names..." then "Prefix: values..."
            prefix = head.split(":", 1)[0]
            for name, value in zip(head.split()[1:], values.split()[1:]):
                key = f"{prefix}:{name}"
                if key in total and value.lstrip("-").isdigit():
                    total[key] += int(value)
                    seen.add(key)
    if seen != set(TCP_COUNTERS):
        raise RuntimeError(f"tcp_counters: the lab's namespaces report no {sorted(set(TCP_COUNTERS) - seen)}")
    return total
