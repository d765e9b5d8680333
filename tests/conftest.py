"""Shared test helpers: trio runner with a fake clock, and real-process helpers."""

from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path

import trio

# Every process a test starts runs this checkout's code, as the test itself does (pyproject's
# pytest `pythonpath`): children start in folders of their own, where an installed copy would
# win, and the installed package leaves out the lab drivers (p2ptrain.bench) tests start.
ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
# Every trainer a test starts evaluates each committed step on 2 validation batches, not the
# product's 8 (`TrainerConfig.eval_batches`; a flag still wins): the tests' runs train 2-6
# inner steps of 4 x 64 tokens, and 8 batches of 16 windows cost more CPU than the phase
# (a 3-peer test's peers: 9 s of CPU each with 8, 7 s with 2 and the DHT address cache, on
# 2 cores shared by 3-5 processes). Every peer of a run evaluates the same windows, so
# tests that compare val losses compare like with like.
os.environ.setdefault("P2PTRAIN_TRAINER_EVAL_BATCHES", "2")
import trio.testing


def trio_test(autojump: bool = True):
    """Run an async test under trio; with `autojump`, the clock jumps whenever all tasks
    sleep, so protocol timeouts and expiry take no real time."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            main = functools.partial(fn, *args, **kwargs)
            return run_autojump_with_threads(main) if autojump else trio.run(main)

        return wrapper

    return deco


def run_autojump_with_threads(main, *args):
    """`trio.run(main)` under an autojump clock that holds still while `trio.to_thread`
    workers run. trio counts a task that waits on a worker as blocked, so the plain autojump
    clock jumps to the next deadline (often a test's whole-run `fail_after`) while a worker
    still computes: a test that passed unloaded failed at random on a loaded 2-core CI
    machine. Every `trio.to_thread.run_sync` is counted, and autojump is off while any runs."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    real, busy = trio.to_thread.run_sync, [0]

    async def counted(fn, *a, **kw):
        busy[0] += 1
        clock.autojump_threshold = math.inf
        try:
            return await real(fn, *a, **kw)
        finally:
            busy[0] -= 1
            if not busy[0]:
                clock.autojump_threshold = 0

    trio.to_thread.run_sync = counted
    try:
        return trio.run(main, *args, clock=clock)
    finally:
        trio.to_thread.run_sync = real


import pytest  # noqa: E402

from p2ptrain.procs import ProcessGroup  # noqa: E402
from p2ptrain.procs import run as run_cli  # noqa: E402

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@pytest.fixture(scope="session", autouse=True)
def fork_servers(tmp_path_factory):
    """Node children start from two preloaded fork servers (p2ptrain.forkserver): a node's
    imports cost ~3 s of CPU, and ~200 of them were a third of the suite's. Two, taken in
    turn, so a test's peers still run with different hash seeds. P2PTRAIN_TEST_EXEC=1 execs
    every child instead; one that needs its own import-time environment or a netns prefix is
    exec'd anyway."""
    from p2ptrain.procs import use_fork_servers

    if os.environ.get("P2PTRAIN_TEST_EXEC") == "1" or not sys.platform.startswith("linux"):
        yield []
        return
    from p2ptrain.forkserver import ForkServer

    servers = [ForkServer(tmp_path_factory.mktemp("forkserver")) for _ in range(2)]
    use_fork_servers(servers)
    yield servers
    use_fork_servers([])
    for s in servers:
        s.close()


@pytest.fixture
def procs(tmp_path):
    """Real p2ptrain child processes, all reaped (SIGTERM, then SIGKILL) when the test ends."""
    with ProcessGroup(tmp_path / "procs") as group:
        yield group


def start_bootstrap(group: ProcessGroup, name: str = "bootstrap") -> tuple:
    boot = group.start(["bootstrap", "--listen", LOOPBACK, "--key", str(group.log_dir / f"{name}.key"),
                        "--json"], name)
    return boot, boot.first_line(60)


def start_peer(group: ProcessGroup, bootstrap: str, name: str, *extra: str, env: dict | None = None,
               workdir: str | None = None):
    """A `p2ptrain join` child; its workdir is `log_dir/<workdir or name>`, so a peer restarted
    under a new process name (its own logs) can keep its old workdir."""
    return group.start(["join", "--bootstrap", bootstrap, "--listen", LOOPBACK,
                        "--workdir", str(group.log_dir / (workdir or name)), "--json", *extra], name, env=env)


async def each_member(n: int, call, timeout: float = 60.0) -> list:
    """`await call(i)` for members 0..n-1 at once; each one's result, or the RoundFailed it
    raised (one member's failure is an outcome to check, not a test error)."""
    from p2ptrain.reduce.service import RoundFailed

    out: list = [None] * n

    async def one(i: int) -> None:
        try:
            out[i] = await call(i)
        except RoundFailed as exc:
            out[i] = exc

    with trio.fail_after(timeout):
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
    return out


async def service_cluster(nursery, classes, **cfg) -> tuple[list, list]:
    """Real libp2p nodes on 127.0.0.1, one all-reduce service of each class in `classes`
    (`p2ptrain.bench.loopback.service_cluster`, which the benches share)."""
    from p2ptrain.bench.loopback import service_cluster as cluster

    return await cluster(nursery, classes, **cfg)


def run_user_scripts(script, argvs: list[list[str]], cwd, timeout: float = 240) -> list[dict]:
    """Run `script` once per argv, all at once (a user's own training program per peer);
    each one's last stdout line as JSON, after checking it exited 0."""
    import json
    import os
    import subprocess
    import sys

    # HOME: the library's default workdirs (~/.p2ptrain/lib/...) land in the test's folder; in
    # the real home a second run of the test would resume the first one's checkpoints
    env = dict(os.environ, HOME=str(cwd))
    runs = [subprocess.Popen([sys.executable, str(script), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=cwd, env=env) for argv in argvs]
    outs = []
    for p in runs:
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            p.kill()
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


# -- measured figures, shown at the end of every run (CI logs included) -------------------
_MEASURED: list[str] = []


@pytest.fixture
def report(request):
    """`report(*args)`: print like print(), and repeat the line in the run's final summary,
    so what a test measured (relay bytes, step-time ratios, screenshot paths) is in the CI
    log even though pytest captures the output of passing tests. The line travels in the
    test's report (`user_properties`), so it would reach the summary from an xdist worker too."""

    def say(*args) -> None:
        line = " ".join(str(a) for a in args).strip()
        print(line)
        request.node.user_properties.append(("measured", f"{request.node.name}: {line}"))

    return say


def pytest_runtest_logreport(report):
    if report.when == "teardown":  # every phase's report carries the list: take it once
        _MEASURED.extend(v for k, v in report.user_properties if k == "measured")


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
            terminalreporter.write_line(line)


def init_run(d: Path, *extra: str, inner_steps: int = 4, join_window: float = 5.0, group_size: int = 4,
             seed: int = 3) -> tuple[Path, str]:
    """`p2ptrain init` of a tiny run (batch 4, sequences of 64) in `d/run`: (its folder, run id)."""

    out = run_cli(
        ["init", "--out", str(d / "run"), "--key", str(d / "initiator.key"),
         "--inner-steps", str(inner_steps), "--batch-size", "4", "--seq-len", "64", "--warmup", "5",
         "--planned-outer-steps", "1000", "--join-window", str(join_window), "--group-size", str(group_size),
         "--seed", str(seed), *extra], timeout=300, cwd=d)
    assert out.returncode == 0, out.stderr
    return d / "run", out.stdout.strip().splitlines()[-1]


def events_of(procs) -> list[dict]:
    """Every event the given children printed so far, in one list (a restarted peer's
    processes share its identity, so its lines read as one peer's)."""
    return [e for p in procs for e in list(p.all_events)]


def wait_until(procs, check, timeout: float, what: str, poll: float = 0.5):
    """Poll `check(events_of(procs))` until it returns something truthy (returned) or
    `timeout` seconds pass: then fail the test (`fail_with_lineages`)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        got = check(events_of(procs))
        if got:
            return got
        if time.monotonic() > deadline:
            fail_with_lineages(procs, f"{what}: not seen in {timeout:.0f}s")
        time.sleep(poll)


def fail_with_lineages(procs, what: str):
    """Fail the test with `what`, each peer's newest states, commits and skips
    (p2ptrain.bench.lineage.describe: how the run forked) and the stderr tail of any child
    that exited with an error."""
    from p2ptrain.bench.lineage import describe

    names = {p.all_events[0]["peer"]: p.name for p in procs if p.all_events}
    dead = [f"{p.name} exited {p.proc.returncode}: {p.stderr_tail(3)}" for p in procs
            if p.proc.poll() not in (0, None)]
    pytest.fail(f"{what}\n{describe(events_of(procs), names)}\n" + "\n".join(dead), pytrace=False)
