"""`p2ptrain.DiLoCo` around a transformers model (LlamaForCausalLM from a local config), in two
real processes: both apply the same outer steps (identical params hashes)."""

from __future__ import annotations

import textwrap

import pytest

from conftest import run_user_scripts, start_bootstrap

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent('''
    import json, sys
    import p2ptrain  # before torch: see p2ptrain/__init__.py
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from p2ptrain import DiLoCo
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    torch.manual_seed(0)                      # identical start on every peer
    model = LlamaForCausalLM(cfg).to(sys.argv[3])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = DiLoCo(model, opt, run="hf-lib-test", bootstrap=[sys.argv[1]], listen="/ip4/127.0.0.1/tcp/0",
                    inner_steps=3, group_size=4, min_peers=2, join_window=20, tokens_per_step=4 * 32)
    g = torch.Generator().manual_seed(int(sys.argv[2]))   # each peer its own data
    applied = []
    for i in range(6):
        ids = torch.randint(0, 300, (4, 32), generator=g).to(sys.argv[3])
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(); loss.backward(); opt.step()
        if diloco.step(loss):
            applied.append(diloco.local.outer.params_sha256())
    diloco.close()
    print(json.dumps({"applied": applied, "steps": diloco.outer_step_count,
                      "device": str(next(model.parameters()).device)}))
''')


def run_pair(procs, tmp_path, devices: tuple[str, str]) -> list[dict]:
    boot, baddr = start_bootstrap(procs)
    script = tmp_path / "user_hf.py"
    script.write_text(SCRIPT)
    return run_user_scripts(script, [[baddr, str(i), devices[i]] for i in range(2)], tmp_path)


def test_two_processes_train_a_transformers_model(procs, tmp_path):
    outs = run_pair(procs, tmp_path, ("cpu", "cpu"))
    assert outs[0]["steps"] == outs[1]["steps"] == 2
    assert outs[0]["applied"] == outs[1]["applied"] and len(outs[0]["applied"]) == 2


def test_a_cuda_and_a_cpu_process_apply_identical_outer_steps(procs, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine (torch.cuda.is_available() is False)")
    outs = run_pair(procs, tmp_path, ("cuda", "cpu"))
    assert outs[0]["device"].startswith("cuda") and outs[1]["device"] == "cpu"
    assert outs[0]["applied"] == outs[1]["applied"] and len(outs[0]["applied"]) == 2
