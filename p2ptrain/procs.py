"""Running p2ptrain nodes as child processes (demo, benches, integration tests).

Children get their own process group and are always reaped: SIGTERM, a bounded wait, then
SIGKILL, so a failing test or an interrupted demo never leaves nodes behind. On Linux each
child also asks the kernel for SIGTERM when its parent dies, so even a parent killed with
SIGKILL (which runs no cleanup) leaves no nodes behind.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: PR_SET_PDEATHSIG(SIGTERM). Best effort."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except Exception:  # not Linux: the parent's own reaping is all there is
        pass


_servers: list = []  # p2ptrain.forkserver.ForkServer, taken in turn (use_fork_servers)
_turn = [0]


def use_fork_servers(servers: list) -> None:
    """Start children from these fork servers (in turn) where they can; [] for plain exec."""
    _servers[:] = servers


def _next_server(env: dict, prefix: list[str] | None):
    live = [s for s in _servers if s.can_run(env, prefix)]
    if not live:
        return None
    _turn[0] += 1
    return live[_turn[0] % len(live)]


class NodeProcess:
    """A `p2ptrain ...` child whose stdout JSON events are collected by a reader thread."""

    def __init__(self, args: list[str], name: str, log_dir: Path, env: dict | None = None,
                 module: str = "p2ptrain", stdin: bool = False, prefix: list[str] | None = None,
                 on_event=None) -> None:
        self.name = name
        # Called with each event as its line arrives, in the reader thread (`demo --json`
        # forwards them live; collecting them all for the end held them back until exit).
        self.on_event = on_event
        self.stderr_path = Path(log_dir) / f"{name}.stderr"
        self.events: "queue.Queue[dict]" = queue.Queue()
        self.all_events: list[dict] = []
        self.lines: list[str] = []
        child_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self._stderr = open(self.stderr_path, "wb")
        stdin_spec = subprocess.PIPE if stdin else subprocess.DEVNULL
        server = _next_server(child_env, prefix)
        if server is not None:  # the same child, without the interpreter's imports (p2ptrain.forkserver)
            self.proc = server.spawn(module, args, str(log_dir), child_env, stdin_spec, subprocess.PIPE, self._stderr)
        else:
            self.proc = subprocess.Popen(
                [*(prefix or []), sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=self._stderr,
                stdin=stdin_spec, cwd=str(log_dir), env=child_env, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        # Kept on disk too: when a test fails, the whole event stream is there to read.
        with open(self.stderr_path.with_suffix(".stdout"), "w") as log:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                self._line(line)

    def _line(self, line: str) -> None:
        self.lines.append(line)
        if line.startswith("{"):
            try:
                ev = json.loads(line)
            except ValueError:
                return
            self.all_events.append(ev)
            self.events.put(ev)
            if self.on_event is not None:
                try:
                    self.on_event(ev)
                except Exception:  # the reader must go on draining the pipe, or the child blocks
                    self.on_event = None

    def send(self, obj: dict) -> None:
        """One JSON command line on the child's stdin (children started with stdin=True)."""
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def first_line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.lines:
                return self.lines[0]
            if self.proc.poll() is not None and not self.lines:
                break
            time.sleep(0.02)
        raise TimeoutError(f"{self.name} printed nothing in {timeout}s; stderr: {self.stderr_tail()}")

    def wait_event(self, pred, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: event not seen in {timeout}s; stderr: {self.stderr_tail()}")
            try:
                ev = self.events.get(timeout=min(left, 0.2))
            except queue.Empty:
                if self.proc.poll() is not None and self.events.empty():
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); stderr: {self.stderr_tail()}")
                continue
            if pred(ev):
                return ev

    def stderr_text(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def stderr_tail(self, n: int = 15) -> str:
        return "\n".join(self.stderr_text().splitlines()[-n:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the child's process group. SIGKILL also waits (up to 10 s) until the child
        is reaped: a killed process lets go of its descriptors (its workdir's lock) only once
        its exit completes, which takes a moment under load, and a restart on the same
        workdir right after the kill was refused as "in use" (a full test run, 2026-11-29)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            if sig == signal.SIGKILL:
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(5)
        self._reader.join(2)
        self._stderr.close()
        return self.proc.returncode


class ProcessGroup:
    """Context manager owning a set of NodeProcess children; reaps all of them on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[NodeProcess] = []

    def start(self, args: list[str], name: str, env: dict | None = None, module: str = "p2ptrain",
              stdin: bool = False, prefix: list[str] | None = None, on_event=None) -> NodeProcess:
        """`prefix` wraps the command, e.g. ["ip", "netns", "exec", ns] to run inside a namespace."""
        p = NodeProcess(args, name, self.log_dir, env, module, stdin, prefix, on_event)
        self.procs.append(p)
        return p

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.kill(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill(signal.SIGKILL)
        for p in self.procs:
            p.stop(5)


def run(args: list[str], timeout: float, cwd: str | Path | None = None, env: dict | None = None,
        module: str = "p2ptrain") -> subprocess.CompletedProcess:
    """`subprocess.run([python, "-m", module, *args], capture_output=True, text=True, ...)` for
    a command that runs to its end (`init`, `status`, a bench), started from a fork server
    where one is in use (`use_fork_servers`): each `init` the tests ran paid ~5 s of imports
    as a fresh interpreter. `env` is the whole environment, as subprocess takes it. On
    `timeout` the child is killed and `TimeoutExpired` raised."""
    child_env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    server = _next_server(child_env, None)
    if server is None:
        return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                              timeout=timeout, cwd=cwd, env=child_env)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = server.spawn(module, args, str(cwd or os.getcwd()), child_env, subprocess.DEVNULL, out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise subprocess.TimeoutExpired([module, *args], timeout) from None
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess([module, *args], code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))
