"""One process per state directory.

A workdir holds a peer's key and its checkpoints, so a process that finds one again is the
same peer resuming. Two processes on one at once would be one peer id twice in a run,
overwriting each other's checkpoints. `claim` holds an exclusive `flock` on `<dir>/lock` for
as long as the returned descriptor is open: the kernel drops it when the process ends, however
it ends, so a crashed peer never leaves a stale lock behind. The holder's pid is written in the
file only to name it in the error.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

MAX_SLOTS = 64


class WorkdirError(RuntimeError):
    """A workdir this process cannot hold: not writable, not lockable, or out of space."""

    def __init__(self, message: str, advice: str) -> None:
        super().__init__(message)
        self.advice = advice


class WorkdirInUse(WorkdirError):
    def __init__(self, path: Path, pid: int | None) -> None:
        self.path, self.pid = Path(path), pid
        who = f"process {pid}" if pid else "another process"
        super().__init__(f"{path} is in use by {who}: every peer on a machine needs its own workdir",
                         "stop that process, or use another workdir")


def claim(path: Path) -> int:
    """Lock `path` (created if missing) for this process; the lock's descriptor (close it to
    let go). WorkdirInUse when another process holds it; WorkdirError when `path` cannot be
    written (creating the lock file is the first write: a read-only workdir is refused here,
    not after the node started), locked, or holds no byte more (a full disk)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise WorkdirError(f"{path} is not writable ({exc.strerror})", "use a directory you can write to") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise WorkdirInUse(path, int(holder) if holder.isdigit() else None) from None
        raise WorkdirError(f"cannot lock {path}: {exc.strerror}", "use a directory on a local filesystem") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise WorkdirError(f"cannot write to {path}: {exc.strerror}", "free space there, or use another directory") from None
    return fd


def claim_slot(base: Path) -> tuple[Path, int]:
    """The first of `base/0`, `base/1`, ... that no running process holds, claimed: a rerun
    gets back the slot (key, checkpoints) its last run left, two processes at once get two."""
    for n in range(MAX_SLOTS):
        try:
            return Path(base) / str(n), claim(Path(base) / str(n))
        except WorkdirInUse:
            continue
    raise WorkdirInUse(base, None)
