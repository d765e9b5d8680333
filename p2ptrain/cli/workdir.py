"""A peer's state directory: made usable (or refused with advice), and held by one process.

The workdir holds the node's key, so two processes on one workdir would be one peer id
twice (issue 33): each would answer for the other's records and rounds. `join` holds it with
`p2ptrain.workdir.claim` (the library does too) for its whole life; a second process is
refused and told which pid holds it.
"""

from __future__ import annotations

from pathlib import Path

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


def lock(work: Path, flag: str = "--workdir") -> int:
    """Hold `work` for this process (`p2ptrain.workdir.claim`): the lock's descriptor, kept
    open for the process's life. CLIError naming the holder's pid, or why `work` cannot be
    held, with advice."""
    from p2ptrain import workdir

    try:
        return workdir.claim(Path(work))
    except workdir.WorkdirInUse as exc:
        who = f"process {exc.pid}" if exc.pid else "another process"
        raise CLIError(f"{flag} {work} is in use by {who}: two processes on one workdir would run as "
                       "the same peer", f"stop that process, or pass another {flag}") from None
    except workdir.WorkdirError as exc:
        raise CLIError(f"{flag}: {exc}", exc.advice.replace("directory", flag, 1)) from None
