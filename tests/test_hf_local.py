"""The model side of issue 16 without the network: devices and precision, Hugging Face models,
tokenizers, text formats, the token cache and the token-stream blob peers exchange.

CUDA tests skip with their reason on machines without a GPU; the CPU tests run the same
code paths with device="cpu" (host buffers are then plain memory: pinning needs CUDA)."""

from __future__ import annotations

import json
from pathlib import Path

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import hf_fixtures
from p2ptrain.ckpt import checkpoint
from p2ptrain.run import manifest as mf
from p2ptrain.run.spec import RunSpec
from p2ptrain.train import data as datamod
from p2ptrain.train import device as dev
from p2ptrain.train import hf, shards, tokenize
from p2ptrain.train.local import LocalModel, load_run_data
from p2ptrain.train.outer import OuterConfig, OuterOptimizer, flatten, sha256_f32
from p2ptrain.procs import run as run_cli

NO_CUDA = "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> tuple[dict, Path]:
    """An initialized run: tiny Llama config, a BPE tokenizer trained here, jsonl data."""
    from p2ptrain.cli.main import main

    d = tmp_path_factory.mktemp("hfrun")
    hf_fixtures.write_llama(d / "model")
    hf_fixtures.train_bpe(d / "tok.json")
    spec = hf_fixtures.write_jsonl(d / "data")
    mp = pytest.MonkeyPatch()
    mp.setenv("P2PTRAIN_CACHE", str(d / "cache"))
    assert main(["init", "--out", str(d / "run"), "--key", str(d / "k.key"), "--model", f"hf:{d / 'model'}",
                 "--tokenizer", str(d / "tok.json"), "--data", spec, "--inner-steps", "3", "--batch-size", "2",
                 "--seq-len", "32", "--warmup", "1", "--seed", "11"]) == 0
    mp.undo()
    manifest, _ = mf.read(d / "run" / "run.toml")
    return manifest, d


def make_local(hf_run, device="cpu", precision="auto", peer=b"peer-a") -> LocalModel:
    manifest, d = hf_run
    spec = RunSpec.from_dict(manifest)
    ds = load_run_data(spec, (d / "run" / "tokenizer.json").read_bytes())
    return LocalModel(spec, ds, peer, (d / "run" / "genesis.p2ck").read_bytes(), 1, device, precision)


# -- devices -----------------------------------------------------------------------------
def test_device_and_precision_resolution():
    assert dev.resolve_device("cpu") == torch.device("cpu")
    assert dev.resolve_precision("auto", torch.device("cpu")) is None  # fp32 on a CPU
    assert dev.resolve_precision("bf16", torch.device("cpu")) == torch.bfloat16
    for bad in ("gpu", "cuda:x", "", "CPU"):
        with pytest.raises(ValueError, match="device must be"):
            dev.DeviceConfig(device=bad)
    with pytest.raises(ValueError, match="precision"):
        dev.DeviceConfig(precision="fp16")
    if not torch.cuda.is_available():
        assert dev.resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="no CUDA GPU"):
            dev.resolve_device("cuda:0")


def test_host_buffers_and_copies_on_cpu():
    # pinned only with CUDA (torch raises otherwise); same code path either way
    assert dev.host_empty(8).is_pinned() == torch.cuda.is_available()
    params = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    flat = dev.gather_to_host(params)
    assert flat.dtype == torch.float32 and flat.device.type == "cpu"
    assert torch.equal(flat, torch.cat([p.reshape(-1) for p in params]))
    targets = [torch.zeros_like(p) for p in params]
    dev.scatter_from_host(flat, targets)
    assert all(torch.equal(a, b) for a, b in zip(params, targets))
    with pytest.raises(ValueError):
        dev.gather_to_host(params, torch.empty(3))
    with pytest.raises(ValueError):
        dev.scatter_from_host(torch.zeros(4), targets)
    assert sha256_f32(flat) == sha256_f32(flat.clone())


def test_precisions_disagree_locally_but_commit_identical_params(hf_run):
    """An fp32 peer and a bf16-autocast peer train differently, yet one committed average
    gives both the same outer params: the outer state is host fp32 in every mode."""
    a, b = make_local(hf_run, precision="fp32"), make_local(hf_run, precision="bf16", peer=b"peer-b")
    assert a.outer.params_sha256() == b.outer.params_sha256()
    la, _, _ = a.inner()
    lb, _, _ = b.inner()
    assert np.isfinite(la) and np.isfinite(lb)
    ga, gb = a.pseudo_gradient(), b.pseudo_gradient()
    assert not np.array_equal(ga, gb)
    avg = (ga + gb) / np.float32(2)
    assert a.outer_step(avg) == b.outer_step(avg)
    assert np.isfinite(a.evaluate(max_batches=2)) and np.isfinite(b.evaluate(max_batches=2))


@needs_cuda
def test_cuda_placement_and_cuda_cpu_peers_commit_identical_params(hf_run):
    g, c = make_local(hf_run, device="cuda"), make_local(hf_run, device="cpu", peer=b"peer-b")
    assert all(p.device.type == "cuda" for p in g.model.parameters())
    assert g.outer.outer.device.type == "cpu" and g.outer.outer.is_pinned()
    assert g.outer.momentum.is_pinned()
    assert g.autocast_dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else None)
    g.inner()
    c.inner()
    delta = g.pseudo_gradient()
    assert delta.dtype == np.float32 and np.isfinite(delta).all()
    avg = (delta + c.pseudo_gradient()) / np.float32(2)
    assert g.outer_step(avg) == c.outer_step(avg)
    # the model on the GPU holds exactly the committed outer params
    assert sha256_f32(flatten(g.model.parameters())) == g.outer.params_sha256()


@needs_cuda
def test_library_outer_optimizer_with_a_cuda_model():
    """The three failures issue 16 names: .numpy() of a CUDA tensor, a pseudo-gradient
    without .cpu(), CPU tensors added to CUDA momentum."""
    model = torch.nn.Linear(8, 4).cuda()
    outer = OuterOptimizer(model, OuterConfig())
    with torch.no_grad():
        model.weight.add_(1.0)
    g = outer.pseudo_gradient(model)
    assert g.device.type == "cpu"
    outer.step(g)
    assert outer.params_sha256() == sha256_f32(flatten(model.parameters()))


# -- Hugging Face models -------------------------------------------------------------------
def test_hf_section_and_seeded_init(tmp_path):
    hf_fixtures.write_llama(tmp_path)
    section, weights = hf.model_section(tmp_path)
    assert weights is None and section["kind"] == "hf" and section["vocab_size"] == 512
    assert "_name_or_path" not in json.loads(section["config_json"])  # machine-specific keys dropped
    state = torch.random.get_rng_state()
    a, b, c = hf.build_run_model(section, 3), hf.build_run_model(section, 3), hf.build_run_model(section, 4)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's RNG is untouched
    h = [sha256_f32(flatten(m.parameters())) for m in (a, b, c)]
    assert h[0] == h[1] != h[2]
    tokens = torch.randint(0, 512, (2, 9))
    assert a.loss(tokens).shape == () and a(tokens).shape == (2, 9, 512)
    bad = dict(section, config_json=section["config_json"].replace("64", "96", 1))
    with pytest.raises(hf.HFModelError, match="config_sha256"):
        hf.build_run_model(bad, 3)


def test_hf_weights_from_safetensors(tmp_path):
    from safetensors.torch import save_file

    hf_fixtures.write_llama(tmp_path)
    section, _ = hf.model_section(tmp_path)
    src = hf.build_run_model(section, 99)
    save_file({k: v.contiguous() for k, v in src.hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    section2, weights = hf.model_section(tmp_path)
    assert weights is not None and len(section2["weights_sha256"]) == 64
    got = hf.build_run_model(section2, 0, weights)
    assert sha256_f32(flatten(got.parameters())) == sha256_f32(flatten(src.parameters()))
    with pytest.raises(hf.HFModelError, match="config.json"):
        hf.model_section(tmp_path / "nowhere")


def test_init_pins_hf_config_tokenizer_and_tokens(hf_run):
    manifest, d = hf_run
    assert manifest["model"]["kind"] == "hf" and manifest["model"]["max_seq_len"] == 128
    tok = (d / "run" / "tokenizer.json").read_bytes()
    assert manifest["data"]["tokenizer_sha256"] == checkpoint.sha256(tok)
    ds = load_run_data(RunSpec.from_dict(manifest), tok)
    assert ds.content_hash == manifest["data"]["content_hash"] and ds.n_tokens == manifest["data"]["n_tokens"]
    assert ds.train.dtype == np.uint16 and int(ds.train.max()) < 384
    assert mf.verify_manifest(manifest)  # the HF config string survives the TOML round trip


# -- tokenizers, formats, cache -----------------------------------------------------------
def test_formats_tokenize_the_same_documents(tmp_path, monkeypatch):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("P2PTRAIN_CACHE", str(tmp_path / "cache"))
    tok_bytes = hf_fixtures.train_bpe(tmp_path / "tok.json").read_bytes()
    tok = tokenize.RunTokenizer(tok_bytes)
    docs = hf_fixtures.texts(60)
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n\n" for t in docs))
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"text": docs}), tmp_path / "p" / "a.parquet")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "h"))
    streams = []
    for spec in (f"jsonl:{tmp_path}/j/*.jsonl", f"parquet:{tmp_path}/p/*.parquet", f"hf:{tmp_path}/h"):
        ds = datasets_load(spec, tok_bytes)
        streams.append(np.concatenate([ds.train, ds.val]))
    assert all(np.array_equal(streams[0], s) for s in streams[1:])
    end = tok._tok.token_to_id("<|endoftext|>")
    assert int((streams[0] == end).sum()) == len(docs)  # one end-of-text after each document
    first = streams[0][:int(np.argmax(streams[0] == end))]
    assert tok._tok.decode(first.tolist()) == docs[0]
    bytes_ds = datasets_load(f"jsonl:{tmp_path}/j/*.jsonl", None)  # the default tokenizer: bytes
    assert bytes_ds.train.dtype == np.uint8 and bytes_ds.content_hash != datasets_load(
        f"jsonl:{tmp_path}/j/*.jsonl", tok_bytes).content_hash


def datasets_load(spec, tok_bytes):
    datamod._CACHE.clear()
    return datamod.load_dataset(spec, 512, tok_bytes)


def test_tokenization_is_cached_on_disk_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("P2PTRAIN_CACHE", str(tmp_path / "cache"))
    spec = hf_fixtures.write_jsonl(tmp_path / "d", n_files=3, n_docs=60)
    first = datasets_load(spec, None)
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npz"))) == 1

    def boom(self, texts):
        raise AssertionError("tokenized again despite the cache")

    monkeypatch.setattr(tokenize.RunTokenizer, "encode_docs", boom)
    assert datasets_load(spec, None).content_hash == first.content_hash
    with open(tmp_path / "d" / "part0.jsonl", "a") as f:  # new content: a new key, so no stale hit
        f.write(json.dumps({"text": "more"}) + "\n")
    with pytest.raises(AssertionError, match="tokenized again"):
        datasets_load(spec, None)


def test_bad_text_data_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("P2PTRAIN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "x.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: .*'text'"):
        datasets_load(f"jsonl:{tmp_path}/x.jsonl", None)
    with pytest.raises(tokenize.TokenizerError):
        tokenize.RunTokenizer(b"{not a tokenizer")
    big = hf_fixtures.train_bpe(tmp_path / "t.json", vocab_size=600).read_bytes()
    (tmp_path / "y.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="vocab_size is 512"):
        datasets_load(f"jsonl:{tmp_path}/y.jsonl", big)


# -- the token stream peers exchange ------------------------------------------------------
def test_token_blob_roundtrip_and_tampering(hf_run):
    manifest, d = hf_run
    manifest = RunSpec.from_dict(manifest)
    ds = load_run_data(manifest, (d / "run" / "tokenizer.json").read_bytes())
    blob = shards.encode_dataset(ds)
    got = shards.decode_dataset(blob, manifest)
    assert got.content_hash == ds.content_hash and np.array_equal(got.train, ds.train)
    arrays, meta = checkpoint.decode(blob)
    train = arrays["train"].copy()
    train[5] ^= 1
    forged = checkpoint.encode({"train": train, "val": arrays["val"]}, meta)
    with pytest.raises(checkpoint.CheckpointError, match="not the run's"):
        shards.decode_dataset(forged, manifest)
    with pytest.raises(checkpoint.CheckpointError):
        shards.decode_dataset(checkpoint.encode({"x": np.zeros(3, np.uint8)}, {}), manifest)
    with pytest.raises(checkpoint.CheckpointError, match="over the limit"):
        shards.decode_dataset(blob + bytes((1 << 20) + 4 * ds.n_tokens), manifest)


def test_uint32_token_streams_travel_as_int32():
    train = np.array([70000, 1, 2, 3, 99999] * 4, np.uint32)
    val = np.array([5, 6, 7], np.uint32)
    ds = datamod.Dataset("jsonl:x", train, val, datamod._hash("k", train, val), 1, 0, "k")
    spec = SimpleNamespace(data=SimpleNamespace(content_hash=ds.content_hash, spec="jsonl:x", n_tokens=None))
    got = shards.decode_dataset(shards.encode_dataset(ds), spec)
    assert got.train.dtype == np.uint32 and np.array_equal(got.train, train)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --device cuda is valid here")
def test_join_with_a_gpu_this_machine_lacks_is_a_one_line_error(tmp_path, capsys):
    from p2ptrain.cli.main import main

    code = main(["join", "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWNRf48DoVBnk6zmGsB58Vte3WMG3kyhNHujRqiA4mF1Mb",
                 "--workdir", str(tmp_path), "--run", "0" * 64, "--device", "cuda:0"])
    err = capsys.readouterr().err
    assert code != 0 and "no CUDA GPU" in err and "--device cpu" in err, err


def test_throughput_bench_runs_and_reports_both_ratios(tmp_path):
    """The bench itself (figures are in BENCHMARKS.md; this only keeps it from rotting)."""

    hf_fixtures.write_llama(tmp_path / "m")
    out = run_cli(["bench", "throughput", "--model", f"hf:{tmp_path / 'm'}",
                   "--steps", "1", "--rounds", "1", "--batch", "2", "--seq-len", "32", "--threads", "1",
                   "--json"], timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["params"] == 139584 and r["device"] == "cpu" and r["precision"] == "fp32"
    assert r["speed_ratio"] > 0 and r["memory"] == "peak_rss" and r["plain_peak_mb"] > 0
    assert r["outer_state_mb"] == round(3 * 4 * 139584 / 1e6, 1)
