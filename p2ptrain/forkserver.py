"""A preloaded fork server for child nodes (Linux): `python -m p2ptrain ...` without paying
for the interpreter's imports each time.

A node process spends ~3 s of CPU importing torch, libp2p and numba before it does anything;
the integration tests start about 200 of them, which on a 2-core machine was a third of the
suite's CPU. The server imports all of that once, runs nothing (no torch op, no thread, no
trio loop), and forks one child per request. A child is a real process of its own: its own
pid and session, its own sockets, environment, working directory, argv, stdio and signal
dispositions, reseeded random generators, and the exit status a plain `python -m` would give
(the server reports it; `ForkedPopen` is the client's Popen). What a fork does not give a
child is what the interpreter decides at start: the hash seed (one per server; clients run two
servers with different seeds and alternate, so the peers of a test still iterate sets in
different orders) and environment variables read at import (`ForkServer.can_run` sends those
to a plain exec instead).

Protocol, one connection per child: the client sends one JSON request with its stdin, stdout
and stderr descriptors (SCM_RIGHTS); the server answers `pid\\n` once forked, and `status\\n`
(Popen's returncode: -N for signal N) when it has reaped the child.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from p2ptrain import checkout_off_sys_path

# Read at interpreter start or at import by the preloaded modules: a child that needs its own
# value of one of these is exec'd as usual.
IMPORT_TIME_ENV = ("PYTHON", "P2PTRAIN_KERNELS", "P2PTRAIN_ROUND_TRACE", "P2PTRAIN_HOME", "NUMBA_", "OMP_", "MKL_", "TORCH_", "CUDA_", "LD_")
PRELOAD = ("torch", "numpy", "trio", "libp2p", "p2ptrain.cli.main", "p2ptrain.peer", "p2ptrain.train.trainer",
           "p2ptrain.cli.join", "p2ptrain.cli.bootstrap", "p2ptrain.cli.init", "p2ptrain.bootstrap",
           # What every child imported lazily on its own (`PYTHONPROFILEIMPORTTIME=1` on a demo
           # peer, 2026-11-29: ~4 s of its start under the profiler): torch's first optimizer
           # step and `nn.init` call import torch._dynamo, `join` always asks `ranks` whether it
           # runs under torchrun (torch.distributed), and the node's NAT service and the
           # bootstrap's server. None starts a thread; numba's JIT modules do, and stay out.
           "torch._dynamo", "p2ptrain.train.ranks", "p2ptrain.net.nat", "p2ptrain.bootstrap.server")
MAX_REQUEST = 1 << 20


def _import_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k != "PYTHONPATH"}


def _read_line(conn: socket.socket, buf: bytes, timeout: float | None) -> tuple[bytes, bool]:
    """Read from `conn` into `buf` until it holds a whole line or `timeout` passes: (buf,
    closed). `closed`: the server closed the connection first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in buf:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([conn], [], [], left)[0]:
            break
        chunk = conn.recv(64)
        if not chunk:
            return buf, True
        buf += chunk
    return buf, False


class ForkedPopen:
    """The client's handle on a forked child: the part of `subprocess.Popen` nodes use."""

    def __init__(self, conn: socket.socket, pid: int, stdin, stdout) -> None:
        self._conn, self._buf = conn, b""
        self.pid, self.stdin, self.stdout, self.returncode = pid, stdin, stdout, None
        self.args = ["<forked>"]

    def _read_status(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        self._buf, closed = _read_line(self._conn, self._buf, timeout)
        if closed:  # the server died: the child went with it (PR_SET_PDEATHSIG)
            self.returncode = -signal.SIGTERM
            return
        if b"\n" not in self._buf:
            return
        self.returncode = int(self._buf.split(b"\n", 1)[0])
        self._conn.close()

    def poll(self) -> int | None:
        self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One server process; `spawn` forks a child of it. Closed with the client (the server
    asks for SIGTERM when its parent dies, and its children for SIGTERM when it dies)."""

    def __init__(self, sock_dir: Path, preload: tuple[str, ...] = PRELOAD) -> None:
        self.path = str(Path(sock_dir) / f"forkserver-{secrets.token_hex(4)}.sock")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONHASHSEED=str(secrets.randbelow(2**32)))
        from p2ptrain.procs import _die_with_parent

        self.proc = subprocess.Popen([sys.executable, "-m", "p2ptrain.forkserver", self.path, *preload],
                                     env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        line = self.proc.stdout.readline()  # "ready" once every module is imported
        if line.strip() != b"ready":
            self.proc.kill()
            raise RuntimeError(f"fork server did not start: {line!r}")

    def can_run(self, env: dict, prefix: list[str] | None) -> bool:
        # The server's hash seed is its own; a child that names one is exec'd with it.
        mine = {k: v for k, v in _import_env(self.env).items() if k != "PYTHONHASHSEED"}
        return not prefix and self.proc.poll() is None and _import_env(env) == mine

    def spawn(self, module: str, args: list[str], cwd: str, env: dict, stdin, stdout, stderr) -> ForkedPopen:
        """Fork `python -m module *args`. stdin/stdout/stderr: `subprocess.PIPE`,
        `subprocess.DEVNULL` or an open file."""
        ours, theirs, close = [], [], []
        for spec, mode in ((stdin, "w"), (stdout, "r"), (stderr, "r")):
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                mine, child = (w, r) if mode == "w" else (r, w)
                ours.append(os.fdopen(mine, mode + "b", buffering=0 if mode == "w" else -1))
                theirs.append(child)
                close.append(child)
            elif spec in (subprocess.DEVNULL, None):
                fd = os.open(os.devnull, os.O_RDWR)
                ours.append(None)
                theirs.append(fd)
                close.append(fd)
            else:  # an open file of the caller's
                ours.append(None)
                theirs.append(spec.fileno())
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            req = json.dumps({"module": module, "args": list(args), "cwd": cwd, "env": env}).encode()
            socket.send_fds(conn, [len(req).to_bytes(4, "big") + req], theirs)
            buf, closed = _read_line(conn, b"", 30)
            if closed or b"\n" not in buf:
                raise RuntimeError("fork server " + ("closed the connection" if closed else "did not answer in 30 s"))
        except BaseException:
            conn.close()
            for f in ours:
                if f is not None:
                    f.close()
            raise
        finally:
            for fd in close:
                os.close(fd)
        pid_line, rest = buf.split(b"\n", 1)
        child = ForkedPopen(conn, int(pid_line), ours[0], ours[1])
        child._buf = rest
        return child

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.proc.stdout:
            self.proc.stdout.close()


# -- the server -------------------------------------------------------------------------


def _child(req: dict, fds: list[int]) -> None:
    """In the forked child: become `python -m module args` and never return."""
    code = 1
    try:
        os.setsid()
        from p2ptrain.procs import _die_with_parent

        _die_with_parent()
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        sys.path[0] = os.getcwd()  # what `python -m` puts first: a user's module beside it imports
        os.environ.clear()
        os.environ.update(req["env"])
        for p in reversed([p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]):
            if p not in sys.path:
                sys.path.insert(0, p)
        checkout_off_sys_path()  # the entries above may name it again
        import random

        import numpy as np
        import torch

        random.seed()
        np.random.seed()
        torch.seed()
        import runpy

        sys.argv = [req["module"], *req["args"]]
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        import threading

        threading._shutdown()  # what interpreter exit does: non-daemon threads, then atexit
        import atexit

        atexit._run_exitfuncs()
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        os._exit(code)


def serve(path: str, preload: list[str]) -> None:
    import importlib

    for name in preload:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}

    def stop(*_):
        for pid in children:
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    try:
        while True:
            if select.select([listener], [], [], 0.05)[0]:
                conn, _ = listener.accept()
                try:
                    conn.settimeout(10)
                    msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST + 4, 3)
                    size = int.from_bytes(msg[:4], "big")
                    while len(msg) < size + 4:
                        more = conn.recv(MAX_REQUEST)
                        if not more:
                            raise ValueError("short request")
                        msg += more
                    req = json.loads(msg[4:4 + size])
                    if len(fds) != 3:
                        raise ValueError(f"{len(fds)} descriptors, not 3")
                except (OSError, ValueError) as exc:
                    print(f"fork server: bad request dropped: {exc}", file=sys.stderr)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for c in children.values():
                        c.close()
                    conn.close()
                    _child(req, fds)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                children[pid] = conn
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    try:
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass
                    conn.close()
    finally:
        listener.close()
        try:
            os.unlink(path)
        except OSError:
            pass


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
