"""One process per state directory.

A workdir holds a peer's key and its checkpoints, so a process that finds one again is the
same peer resuming. Two processes on one at once would be one peer id twice in a run,
overwriting each other's checkpoints. `claim` holds an exclusive `flock` on `<dir>/lock` for
as long as the returned descriptor is open: the kernel drops it when the process ends, however
it ends, so a crashed peer never leaves a stale lock behind. The holder's pid is written in the
file only to name it in the error.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

MAX_SLOTS = 64


class WorkdirInUse(RuntimeError):
    def __init__(self, path: Path, pid: int | None) -> None:
        self.path, self.pid = Path(path), pid
        who = f"process {pid}" if pid else "another process"
        super().__init__(f"{path} is in use by {who}: every peer on a machine needs its own workdir")


def claim(path: Path) -> int:
    """Lock `path` (created if missing) for this process; the lock's descriptor (close it to
    let go). WorkdirInUse when another process holds it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise WorkdirInUse(path, int(holder) if holder.isdigit() else None) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
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
