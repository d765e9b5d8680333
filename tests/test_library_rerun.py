"""Issue 33, item 5: a library script run again is the same run (its id comes from the run
name, the arguments and the starting weights), so it resumes from the checkpoint its first run
left in its default workdir, as a restarted `p2ptrain join` does. Before, it started again
from step 0 while the DHT still advertised its first run's state (for the 10 minutes records
live), and looked for that state at peers that were gone: "catch-up fetch failed" over and
over, up to 300 s with `min_peers`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import start_bootstrap

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent('''
    import json, sys
    from p2ptrain import DiLoCo      # before torch (p2ptrain/__init__.py)
    import torch
    torch.manual_seed(0)             # the same starting weights: the same run
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, opt, run="lib-rerun", bootstrap=[sys.argv[1]], listen="/ip4/127.0.0.1/tcp/0",
                    inner_steps=5, group_size=4, min_peers=int(sys.argv[2]), join_window=5)
    start = diloco.outer_step_count
    g = torch.Generator().manual_seed(start)
    for i in range(10):
        x = torch.randn(32, 16, generator=g)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        diloco.step(loss)
    diloco.close()
    print(json.dumps({"start": start, "steps": diloco.outer_step_count,
                      "params": diloco.local.outer.params_sha256()}))
''')


def run_script(script, baddr: str, min_peers: int, home, timeout: float) -> tuple[dict, str, float]:
    import json

    # HOME: the default workdir (~/.p2ptrain/lib/<run id>) lands in this test's folder
    env = dict(os.environ, HOME=str(home))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(script), baddr, str(min_peers)], capture_output=True, text=True,
                       cwd=home, env=env, timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr, time.monotonic() - t0


@pytest.mark.parametrize("min_peers", [1, 2])
def test_a_rerun_library_script_resumes_from_its_checkpoint(procs, tmp_path, min_peers):
    boot, baddr = start_bootstrap(procs)
    script = tmp_path / "user.py"
    script.write_text(SCRIPT)
    # alone with min_peers=2 the first run waits its start_timeout (300 s); 1 peer is enough here
    first, _, took = run_script(script, baddr, 1, tmp_path, 180)
    assert first["start"] == 0 and first["steps"] == 2, first
    ckpts = list((tmp_path / ".p2ptrain" / "lib").rglob("step-*.p2ck"))
    assert ckpts, "the first run left no checkpoint in its default workdir"
    # again at once: the first run's records are still in the DHT, its peer is gone
    second, err, took2 = run_script(script, baddr, min_peers, tmp_path, 400)
    assert second["start"] == 2 and second["steps"] == 4, second
    assert "catch-up fetch failed" not in err, err[-2000:]
    assert took2 < took + 60, (took, took2)
    print("first run", round(took, 1), "s, rerun", round(took2, 1), "s")
