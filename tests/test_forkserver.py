"""The fork server (p2ptrain.forkserver) gives a child what `python -m` gives it: its own
pid and session, environment, working directory, argv, stdio, signals, exit status and random
draws; two servers iterate sets in different orders; and what it cannot give is exec'd."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

import fakes
from p2ptrain.forkserver import ForkedPopen, ForkServer
from p2ptrain.procs import ProcessGroup, use_fork_servers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux-only")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    made = [ForkServer(tmp_path_factory.mktemp("fs"), preload=("torch", "numpy", "p2ptrain.cli.main"))
            for _ in range(2)]
    yield made
    for s in made:
        s.close()


def probe(group, what: str, *args: str, env: dict | None = None, stdin: bool = False, name: str = "c"):
    p = group.start([what, *args], name, env=fakes.env({"FORKPROBE": name, **(env or {})}),
                    module="fakes.forkprobe", stdin=stdin)
    return p, json.loads(p.first_line(60))


def test_a_forked_child_is_its_own_process_with_its_own_inputs_and_exit_status(servers, fork_servers, tmp_path):
    session = fork_servers
    use_fork_servers(servers)
    try:
        with ProcessGroup(tmp_path / "g") as g:
            a, ra = probe(g, "exit", "3", name="a")
            b, rb = probe(g, "exit", "0", name="b")
            assert isinstance(a.proc, ForkedPopen) and isinstance(b.proc, ForkedPopen)
            assert a.proc.wait(30) == 3 and b.proc.wait(30) == 0
            assert ra["pid"] == a.proc.pid == ra["sid"] and ra["cwd"] == str(tmp_path / "g")
            assert (ra["var"], ra["argv"]) == ("a", ["exit", "3"]) and rb["var"] == "b"
            # taken in turn from two servers: different hash seeds; every generator reseeded
            assert ra["hash"] != rb["hash"]
            assert all(ra[k] != rb[k] for k in ("random", "np", "torch"))
            c, _ = probe(g, "echo", stdin=True, name="e")
            c.send({"x": 1})
            assert c.proc.wait(30) == 0 and c.lines[-1] == '{"X": 1}'
            d, _ = probe(g, "sleep", name="d")
            d.kill(signal.SIGINT)  # Ctrl-C is a KeyboardInterrupt, as in a fresh interpreter
            assert d.proc.wait(30) == 130 and d.lines[-1] == "interrupted"
            k, _ = probe(g, "sleep", name="k")
            k.kill(signal.SIGKILL)
            assert k.proc.wait(30) == -9
            r, _ = probe(g, "raise", name="r")
            assert r.proc.wait(30) == 1 and "RuntimeError: boom" in r.stderr_text()
            # `python -m` imports a module from the working directory (a user's script beside it)
            (tmp_path / "g" / "besideme.py").write_text("print('beside', flush=True)\n")
            m = g.start([], "m", module="besideme")
            assert m.proc.wait(30) == 0 and m.lines == ["beside"], m.stderr_tail()
            # an import-time variable needs a fresh interpreter: exec'd, as before
            x, _ = probe(g, "exit", "0", env={"P2PTRAIN_KERNELS": "numpy"}, name="x")
            assert isinstance(x.proc, subprocess.Popen) and x.proc.wait(60) == 0
    finally:
        use_fork_servers(session)


def test_children_die_with_their_server(fork_servers, tmp_path):
    session = fork_servers
    own = ForkServer(tmp_path, preload=("p2ptrain.cli.main",))
    use_fork_servers([own])
    try:
        with ProcessGroup(tmp_path / "g") as g:
            p, info = probe(g, "sleep")
            own.proc.kill()
            assert p.proc.wait(30) == -signal.SIGTERM  # the server's end: reported as a SIGTERM
            for _ in range(300):  # and the child really went (PR_SET_PDEATHSIG), reaped or not
                try:
                    if open(f"/proc/{info['pid']}/stat").read().split(") ")[1][0] in "ZX":
                        break
                except FileNotFoundError:
                    break
                time.sleep(0.1)
            else:
                pytest.fail("the child outlived its fork server")
    finally:
        use_fork_servers(session)
        own.close()
