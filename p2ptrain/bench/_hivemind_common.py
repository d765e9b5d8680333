"""Shared helpers for the hivemind comparison baselines (p2ptrain.bench.hivemind_*).

hivemind and py-libp2p cannot live in one Python process (both register the protobuf symbol
``crypto.pb.KeyType``), so every hivemind baseline runs as its own ``python -m`` process.
This module therefore imports only the standard library at import time; hivemind itself is
imported through :func:`import_hivemind`, and psutil (a hivemind dependency) lazily.
Never import libp2p or other p2ptrain modules from here.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import statistics
import sys
import threading
from typing import Any, Dict, Iterable, List, NoReturn, Optional, Sequence

INSTALL_HINT = "hivemind is not installed: pip install 'libp2p==0.8.1' 'hivemind==1.1.12'"

LOOPBACK_HOST_MADDRS = ["/ip4/127.0.0.1/tcp/0"]

# Keyword arguments for hivemind.DHT / hivemind.P2P.create that keep the p2pd daemon on loopback:
# listen on 127.0.0.1 only, and switch off everything that would probe or dial other addresses
# (UPnP / NAT-PMP port mapping, AutoNAT, circuit relays, IPFS bootstrap peers).
LOOPBACK_P2P_KWARGS: Dict[str, Any] = dict(
    host_maddrs=LOOPBACK_HOST_MADDRS,
    nat_port_map=False,
    auto_nat=False,
    use_relay=False,
    use_auto_relay=False,
    use_ipfs=False,
)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print a one-line error to stderr and exit with a non-zero code."""
    print(f"error: {message}".replace("\n", " "), file=sys.stderr, flush=True)
    sys.exit(code)


def import_hivemind(loglevel: str = "WARNING"):
    """Import hivemind (quietly) or exit with a one-line install hint."""
    # hivemind reads HIVEMIND_LOGLEVEL once, at import time; its p2pd log level follows it.
    os.environ.setdefault("HIVEMIND_LOGLEVEL", loglevel)
    try:
        import hivemind  # deliberately lazy
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "hivemind":
            fail(INSTALL_HINT, 2)
        fail(f"hivemind failed to import ({e}); {INSTALL_HINT}", 2)
    except Exception as e:  # e.g. a protobuf mismatch after a partial install
        fail(f"hivemind failed to import ({type(e).__name__}: {e}); {INSTALL_HINT}", 2)
    return hivemind


def summarize(samples_ms: Sequence[float]) -> Dict[str, Optional[float]]:
    """Median and p90 (inclusive linear interpolation) in ms, plus the sample count."""
    data = sorted(samples_ms)
    if not data:
        return {"median": None, "p90": None, "n": 0}
    if len(data) == 1:
        p90 = data[0]
    else:
        p90 = statistics.quantiles(data, n=10, method="inclusive")[8]
    return {"median": round(statistics.median(data), 3), "p90": round(p90, 3), "n": len(data)}


# ---------------------------------------------------------------------------------------------
# Child processes: loopback audit, cleanup, watchdog


def _descendants() -> List[Any]:
    try:
        import psutil
    except ImportError:
        return []
    try:
        return psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def _is_loopback(ip: str) -> bool:
    ip = ip.split("%", 1)[0]
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def audit_loopback(extra_pids: Iterable[int] = ()) -> Dict[str, Any]:
    """Inspect every inet socket of this process and its descendants (the hivemind DHT / averager
    processes and their Go p2pd daemons). Returns the number of processes and sockets seen and a
    list of sockets whose local or remote address is not loopback (wildcard listeners included).
    ``checked`` is False when psutil is unavailable."""
    try:
        import psutil
    except ImportError:
        return {"checked": False, "processes": 0, "sockets": 0, "non_loopback": []}
    procs = [psutil.Process(os.getpid())] + _descendants()
    for pid in extra_pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    seen, sockets, bad = set(), 0, []
    for proc in procs:
        if proc.pid in seen:
            continue
        seen.add(proc.pid)
        try:
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.Error:
            continue
        for c in conns:
            sockets += 1
            addrs = [c.laddr] + ([c.raddr] if c.raddr else [])
            if not all(_is_loopback(a.ip) for a in addrs):
                bad.append(
                    {
                        "pid": proc.pid,
                        "proc": name,
                        "laddr": f"{c.laddr.ip}:{c.laddr.port}",
                        "raddr": f"{c.raddr.ip}:{c.raddr.port}" if c.raddr else None,
                        "status": c.status,
                    }
                )
    return {"checked": True, "processes": len(seen), "sockets": sockets, "non_loopback": bad}


def maddrs_are_loopback(maddrs: Iterable[Any]) -> bool:
    """True if every multiaddr's /ip4 or /ip6 component is a loopback address."""
    for m in maddrs:
        parts = str(m).split("/")
        ips = [parts[i + 1] for i, p in enumerate(parts[:-1]) if p in ("ip4", "ip6")]
        if not ips or not all(_is_loopback(ip) for ip in ips):
            return False
    return True


# torch (imported by hivemind) starts this helper for tensor sharing; it exits by itself once its
# last client (this process) is gone, so shutdown checks leave it alone.
IGNORED_HELPERS = frozenset({"torch_shm_manager"})


def _is_ignored(proc) -> bool:
    try:
        return proc.name() in IGNORED_HELPERS
    except Exception:
        return False


def kill_descendants(sig: int = signal.SIGKILL, include_helpers: bool = False) -> int:
    """Send ``sig`` to every descendant of this process (our own children only). Returns count."""
    n = 0
    for proc in _descendants():
        if not include_helpers and _is_ignored(proc):
            continue
        try:
            proc.send_signal(sig)
            n += 1
        except Exception:
            pass
    return n


def remaining_descendants() -> int:
    alive = 0
    for proc in _descendants():
        if _is_ignored(proc):
            continue
        try:
            if proc.is_running() and proc.status() != "zombie":
                alive += 1
        except Exception:
            pass
    return alive


class Watchdog:
    """Bound the whole benchmark: after ``timeout`` seconds print a one-line error, SIGKILL our own
    descendants (hivemind processes and their p2pd daemons) and exit with code 3."""

    def __init__(self, timeout: float, what: str, on_timeout=None):
        self.timeout, self.what, self.on_timeout = timeout, what, on_timeout
        self._timer = threading.Timer(timeout, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        print(f"error: {self.what} exceeded the {self.timeout:.0f} s timeout", file=sys.stderr, flush=True)
        kill_descendants(signal.SIGKILL, include_helpers=True)
        if self.on_timeout is not None:  # e.g. remove a work directory
            try:
                self.on_timeout()
            except Exception:
                pass
        os._exit(3)

    def __enter__(self) -> "Watchdog":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


# ---------------------------------------------------------------------------------------------
# Memory sampling and benchmark data (used by hivemind_allreduce)


def tree_rss_bytes(pid: int) -> Optional[int]:
    """Resident set of process ``pid`` plus all its descendants (hivemind's DHT and averager
    processes, p2pd), summed; pages shared between them (e.g. the averaged tensors in shared
    memory) count once per process, as ``ps`` would show them. None if the process is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class PeakRssSampler:
    """Background thread sampling :func:`tree_rss_bytes` of some pids every ``interval`` seconds;
    ``peak_mib()`` gives the per-pid maxima in MiB (None where nothing was ever sampled)."""

    def __init__(self, pids: Sequence[int], interval: float = 0.2):
        self.pids, self.interval = list(pids), interval
        self.peak: Dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="rss-sampler")

    def add(self, pid: int) -> None:
        self.pids.append(pid)

    def sample(self) -> None:
        for pid in list(self.pids):
            rss = tree_rss_bytes(pid)
            if rss is not None and rss > self.peak.get(pid, 0):
                self.peak[pid] = rss

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "PeakRssSampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def peak_mib(self) -> List[Optional[float]]:
        return [round(self.peak[p] / 2**20, 1) if p in self.peak else None for p in self.pids]


def fill_gaussian(out, seed: int, rank: int):
    """Fill a float32 numpy array in place with peer ``rank``'s benchmark data: the same values as
    ``p2ptrain.bench.raw_ring.gaussian(seed, rank, out.size)``, without a temporary copy."""
    import numpy as np

    np.random.default_rng([seed, rank]).standard_normal(dtype=np.float32, out=out)
    return out


def merge_audits(audits: list) -> dict:
    """One loopback-audit summary over several audits (non-loopback sockets abort a run
    earlier, so a finished run reports 0)."""
    return {
        "checked": all(x["checked"] for x in audits) if audits else False,
        "processes": max((x["processes"] for x in audits), default=0),
        "sockets": max((x["sockets"] for x in audits), default=0),
        "non_loopback": 0,
    }
