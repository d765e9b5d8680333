"""Model (presets, seeded init, shapes, learning) and data (split, hash, sharding, specs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2ptrain.train.data import (Dataset, evaluate, is_val_file, load_dataset, stdlib_files, train_batch,
                           val_batches)
from p2ptrain.train.model import PRESETS, ModelConfig, Transformer, build_model, param_count, params_sha256

RANGES = {"tiny": (0.5e6, 1.5e6), "small": (5e6, 15e6), "base": (50e6, 150e6)}
MICRO = ModelConfig(d_model=32, n_layers=2, n_heads=2, ffn_hidden=96, max_seq_len=32)


@pytest.fixture(scope="module")
def stdlib() -> Dataset:
    return load_dataset("stdlib")


# ---------------------------------------------------------------------------- model
@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_param_counts(name):
    cfg = ModelConfig.preset(name)
    lo, hi = RANGES[name]
    assert lo <= cfg.num_params() <= hi
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_analytic_count_matches_module(name):
    cfg = ModelConfig.preset(name)
    assert param_count(build_model(cfg, 0)) == cfg.num_params()


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=130, n_heads=4)
    with pytest.raises(ValueError, match="even"):
        ModelConfig(d_model=12, n_heads=4)
    with pytest.raises(ValueError, match="positive int"):
        ModelConfig(n_layers=0)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        ModelConfig.from_dict({"d_model": 64, "colour": 1})


def test_init_is_a_function_of_the_seed():
    state = torch.random.get_rng_state()
    a, b, c = build_model(MICRO, 7), build_model(MICRO, 7), build_model(MICRO, 8)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
    assert params_sha256(a) == params_sha256(b)
    assert params_sha256(a) != params_sha256(c)
    # scaled init: residual projections are smaller than the other matrices
    assert a.blocks[0].attn.out.weight.std() < 0.7 * a.blocks[0].attn.qkv.weight.std()


def test_forward_shapes_and_causality():
    model = build_model(MICRO, 0)
    tokens = torch.randint(0, 256, (3, 20))
    logits = model(tokens)
    assert logits.shape == (3, 20, 256) and logits.dtype == torch.float32
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256  # the future must not change the past
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-5)
    loss = model.loss(torch.randint(0, 256, (3, 33)))
    assert loss.ndim == 0 and abs(loss.item() - np.log(256)) < 0.5  # ~uniform at init
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_loss_decreases_on_stdlib(stdlib):
    torch.manual_seed(0)
    model = build_model(MICRO, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = train_batch(stdlib, b"peer", 0, 8, 32, seed=0)
    first = model.loss(batch).item()
    for _ in range(30):
        loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 1.0
    val = evaluate(model, stdlib, batch=8, seq_len=32, max_batches=2)
    assert np.isfinite(val) and model.training


# ---------------------------------------------------------------------------- data
def test_stdlib_split_is_by_file_and_stable(stdlib):
    root, rels = stdlib_files()
    val_files = [r for r in rels if is_val_file(r)]
    assert stdlib.n_val_files == len(val_files) and stdlib.n_train_files == len(rels) - len(val_files)
    assert 0.02 < len(val_files) / len(rels) < 0.09
    assert not any("/test/" in f"/{r}" or "site-packages" in r for r in rels)
    # val is exactly the concatenation of the validation files, in sorted order
    first = (root / val_files[0]).read_bytes()
    assert stdlib.val[:len(first)].tobytes() == first
    assert stdlib.train.dtype == np.uint8
    # a second, uncached load gives the same bytes and hash
    from p2ptrain.train import data as data_mod

    data_mod._CACHE.clear()
    again = load_dataset("stdlib")
    assert again.content_hash == stdlib.content_hash
    assert np.array_equal(again.val, stdlib.val)
    assert load_dataset("stdlib") is again  # cached in-process


def test_train_batch_is_deterministic_per_peer_and_step(stdlib):
    a = train_batch(stdlib, b"alice", 3, 4, 64, seed=1)
    assert a.shape == (4, 65) and a.dtype == torch.long
    assert torch.equal(a, train_batch(stdlib, b"alice", 3, 4, 64, seed=1))
    for other in (train_batch(stdlib, b"bob", 3, 4, 64, seed=1),
                  train_batch(stdlib, b"alice", 4, 4, 64, seed=1),
                  train_batch(stdlib, b"alice", 3, 4, 64, seed=2)):
        assert not torch.equal(a, other)
    v1, v2 = val_batches(stdlib, 4, 64, 3), val_batches(stdlib, 4, 64, 3)
    assert len(v1) == 3 and all(torch.equal(x, y) for x, y in zip(v1, v2))


@pytest.mark.parametrize("spec, advice", [("", "stdlib"), ("csv:x", "glob:"), ("parquet:/nonexistent/*.parquet", "no data files"), ("stdlib:x", "bin:"),
                                          ("glob:", "glob:"), ("bin:/nonexistent.bin", "does not exist"),
                                          ("glob:/nonexistent/*.txt", "no data files")])
def test_bad_specs_raise_with_advice(spec, advice):
    with pytest.raises(ValueError, match=advice):
        load_dataset(spec)


def test_glob_spec(tmp_path):
    for i in range(60):
        (tmp_path / f"doc{i:02d}.txt").write_bytes(f"document {i} ".encode() * 20)
    ds = load_dataset(f"glob:{tmp_path}/*.txt")
    assert ds.train.dtype == np.uint8 and ds.n_val_files >= 1 and ds.n_train_files >= 1
    assert ds.n_train_files + ds.n_val_files == 60
    # the split depends on paths relative to the data root, not on where the data lives
    other = tmp_path / "elsewhere"
    other.mkdir()
    for i in range(60):
        (other / f"doc{i:02d}.txt").write_bytes(f"document {i} ".encode() * 20)
    assert load_dataset(f"glob:{other}/*.txt").content_hash == ds.content_hash
    assert train_batch(ds, b"p", 0, 2, 16, 0).shape == (2, 17)


def test_bin_spec(tmp_path):
    tokens = (np.arange(5000) % 1000).astype("<u2")
    path = tmp_path / "tokens.bin"
    path.write_bytes(tokens.tobytes())
    ds = load_dataset(f"bin:{path}", vocab_size=1000)
    assert ds.train.dtype == np.uint16 and ds.train.size + ds.val.size == 5000
    assert np.array_equal(np.concatenate([ds.train, ds.val]), tokens)
    batch = train_batch(ds, b"p", 0, 2, 8, 0)
    assert int(batch.max()) < 1000
    with pytest.raises(ValueError, match="vocab_size"):
        load_dataset(f"bin:{path}", vocab_size=512)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="even number"):
        load_dataset(f"bin:{odd}")


def test_model_type():
    assert isinstance(build_model(MICRO, 0), Transformer)
