"""A peer's state directory: made usable (or refused with advice), and held by one process.

The workdir holds the node's key, so two processes on one workdir would be one peer id
twice (issue 33): each would answer for the other's records and rounds. `join` takes an
exclusive `flock` on `<workdir>/lock` for its whole life and writes its pid there; a second
process is refused and told which pid holds it. The kernel drops the lock when the holder's
file is closed, so a crashed or SIGKILLed holder never leaves a stale lock behind (the pid
left in the file is only read while the lock is held by someone).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import IO

from p2ptrain.cli.common import CLIError

LOCK_NAME = "lock"


def prepare(path: str | Path, flag: str = "--workdir") -> Path:
    """`path` made absolute and created; CLIError with advice if it cannot be a directory.

    Absolute because the demo runs its children in other directories (a relative workdir
    would be looked up again below the child's own cwd)."""
    work = Path(path).expanduser().resolve()
    try:
        work.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CLIError(f"{flag} {work} is a file, not a directory",
                       f"pass a directory for {flag} (it is created if missing)") from None
    except OSError as exc:
        raise CLIError(f"cannot create {flag} {work}: {exc.strerror}",
                       f"pass a {flag} you can write to") from None
    return work


def lock(work: Path, flag: str = "--workdir") -> IO[str]:
    """Hold `work` for this process: the open lock file (keep it open; closing releases).

    CLIError if another process holds it (naming its pid), or if `work` is not writable:
    creating the lock file is the first write into it, so a read-only workdir is refused here
    and not after the node has started."""
    path = Path(work) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise CLIError(f"{flag} {work} is not writable ({exc.strerror})",
                       f"pass a {flag} you can write to") from None
    f = os.fdopen(fd, "r+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder(f)
        f.close()
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise CLIError(f"cannot lock {flag} {work}: {exc.strerror}",
                           f"pass a {flag} on a local filesystem") from None
        who = f"process {holder}" if holder else "another process"
        raise CLIError(f"{flag} {work} is in use by {who}: two processes on one workdir would run as "
                       "the same peer", f"stop that process, or pass another {flag}") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    except OSError as exc:  # a full disk: refused now, not after training started
        f.close()
        raise CLIError(f"cannot write to {flag} {work}: {exc.strerror}",
                       f"free space there, or pass another {flag}") from None
    return f


def _holder(f: IO[str]) -> int | None:
    try:
        f.seek(0)
        text = f.read(32).strip()
        return int(text) if text.isdigit() else None
    except (OSError, ValueError):
        return None
