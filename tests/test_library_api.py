"""`p2ptrain.DiLoCo` around a user's own model and loop, in two real processes."""

from __future__ import annotations

import textwrap

import pytest

from conftest import run_user_scripts, start_bootstrap

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from p2ptrain import DiLoCo
    torch.manual_seed(0)                      # identical start on every peer
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, opt, run="lib-test", bootstrap=[sys.argv[1]], listen="/ip4/127.0.0.1/tcp/0",
                    inner_steps=5, group_size=4, min_peers=2, join_window=20, allreduce=sys.argv[3])
    g = torch.Generator().manual_seed(int(sys.argv[2]))   # each peer its own data
    applied = []
    for i in range(15):
        x = torch.randn(32, 16, generator=g)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if diloco.step(loss):
            applied.append(diloco.local.outer.params_sha256())
    diloco.close()
    print(json.dumps({"applied": applied, "steps": diloco.outer_step_count}))
''')


@pytest.mark.parametrize("allreduce", ["int8"])
def test_two_processes_share_outer_steps(procs, tmp_path, allreduce):
    """(A sparse library run took 85 s here on 2 cores, mostly numba compiling in both
    processes: tests/test_peer.py checks what broke it, in process.)"""
    boot, baddr = start_bootstrap(procs)
    script = tmp_path / "user.py"
    script.write_text(SCRIPT)
    outs = run_user_scripts(script, [[baddr, str(i), allreduce] for i in range(2)], tmp_path)
    assert outs[0]["steps"] == outs[1]["steps"] == 3
    assert outs[0]["applied"] == outs[1]["applied"] and len(outs[0]["applied"]) == 3
