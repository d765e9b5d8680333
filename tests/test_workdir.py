"""p2ptrain/workdir.py: one process per state directory, held by a kernel lock that dies
with its process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from p2ptrain import workdir as wd

HOLD = "import sys, time; from p2ptrain import workdir as wd; wd.claim(sys.argv[1]); print('held', flush=True); time.sleep(60)"


def hold(path) -> subprocess.Popen:
    """Another process holding `path` (until killed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_held_workdir_names_its_holder_and_is_free_once_it_dies(tmp_path):
    other = hold(tmp_path / "w")
    try:
        with pytest.raises(wd.WorkdirInUse) as err:
            wd.claim(tmp_path / "w")
        assert err.value.pid == other.pid and f"process {other.pid}" in str(err.value)
        assert "own workdir" in str(err.value)
    finally:
        other.kill()
        other.wait(10)
    fd = wd.claim(tmp_path / "w")  # killed, not cleaned up: the kernel dropped its lock
    os.close(fd)


def test_slots_a_rerun_gets_its_slot_back_two_at_once_get_two(tmp_path):
    d0, fd0 = wd.claim_slot(tmp_path)
    d1, fd1 = wd.claim_slot(tmp_path)
    assert (d0.name, d1.name) == ("0", "1")
    os.close(fd0)
    again, fd = wd.claim_slot(tmp_path)
    assert again == d0
    os.close(fd)
    os.close(fd1)
