"""Network-namespace plumbing shared by the labs (the emulated internet
`p2ptrain.bench.inetlab` and the NAT lab `tests/netlab.py`).

Every lab names its namespaces `<family><pid>_<rand>-<role>`, so a crashed earlier run cannot
collide with a live one and the namespaces of a dead run can be found and removed
(`remove_stale`). Only root can build namespaces: `unavailable_reason` says in one line why a
machine cannot (tests skip with it), and `LabUnavailable` carries it when a lab is asked for
anyway.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess


class LabUnavailable(Exception):
    """The machine cannot build the lab (not root, no `ip netns`, no nft/tc); message says why."""


def sh(*args: str, ns: str | None = None, check: bool = True, input: str | None = None) -> str:
    """Run one command (inside namespace `ns` when given); raise with its stderr on failure."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, input=input)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    return out.stdout


def _have(tool: str) -> bool:
    return shutil.which(tool) is not None or os.path.exists(f"/usr/sbin/{tool}") or os.path.exists(f"/sbin/{tool}")


def unavailable_reason(family: str, tools: tuple[str, ...] = ("ip", "nft"),
                       probe: tuple[str, ...] = ("nft", "list", "tables")) -> str | None:
    """None when a lab can be built here, else why not. `probe` runs inside a scratch namespace
    (a container may allow `ip netns add` yet refuse what the lab then needs)."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces)"
    for tool in tools:
        if not _have(tool):
            return f"the network lab needs `{tool}` (apt-get install iproute2 nftables)"
    name = f"{family}probe{os.getpid()}"
    try:
        sh("ip", "netns", "add", name)
        if probe:
            sh(*probe, ns=name)
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot build the lab here"
        return f"network namespaces unavailable: {str(exc)[:200]}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    return None


def list_namespaces() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list", check=False).splitlines() if line.strip()]


def remove_stale(family: str) -> list[str]:
    """Delete namespaces of `family` left by a dead run (their pid no longer exists)."""
    removed = []
    for name in list_namespaces():
        if not name.startswith(family):
            continue
        pid = name[len(family):].split("_")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
            removed.append(name)
    return removed


def add_ns(namespaces: list[str], name: str) -> str:
    """Create namespace `name` with its loopback up; record it in `namespaces` for teardown
    before anything else can fail."""
    sh("ip", "netns", "add", name)
    namespaces.append(name)
    sh("ip", "link", "set", "lo", "up", ns=name)
    return name


def veth(a_ns: str, a_if: str, b_ns: str, b_if: str) -> None:
    """A veth pair with end `a_if` in `a_ns` and `b_if` in `b_ns`, both up. The pair is born in
    the root namespace under pid-tagged names (so concurrent labs cannot clash there) and
    renamed once moved."""
    tag = f"{os.getpid() % 100000}{os.urandom(1).hex()}"
    tmp_a, tmp_b = f"a{tag}{a_if}"[:15], f"b{tag}{b_if}"[:15]
    sh("ip", "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
    try:
        sh("ip", "link", "set", tmp_a, "netns", a_ns)
        sh("ip", "link", "set", tmp_b, "netns", b_ns)
    except Exception:
        subprocess.run(["ip", "link", "del", tmp_a], capture_output=True, timeout=20)
        raise
    sh("ip", "link", "set", tmp_a, "name", a_if, ns=a_ns)
    sh("ip", "link", "set", tmp_b, "name", b_if, ns=b_ns)
    sh("ip", "link", "set", a_if, "up", ns=a_ns)
    sh("ip", "link", "set", b_if, "up", ns=b_ns)


def teardown(namespaces: list[str]) -> list[str]:
    """Delete every namespace (newest first); returns the problems, never raises."""
    failed = []
    for name in reversed(namespaces):
        # Deleting a namespace destroys its veth ends (and their peers) with it.
        try:
            out = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired:
            failed.append(f"{name}: timeout")
            continue
        if out.returncode != 0 and "No such file" not in out.stderr:
            failed.append(f"{name}: {out.stderr.strip()}")
    return failed


@contextlib.contextmanager
def session(family: str, make, build, name: str):
    """A lab's life: namespaces of `family` left by dead runs removed, `make(tag)` (the tag
    carries our pid) built with `build`, yielded, and torn down even when the body raises."""
    remove_stale(family)
    lab = make(f"{os.getpid()}_{os.urandom(2).hex()}")
    try:
        build(lab)
        yield lab
    finally:
        failed = teardown(lab.namespaces)
        if failed:
            print(f"{name}: teardown problems:", "; ".join(failed))
