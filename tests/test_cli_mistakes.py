"""The newcomer's path (issue 33): what the CLI answers to the mistakes a new user makes,
and how fast it answers `--help`. Real `p2ptrain` processes where the answer is a process's
(exit code, one line on stderr); no network beyond 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from p2ptrain.procs import run as run_cli

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "numba", "libp2p")
# This checkout's p2ptrain for children that run elsewhere (installed or not), and the demo's own children.
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def p2ptrain(*args: str, cwd: Path, timeout: float = 60, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    if kw:
        return subprocess.run([sys.executable, "-m", "p2ptrain", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=cwd, env={**ENV, **(env or {})}, **kw)
    return run_cli(list(args), timeout=timeout, cwd=cwd, env={**ENV, **(env or {})})


# -- `--help` imports nothing heavy (item 7) ----------------------------------------------------

_PROBE = """
import json, sys
sys.path.insert(0, {root!r})
from p2ptrain.cli.main import main
try:
    main({argv!r})
except SystemExit:
    pass
print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy!r})))
"""


@pytest.mark.parametrize("argv", [["--help"], ["join", "--help"], ["init", "--help"], ["demo", "--help"],
                                  ["status", "--help"], ["bootstrap", "--help"], ["bench", "--help"]])
def test_help_imports_neither_torch_numba_nor_libp2p(argv, tmp_path):
    """Measured wall time is in the report, not asserted (shared noisy cores): what makes
    `--help` slow is importing torch, numba or libp2p before parsing, and that is checked."""
    code = _PROBE.format(root=str(ROOT), argv=argv, heavy=set(HEAVY))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "usage: p2ptrain" in out.stdout
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_bench_still_gets_its_own_arguments(tmp_path):
    """The bench parsers fill in lazily; `bench NAME --help` still shows NAME's flags."""
    out = p2ptrain("bench", "dht", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--nodes" in out.stdout


def test_a_lazily_added_bench_option_left_out_takes_its_default():
    """The lazy bench parsers once left out the defaults of the options they added (argparse
    fills defaults in before the hook ran): `bench sim` without --no-faults died of
    "'Namespace' object has no attribute 'no_faults'"."""
    from p2ptrain.cli.main import build_parser

    args = build_parser().parse_args(["bench", "sim", "--peers", "3"])
    assert args.peers == 3 and args.no_faults is False and args.rtt == 0.1 and args.sybils == 0


# -- shared helpers ---------------------------------------------------------------------------

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _dead_bootstrap() -> str:
    from p2ptrain.identity import Identity

    return "/ip4/127.0.0.1/tcp/9/p2p/" + Identity.generate().peer_id_str  # nothing listens on port 9


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    """The answer to a user mistake: exit code 2 and exactly one line on stderr."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("p2ptrain: error: ") and lines[0].endswith(")"), lines[0]  # "(advice)"
    return lines[0]


def _read_line(stream, timeout: float) -> bytes:
    """One line from a child's stdout pipe, or b"" at EOF; TimeoutError after `timeout` s."""
    import selectors
    import time

    fd, buf = stream.fileno(), b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError(f"no line within {timeout}s (got {buf[:200]!r})")
            chunk = os.read(fd, 1)  # byte by byte: nothing past the line is taken from the pipe
            if not chunk:
                return buf
            buf += chunk
    return buf


def _pids_with(marker: str) -> list[int]:
    """Processes whose command line mentions `marker` (a test's own tmp path), ours excluded."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _reap(proc: subprocess.Popen, marker: str) -> None:
    """Stop a demo and whatever it started (only processes naming this test's tmp path)."""
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    for pid in _pids_with(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- one process per workdir (item 2) ----------------------------------------------------------

def test_workdir_lock_is_exclusive_names_its_holder_and_is_released(tmp_path):
    from p2ptrain.cli import workdir as wd
    from p2ptrain.cli.common import CLIError

    work = wd.prepare(tmp_path / "w")
    held = wd.lock(work)
    with pytest.raises(CLIError) as exc:  # flock is per open file: a second open conflicts in-process too
        wd.lock(work)
    assert f"in use by process {os.getpid()}" in str(exc.value) and exc.value.code == 2
    assert "--workdir" in exc.value.advice
    os.close(held)
    os.close(wd.lock(work))


@pytest.mark.integration
def test_second_join_on_a_workdir_in_use_exits_2_naming_the_holder(procs, tmp_path):
    import signal

    work, dead = tmp_path / "w", _dead_bootstrap()
    pypath = ENV["PYTHONPATH"]
    first = procs.start(["join", "--bootstrap", dead, "--listen", LOOPBACK, "--workdir", str(work), "--json"],
                        "first", env={"PYTHONPATH": pypath, "P2PTRAIN_NODE_BOOTSTRAP_TIMEOUT": "120"})
    first.wait_event(lambda e: e["event"] == "listening", 60)  # running: holds the workdir, retries the bootstrap
    quick = {"P2PTRAIN_NODE_BOOTSTRAP_TIMEOUT": "2"}
    r = p2ptrain("join", "--bootstrap", dead, "--listen", LOOPBACK, "--workdir", str(work), cwd=tmp_path, env=quick)
    line = _one_line_error(r)
    assert f"in use by process {first.proc.pid}" in line and "another --workdir" in line
    first.kill(signal.SIGKILL)  # no cleanup runs: the kernel releases the lock
    first.proc.wait(10)
    r = p2ptrain("join", "--bootstrap", dead, "--listen", LOOPBACK, "--workdir", str(work), cwd=tmp_path, env=quick)
    assert r.returncode == 2  # got past the lock this time, to the (dead) bootstrap
    assert r.stderr.strip().splitlines()[-1].startswith("p2ptrain: error: no bootstrap reachable")


# -- `demo --json` streams (item 3) and takes a relative workdir (item 4) ----------------------

@pytest.mark.integration
def test_demo_json_streams_events_and_stops_when_its_reader_goes(tmp_path):
    """`p2ptrain demo --json | head -n 1`: the first event within 20 s, and the demo (with
    every process it started) ends once nobody reads its output."""
    marker = str(tmp_path / "demo")
    with open(tmp_path / "demo.stderr", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "p2ptrain", "demo", "--json", "--no-dashboard",
                                 "--workdir", marker], stdout=subprocess.PIPE, stderr=err, cwd=tmp_path, env=ENV,
                                start_new_session=True)
    try:
        ev = json.loads(_read_line(proc.stdout, 20))
        assert ev["event"] and ev["peer"]
        proc.stdout.close()  # what `head -n 1` does after its line
        assert proc.wait(60) == 141, (tmp_path / "demo.stderr").read_text()[-2000:]
        assert "stdout was closed" in (tmp_path / "demo.stderr").read_text()
        assert _pids_with(marker) == []  # the bootstrap and the peers stopped with it
    finally:
        _reap(proc, marker)


@pytest.mark.integration
def test_demo_with_a_relative_workdir(tmp_path):
    """init, the bootstrap and the peers each run in another directory: a relative --workdir
    was looked up again below each (init wrote rel/path/rel/path/run)."""
    marker = str(tmp_path / "rel")
    with open(tmp_path / "demo.stderr", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "p2ptrain", "demo", "--json", "--no-dashboard", "--peers", "1",
                                 "--workdir", "rel/demo"], stdout=subprocess.PIPE, stderr=err, cwd=tmp_path, env=ENV,
                                start_new_session=True)
    try:
        seen = []
        while not seen or seen[-1]["event"] != "bootstrap_connected":  # peer0 read its manifest and started
            line = _read_line(proc.stdout, 120)
            assert line, f"demo ended first: {(tmp_path / 'demo.stderr').read_text()[-2000:]}"
            seen.append(json.loads(line))
        demo = tmp_path / "rel" / "demo"
        assert (demo / "run" / "run.toml").is_file() and (demo / "peer0" / "lock").is_file()
        assert not (demo / "rel").exists()
    finally:
        _reap(proc, marker)


# -- mistakes that exit 2 with advice (item 4) -------------------------------------------------

def test_a_file_given_as_workdir(tmp_path):
    (tmp_path / "afile").write_text("not a directory\n")
    for cmd in (["join", "--bootstrap", _dead_bootstrap(), "--listen", LOOPBACK], ["demo", "--no-dashboard"]):
        line = _one_line_error(p2ptrain(*cmd, "--workdir", "afile", cwd=tmp_path))
        assert "is a file, not a directory" in line and "pass a directory" in line


def _no_dac_override() -> None:
    """Root writes anywhere: drop CAP_DAC_OVERRIDE (from the bounding set, so the exec'd python
    lacks it) to make a 0555 directory read-only for a root test run too."""
    import ctypes

    if os.geteuid() == 0 and ctypes.CDLL(None, use_errno=True).prctl(24, 1, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_read_only_workdir(tmp_path):
    from p2ptrain.identity import load_or_create

    work = tmp_path / "ro"
    load_or_create(work / "node.key")  # a workdir used before: its key is readable, nothing else writable
    work.chmod(0o555)
    try:
        r = p2ptrain("join", "--bootstrap", _dead_bootstrap(), "--listen", LOOPBACK, "--workdir", str(work),
                     cwd=tmp_path, env={"P2PTRAIN_NODE_BOOTSTRAP_TIMEOUT": "2"}, preexec_fn=_no_dac_override)
    finally:
        work.chmod(0o755)
    line = _one_line_error(r)
    assert "is not writable" in line and "you can write to" in line


def test_a_directory_given_as_manifest(tmp_path):
    (tmp_path / "rundir").mkdir()
    (tmp_path / "rundir" / "run.toml").write_text("")
    r = p2ptrain("join", "--bootstrap", _dead_bootstrap(), "--listen", LOOPBACK, "--workdir", "w",
                 "--manifest", "rundir", cwd=tmp_path, env={"P2PTRAIN_NODE_BOOTSTRAP_TIMEOUT": "2"})
    line = _one_line_error(r)
    assert "rundir is a directory, not a manifest file" in line and "rundir/run.toml" in line


@pytest.mark.parametrize("rid", ["xyz", "ab" * 8, "g" * 64, "ab" * 33])
def test_a_malformed_run_id_is_refused_before_any_network_work(rid, tmp_path):
    """A typo used to cost a DHT lookup and the whole manifest wait (28-69 s). The check is
    structural: nothing started (no `listening` event); the time is a loose bound only."""
    import time

    for cmd in (["join", "--workdir", "w", "--run", rid], ["status", "--run", rid]):
        t0 = time.monotonic()
        r = p2ptrain(*cmd, "--bootstrap", _dead_bootstrap(), "--listen", LOOPBACK, "--json", cwd=tmp_path,
                     env={"P2PTRAIN_NODE_BOOTSTRAP_TIMEOUT": "30"})
        line = _one_line_error(r)
        assert "is not a run id" in line and "64 hex characters" in line
        assert r.stdout == ""
        assert time.monotonic() - t0 < 15


def test_uppercase_run_id_is_the_same_run():
    from p2ptrain.run.manifest import parse_run_id

    assert parse_run_id(" " + "AB" * 32 + "\n") == "ab" * 32


# -- a run nobody serves says what it waits for (item 4) ---------------------------------------

def test_waiting_for_a_manifest_says_what_it_waits_for(caplog):
    import logging

    from conftest import trio_test
    from p2ptrain.dht.node import DHTConfig, DHTNode
    from p2ptrain.dht.transport import MemoryNetwork
    from p2ptrain.identity import Identity
    from p2ptrain.net.node import NodeError
    from p2ptrain.run.runner import get_manifest

    @trio_test()
    async def body():
        net = MemoryNetwork()
        nodes = []
        for i in range(4):
            ident = Identity.from_seed(bytes([i + 1]) * 32)
            nodes.append(DHTNode(ident, net.transport(ident.peer_id), DHTConfig()))
        for node in nodes[1:]:
            assert await node.bootstrap([(nodes[0].identity.peer_id, [])]) == 1
        with pytest.raises(NodeError):
            await get_manifest(nodes[2], "ab" * 32, timeout=21)

    caplog.set_level(logging.INFO, logger="p2ptrain.run.runner")
    body()
    notes = [r.getMessage() for r in caplog.records if "waiting for run" in r.getMessage()]
    assert 3 <= len(notes) <= 4, notes  # every 5 s of the 21
    assert "abababababababab...'s manifest: no peer has published it yet" in notes[0]


# -- /dns4 bootstrap addresses (item 4) --------------------------------------------------------

@pytest.mark.integration
def test_a_dns4_bootstrap_is_resolved_and_dialled(procs, tmp_path):
    from conftest import start_bootstrap

    pypath = {"PYTHONPATH": ENV["PYTHONPATH"]}
    boot = procs.start(["bootstrap", "--listen", LOOPBACK, "--key", str(tmp_path / "b.key"), "--json"], "boot",
                       env=pypath)
    addr = boot.first_line(60).replace("/ip4/127.0.0.1/", "/dns4/localhost/")  # /etc/hosts: no DNS query leaves
    peer = procs.start(["join", "--bootstrap", addr, "--listen", LOOPBACK, "--workdir", str(tmp_path / "p"),
                        "--json"], "peer", env=pypath)
    ev = peer.wait_event(lambda e: e["event"] == "bootstrap_connected", 60)
    assert ev["addr"] == addr


def test_a_dnsaddr_bootstrap_is_refused_with_advice(tmp_path):
    from p2ptrain.identity import Identity

    r = p2ptrain("join", "--bootstrap", "/dnsaddr/localhost/p2p/" + Identity.generate().peer_id_str,
                 "--listen", LOOPBACK, "--workdir", "w", cwd=tmp_path)
    line = _one_line_error(r)
    assert "/dnsaddr/ addresses are not supported" in line and "/dns4/HOST/tcp/PORT" in line


# -- a checkpoint write that fails (item 8) ----------------------------------------------------

_FULL_DISK = """
import json, resource, signal, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from p2ptrain.events import EventSink
from p2ptrain.run.runner import make_writer

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit: EFBIG from write(), not a killed process
events = EventSink("me", False)
w = make_writer(Path({work!r}), "ab" * 32, events)
w.submit(1, b"1" * 1000)
assert w.flush(60)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
w.submit(2, b"2" * 100_000)  # the disk "fills" 4 KiB into this file
assert w.close(60)
print(json.dumps([e for e in events.history if e["event"].startswith("checkpoint_")]))
"""


def test_a_checkpoint_write_that_fails_is_reported_and_leaves_nothing_behind(tmp_path):
    """A real failed write(2) (RLIMIT_FSIZE in a child: EFBIG, as ENOSPC would be): the earlier
    checkpoint is intact, no .tmp is left, and a `checkpoint_failed` event says what a restart
    would resume from."""
    work = tmp_path / "w"
    out = subprocess.run([sys.executable, "-c", _FULL_DISK.format(root=str(ROOT), work=str(work))],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    events = json.loads(out.stdout.strip().splitlines()[-1])
    assert [e["event"] for e in events] == ["checkpoint_written", "checkpoint_failed"]
    failed = events[1]
    assert failed["step"] == 2 and failed["resume_from"] == 1 and "File too large" in failed["reason"]
    d = work / "checkpoints" / ("ab" * 8)
    assert sorted(p.name for p in d.iterdir()) == ["step-000001.p2ck"]  # no step 2, no temporary file
    assert (d / "step-000001.p2ck").read_bytes() == b"1" * 1000
    assert "a restart resumes from step 1" in out.stderr


# -- init says what to run next (item 6) -------------------------------------------------------

def test_init_says_what_to_run_next(tmp_path, capsys):
    from p2ptrain.cli.main import main

    out = tmp_path / "run"
    assert main(["init", "--out", str(out), "--key", str(tmp_path / "k"), "--inner-steps", "2"]) == 0
    got = capsys.readouterr()
    rid = got.out.strip()
    assert len(rid) == 64 and got.out == rid + "\n"  # stdout stays the run id alone, for RID=$(...)
    assert f"p2ptrain join --bootstrap MADDR --manifest {out / 'run.toml'}" in got.err
    assert f"p2ptrain join --bootstrap MADDR --run {rid}" in got.err
