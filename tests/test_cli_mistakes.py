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

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "numba", "libp2p")
# This checkout's p2ptrain for children that run elsewhere (installed or not), and the demo's own children.
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def p2ptrain(*args: str, cwd: Path, timeout: float = 60, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2ptrain", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**ENV, **(env or {})}, **kw)


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
