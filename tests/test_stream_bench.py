"""`bench diloco --avg streaming` (issue 17): fragment-wise overlapped DiLoCo in the simulation.
Its arithmetic must collapse to synchronous DiLoCo bit for bit when nothing is streamed or
overlapped, and every fragment round must touch its own slice only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2ptrain.bench import diloco_stream


def _bench(avg: str, seed: int = 0, H: int = 4, **stream) -> dict:
    from p2ptrain.bench.diloco import Settings, run_config

    st = Settings(steps=12, batch=2, seq_len=16, warmup=2, warm_start=0, eval_batches=1, eval_batch=4,
                  workers=2, model=dict(d_model=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=16), **stream)
    return run_config(st, "diloco", H, avg, seed, None)


def test_one_fragment_without_overlap_is_synchronous_diloco_bit_for_bit():
    torch.set_num_threads(1)
    sync = _bench("fp32")
    one = _bench("streaming", stream_fragments=1, stream_scheme="none", stream_flush=False)
    assert one["outer_sha256"] == sync["outer_sha256"] and one["fragment_rounds"] == 3


def test_streamed_fragments_change_the_run_and_each_gets_its_rounds(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(diloco_stream, "STREAM_BLOCK", 512)
    sync = _bench("fp32")
    runs = {}
    for scheme, land in (("none", 1.0), ("eager", 1.0), ("delayed", 0.5)):
        r = _bench("streaming", stream_fragments=2, stream_scheme=scheme, overlap_land=land)
        assert r["outer_sha256"] != sync["outer_sha256"] and np.isfinite(r["val_loss"]), scheme
        # 12 steps, H 4, P 2: a fragment round every 2 steps (6), then the flush of fragment 0
        assert r["fragment_rounds"] == 7 and r["land_steps"] == (0 if scheme == "none" else round(land * 2))
        runs[scheme] = r["outer_sha256"]
    assert len(set(runs.values())) == 3
    with pytest.raises(ValueError):
        _bench("streaming", H=3, stream_fragments=2)  # H not a multiple of P
