"""The README's first command, shortened: `p2ptrain demo` end to end in real processes."""

from __future__ import annotations

import json

import pytest
from p2ptrain.procs import run as run_cli

pytestmark = pytest.mark.integration


def test_demo_trains_and_reports(tmp_path):
    out = run_cli(
        ["demo", "--peers", "2", "--outer-steps", "2", "--inner-steps", "4",
         "--workdir", str(tmp_path / "demo"), "--json"],
        timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    commits = [e for e in events if e["event"] == "outer_step_committed"]
    peers = {e["peer"] for e in commits}
    assert len(peers) == 2 and len(commits) == 4
    for step in (1, 2):
        assert len({e["params_sha256"] for e in commits if e["step"] == step}) == 1
    for peer in peers:  # k of N (--max-outer-steps), and an ETA once a step time is measured (issue 33)
        mine = [e for e in commits if e["peer"] == peer]
        assert [(e["goal_done"], e["goal_total"]) for e in mine] == [(1, 2), (2, 2)]
        assert all(e["step_seconds"] > 0 for e in mine) and [e["eta_seconds"] for e in mine][-1] == 0
    assert "identical parameters on every peer after every step: True" in out.stderr
    assert "single worker, same compute: validation loss" in out.stderr
    png = tmp_path / "demo" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
