"""The opt-in round timeline (`p2ptrain.reduce.roundtrace`, `bench allreduce --trace`)."""

from __future__ import annotations

import numpy as np

from p2ptrain.reduce import roundtrace
from p2ptrain.reduce.ring import RingConfig, layout, schedule
from test_ring import make_ring, run_ring


def test_milestones_name_a_members_round():
    marks = [["setup", 1.5, {}], ["send", 3.0, {"t0": 2.0, "step": 0}], ["recv", 5.0, {"step": 0}],
             ["send", 6.0, {"t0": 5.5, "step": 0}], ["recv", 12.0, {"step": 0}], ["check", 12.5, {}],
             ["recv", 14.0, {"step": 1}], ["data", 15.0, {}], ["votes", 16.0, {}], ["end", 16.5, {}]]
    got = roundtrace.milestones(marks)
    assert got == {"first_seal": 2.0, "first_send": 3.0, "last_send": 6.0, "step0": 12.0, "step1": 14.0,
                   "recv_gap": 7.0, "recv_gap_after_step": 0, "setup": 1.5, "check": 12.5, "data": 15.0,
                   "votes": 16.0, "end": 16.5}
    assert roundtrace.milestones([]) == {}


def test_off_by_default_and_marks_nothing(monkeypatch):
    monkeypatch.setattr(roundtrace, "ON", False)
    roundtrace.take(0.0)
    roundtrace.mark("setup")
    assert roundtrace.take(0.0) == []


def test_a_traced_ring_round_marks_every_frame_it_sends_and_receives(monkeypatch):
    monkeypatch.setattr(roundtrace, "ON", True)
    world, n = 3, 300_000
    cfg = RingConfig("int8", sub_chunk_bytes=64 * 1024)
    vecs = [np.random.default_rng(i).standard_normal(n, dtype=np.float32) for i in range(world)]
    origin = roundtrace.now()
    roundtrace.take(origin)
    results, errors = run_ring(vecs, cfg, *make_ring(world))
    marks = roundtrace.take(origin)
    assert errors == [None] * world
    lay = layout(n, world, cfg)
    sends = [s for i in range(world) for s in schedule(i, world, lay)[0]]
    assert sum(m[0] == "send" for m in marks) == len(sends)
    assert sum(m[0] == "recv" for m in marks) == len(sends)
    assert sorted(m[2]["step"] for m in marks if m[0] == "send") == sorted(fid.step for fid, _, _ in sends)
    # Stamps are ms after the origin and a frame's sealing starts before it reaches the kernel.
    assert all(0 <= m[1] < 60_000 for m in marks)
    assert all(m[2]["t0"] <= m[1] for m in marks if m[0] == "send")
    assert roundtrace.take(origin) == []  # taken once
