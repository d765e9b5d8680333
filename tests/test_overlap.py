"""Overlapped outer steps (issue 17), fast tier: the correction math, the worker-thread landing,
the manifest field, and the bench's simulation against synchronous DiLoCo."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from p2ptrain.train import overlap_math as om
from p2ptrain.train.outer import OuterConfig, OuterOptimizer


def _vec(seed: int, n: int = 1000) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32))


def test_nesterov_stand_in_is_the_outer_step_bit_for_bit():
    model = torch.nn.Linear(10, 10)
    opt = OuterOptimizer(model, OuterConfig(0.7, 0.9))
    opt.momentum.copy_(_vec(1, opt.numel) * 0.01)
    x, m, g = opt.outer.clone(), opt.momentum.clone(), _vec(2, opt.numel) * 0.1
    x0, m0 = x.clone(), m.clone()
    x2, m2 = om.nesterov(x, m, g, 0.7, 0.9)
    assert torch.equal(x, x0) and torch.equal(m, m0) and not torch.equal(x, x2)  # inputs untouched
    opt.step(g.clone(), load_model=False)
    assert torch.equal(x2, opt.outer) and torch.equal(m2, opt.momentum)
    # load_model=False leaves the model alone (an overlapped run's model trains elsewhere)
    assert not torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt.outer)


def test_rebase_keeps_the_phase_progress_and_lands_exactly_when_nothing_trained_yet():
    start, local, committed = _vec(1), _vec(2), _vec(3)
    moved = om.rebase(local, start, committed)
    # the contribution is the same vector either way (up to the rounding of the translation)
    assert torch.allclose(om.contribution(committed, moved), om.contribution(start, local), atol=1e-5)
    # landing before the first inner step: exactly the committed state (synchronous DiLoCo)
    assert torch.equal(om.rebase(start.clone(), start, committed), committed)
    with pytest.raises(ValueError):
        om.rebase(local[:10], start, committed)


def test_phase_start_per_scheme():
    x, m, y = _vec(1), _vec(2) * 0.01, _vec(3)
    d = x - y
    assert torch.equal(om.phase_start("delayed", x, m, y, d, 0.7, 0.9), y)
    assert torch.equal(om.phase_start("eager", x, m, y, d, 0.7, 0.9), om.nesterov(x, m, d, 0.7, 0.9)[0])
    assert torch.equal(om.phase_start("none", x, m, y, d, 0.7, 0.9), x)
    with pytest.raises(ValueError):
        om.phase_start("streaming", x, m, y, d, 0.7, 0.9)


def test_phase_lands_posted_state_between_steps_from_another_thread():
    from p2ptrain.train.phases import Phase

    p = torch.nn.Parameter(_vec(1, 50).clone())
    start = p.detach().clone()
    ph = Phase(start)
    ph.land([p], 0)  # nothing posted: nothing changes
    assert ph.landed_at is None and torch.equal(p.detach(), start)
    with torch.no_grad():
        p.add_(1.0)  # one "inner step" of progress
    committed = _vec(2, 50)
    t = threading.Thread(target=ph.post, args=(committed,))
    t.start()
    t.join()
    ph.land([p], 1)
    assert ph.landed_at == 1 and torch.equal(ph.start, committed)
    assert torch.allclose(p.detach(), committed + 1.0)
    ph.land([p], 2)  # landed once only
    assert ph.landed_at == 1


def test_a_shifted_start_lands_exactly_before_any_step_and_the_committed_state_wins():
    from p2ptrain.train.phases import Phase

    p = torch.nn.Parameter(_vec(1, 50).clone())
    ph = Phase(p.detach().clone(), awaits_round=True)
    target = _vec(3, 50)
    ph.shift(target)
    ph.land([p], 0)  # before any inner step: the target itself, bit for bit
    assert torch.equal(p.detach(), target) and ph.shifted_at == 0 and ph.landed_at is None and ph.waiting()
    with torch.no_grad():
        p.add_(1.0)
    committed = _vec(2, 50)
    ph.post(committed)
    ph.shift(_vec(4, 50))  # after the committed state: dropped
    assert not ph.waiting()
    ph.land([p], 1)
    assert torch.equal(ph.start, committed) and ph.landed_at == 1
    assert torch.allclose(p.detach(), committed + 1.0)


def test_manifest_overlap_field_validated_and_in_the_run_id():
    from dataclasses import replace

    from p2ptrain.run.manifest import run_id
    from p2ptrain.run.spec import SpecError, TrainSpec

    base = TrainSpec(inner_steps=5, group_size=4, outer_lr=0.7, outer_momentum=0.9, seed=0, inner_lr=1e-3,
                     warmup=1, weight_decay=0.1, batch_size=2, seq_len=8, schedule="cosine", planned_outer_steps=3)
    assert base.overlap_scheme == "none" and "overlap" not in base.to_dict()  # old run ids unchanged
    for s in ("delayed", "eager"):
        t = replace(base, overlap=s)
        assert t.overlap_scheme == s and t.to_dict()["overlap"] == s
    ids = {run_id({"train": replace(base, overlap=s).to_dict()}) for s in (None, "delayed", "eager")}
    assert len(ids) == 3
    for bad in ("none", "streaming", 1):
        with pytest.raises(SpecError):
            replace(base, overlap=bad)
    with pytest.raises(SpecError, match="library run"):
        TrainSpec(inner_steps=5, group_size=4, outer_lr=0.7, outer_momentum=0.9, overlap="eager")
    # extendable phases: overlapped runs only, never fewer than H, absent (old ids) when unset
    ext = replace(base, overlap="eager", max_inner_steps=8)
    assert ext.to_dict()["max_inner_steps"] == 8 and "max_inner_steps" not in replace(base, overlap="eager").to_dict()
    assert run_id({"train": ext.to_dict()}) not in ids
    for bad in (dict(max_inner_steps=8), dict(overlap="eager", max_inner_steps=4),
                dict(overlap="eager", max_inner_steps=8.0)):
        with pytest.raises(SpecError, match="max_inner_steps"):
            replace(base, **bad)


class _FakeLocal:
    """What `run_phase` uses of a LocalModel; each inner step is recorded, and `on_step`
    runs after it (from the phase's thread, as the trio side would post)."""

    def __init__(self, H: int, max_H: int, on_step=None) -> None:
        self.H, self.max_H, self.batch, self.seq_len, self.seed = H, max_H, 1, 4, 0
        self.peer_id, self.device, self.ds, self.inner_done = b"peer", torch.device("cpu"), None, 0
        self.model = torch.nn.Linear(2, 2)
        self.steps: list[tuple[int, bool]] = []
        self.on_step = on_step

    def seek_schedule(self, phase):
        pass

    def inner_step(self, tokens, losses, schedule=True):
        self.steps.append((int(tokens), schedule))
        losses.append(torch.tensor(1.0))
        if self.on_step is not None:
            self.on_step(len(self.steps))


@pytest.mark.parametrize("post_after,want", [(None, 7), (2, 4), (5, 5)])
def test_a_phase_extends_while_its_round_is_in_flight_and_stops_when_it_lands(monkeypatch, post_after, want):
    """H = 4, max 7: a phase whose round has not landed keeps stepping (extra windows of its
    own, the schedule not advanced) up to max; one whose round landed stops at H, or at the
    first step boundary after the landing. A phase with no round in flight takes exactly H."""
    from p2ptrain.train import data
    from p2ptrain.train import phases as overlap

    monkeypatch.setattr(data, "train_batch", lambda ds, peer, window, *a: torch.tensor(window))
    start = torch.zeros(6)
    ph = overlap.Phase(start, awaits_round=True)
    local = _FakeLocal(4, 7, lambda n: ph.post(torch.zeros(6)) if n == post_after else None)
    mean, tokens, busy, steps = overlap.run_phase(local, 3, ph)
    assert steps == want == len(local.steps) and tokens == want * 4 and local.inner_done == want
    windows = [w for w, _ in local.steps]
    assert windows[:4] == [12, 13, 14, 15] and all(s for _, s in local.steps[:4])
    extra = local.steps[4:]
    assert all(not s and w >= overlap.EXTRA_WINDOWS for w, s in extra) and len(set(windows)) == len(windows)
    fixed = _FakeLocal(4, 7)
    assert overlap.run_phase(fixed, 3, overlap.Phase(start))[3] == 4  # no round in flight: exactly H


def _bench(avg: str, land: float, seed: int = 0, H: int = 4, extra: str = "", shift: int = 0) -> dict:
    from p2ptrain.bench.diloco import Settings, run_config

    st = Settings(steps=12, batch=2, seq_len=16, warmup=2, warm_start=0, eval_batches=1, eval_batch=4,
                  workers=2, overlap_land=land, overlap_extra=extra, overlap_shift=shift,
                  model=dict(d_model=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=16))
    return run_config(st, "diloco", H, avg, seed, None)


def test_bench_extendable_phases_train_extra_steps_only_before_a_late_landing():
    torch.set_num_threads(1)
    plain, ext = _bench("eager", 1.0), _bench("eager", 1.0, extra="0,2")
    assert ext["outer_sha256"] != plain["outer_sha256"] and np.isfinite(ext["val_loss"])
    assert _bench("eager", 1.0, extra="0,0")["outer_sha256"] == plain["outer_sha256"]
    with pytest.raises(ValueError, match="lands after the phase"):
        _bench("eager", 0.5, extra="0,2")


def test_bench_a_late_eager_start_changes_the_run_unless_the_average_lands_first():
    """`--overlap-shift K`: phases train from the last one's end until their eager start lands
    K steps in (the phase worker's hand-over); an average landing first supersedes it (landing
    before any step: synchronous DiLoCo, bit for bit)."""
    torch.set_num_threads(1)
    plain = _bench("eager", 1.0)
    late = _bench("eager", 1.0, shift=1)
    assert late["outer_sha256"] != plain["outer_sha256"] and np.isfinite(late["val_loss"])
    assert _bench("eager", 0.0, shift=1)["outer_sha256"] == _bench("fp32", 1.0)["outer_sha256"]
    for bad in (dict(avg="delayed", land=1.0, shift=1), dict(avg="eager", land=1.0, shift=4)):
        with pytest.raises(ValueError, match="shift"):
            _bench(**bad)


def test_bench_overlap_that_lands_at_once_is_synchronous_diloco_bit_for_bit():
    torch.set_num_threads(1)
    sync = _bench("fp32", 1.0)
    for scheme in ("delayed", "eager", "mixed"):
        assert _bench(scheme, 0.0)["outer_sha256"] == sync["outer_sha256"], scheme
        late = _bench(scheme, 1.0)  # a different, still finite trajectory
        assert late["outer_sha256"] != sync["outer_sha256"] and np.isfinite(late["val_loss"])


def test_mixed_stand_in_swaps_our_share_of_the_last_average_for_our_fresh_delta():
    last_own = torch.tensor([1.0, 2.0])
    others = torch.tensor([3.0, -2.0])
    last_avg = (last_own + others) / 2
    fresh = torch.tensor([5.0, 0.0])
    assert torch.equal(om.stand_in(fresh, last_avg, last_own, 2), (fresh + others) / 2)
    assert torch.equal(om.stand_in(fresh, None, None, 4), fresh / 4)  # nothing landed yet
    with pytest.raises(ValueError):
        om.stand_in(fresh, None, None, 0)
    x, m = torch.zeros(2), torch.zeros(2)
    g = om.stand_in(fresh, last_avg, last_own, 2)
    assert torch.equal(om.phase_start("mixed", x, m, x, fresh, 0.7, 0.9, guess=g), om.nesterov(x, m, g, 0.7, 0.9)[0])
    with pytest.raises(ValueError):
        om.phase_start("mixed", x, m, x, fresh, 0.7, 0.9)


def test_init_gives_eager_runs_the_outer_step_measured_best_for_them_unless_told():
    import argparse

    from p2ptrain.cli import init

    p = argparse.ArgumentParser()
    init.add_parser(p.add_subparsers())

    def spec(*extra):
        return init.build_spec(p.parse_args(["init", "--out", "x", *extra]), "0" * 64).train
    assert (spec().outer_lr, spec().outer_momentum) == (0.7, 0.9)
    eager = spec("--overlap", "eager")
    assert (eager.outer_lr, eager.outer_momentum, eager.overlap) == (0.5, 0.8, "eager")
    told = spec("--overlap", "eager", "--outer-lr", "0.7", "--outer-momentum", "0.9")
    assert (told.outer_lr, told.outer_momentum) == (0.7, 0.9)
    assert spec("--overlap", "delayed").outer_lr == 0.7
    # overlapped phases extend up to 2 H unless told; other runs have a fixed H
    assert eager.max_inner_steps == 2 * eager.inner_steps and spec().max_inner_steps is None
    assert spec("--overlap", "eager", "--max-inner-steps", "0").max_inner_steps is None
    assert spec("--overlap", "eager", "--max-inner-steps", "60").max_inner_steps == 60
    with pytest.raises(Exception, match="max_inner_steps"):
        spec("--max-inner-steps", "60")  # a sequential run cannot extend


def test_inner_phases_run_in_a_thread_of_their_own_at_lower_priority_and_errors_come_back():
    import os

    import trio

    from p2ptrain.train.phases import run_niced

    def probe(x):
        tid = threading.get_native_id()
        return x * 2, tid, os.getpriority(os.PRIO_PROCESS, tid)

    def boom():
        raise KeyError("inner step failed")

    async def main():
        base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        value, _, nice = await run_niced(5, probe, 21)
        assert value == 42 and nice == min(19, base + 5)
        # trio's reused worker threads keep their priority: the niced thread was not one of them
        assert (await trio.to_thread.run_sync(probe, 1))[2] == base
        assert (await run_niced(0, probe, 1))[2] == base  # 0: trio's worker thread, unchanged
        with pytest.raises(KeyError, match="inner step failed"):
            await run_niced(5, boom)

    trio.run(main)


def test_phase_worker_trains_on_while_the_hand_over_computes_the_next_start(monkeypatch):
    """Phase 1's round commits with go_on: the worker snapshots the params and trains phase 2
    at once, while the normal-priority hand-over thread computes the contribution and phase
    2's start point (slowly here), which lands at a step boundary of phase 2, moving the
    params by start - end. Phase 2's round does not go on: the worker lands and contributes
    through `finish` and waits for trio. Inner steps ran at nice +5."""
    import os
    import time

    import trio

    from p2ptrain.train import data
    from p2ptrain.train import phases

    monkeypatch.setattr(data, "train_batch", lambda ds, peer, window, *a: torch.tensor(window))
    prio = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # noqa: E731
    seen = {"step": set(), "turn": set(), "steps_at_turn": None}
    events = []

    class Local(_FakeLocal):
        def inner_step(self, tokens, losses, schedule=True):
            seen["step"].add(prio())
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(1.0)  # progress: one per step
            time.sleep(0.01)
            super().inner_step(tokens, losses, schedule)

    local = Local(2, 200)
    params = list(local.model.parameters())

    def turn(phase, end, nxt, no):
        seen["turn"].add(prio())
        assert torch.equal(nxt.start, end)
        time.sleep(0.1)  # a slow hand-over: phase 2 trains meanwhile
        seen["steps_at_turn"] = len(local.steps)
        nxt.shift(end + 100.0)
        return np.full(6, 7.0, np.float32)

    def finish(phase, steps):
        seen["turn"].add(prio())
        phase.land(params, steps)
        return np.zeros(6, np.float32)

    async def main():
        base = prio()
        send, recv = trio.open_memory_channel(10)
        worker = phases.PhaseWorker(local, turn, finish, 5, send, lambda e, **kw: events.append((e, kw)),
                                    lambda no: None)
        init = [p.detach().clone() for p in params]
        first = phases.Phase(torch.zeros(6), True)
        worker.submit(1, first)
        await trio.sleep(0.05)
        first.post(torch.zeros(6), go_on=True)
        no, res, ph, delta, nxt, _ = await recv.receive()
        assert (no, ph) == (1, first) and nxt is not None and res[3] >= 2 and delta[0] == 7.0
        assert seen["steps_at_turn"] > res[3]  # phase 2 trained while the hand-over ran
        await trio.sleep(0.05)  # the shift lands at phase 2's next step boundary
        nxt.post(nxt.start.clone(), go_on=False)  # lands as it is: a zero move
        no2, res2, ph2, _, nxt2, _ = await recv.receive()
        assert (no2, ph2, nxt2) == (2, nxt, None)
        assert nxt.shifted_at is not None and nxt.shifted_at >= 1 and nxt.landed_at >= nxt.shifted_at
        # every step added 1 and the shift 100, once: its offset, not a copy of its target
        moved = [p.detach() - i for p, i in zip(params, init)]
        assert all(torch.allclose(m, torch.full_like(m, res[3] + res2[3] + 100.0)) for m in moved)
        worker.stop()
        assert seen["step"] == {min(19, base + 5)} and seen["turn"] == {base}
        assert [kw["phase"] for e, kw in events if e == "inner_phase_started"] == [1, 2]

    trio.run(main)


def test_utilization_counts_whole_cycles_from_phase_starts():
    from p2ptrain.bench.utilization import measure

    def ev(kind, t, **kw):
        return {"event": kind, "t": t, **kw}
    # overlapped: phase p starts at 10p, trains 8 s; commits (reports) land at jittery times
    ovl = [ev("inner_phase_started", 10.0 * p, phase=p) for p in range(6)]
    ovl += [ev("inner_phase", 10.0 * p + 8, phase=p, seconds=8.0, steps=4) for p in range(6)]
    ovl += [ev("outer_step_committed", 10.0 * s + 3 + (s % 2) * 4, step=s, seconds_comm=1.0) for s in range(1, 6)]
    m = measure(ovl, 2, 5)  # phases 2, 3 over the cycles from t=20 to t=40
    assert m["utilization"] == 0.8 and m["wall_s"] == 20.0 and m["inner_step_ms"] == 2000.0
    assert m["utilization_commits"] != 0.8  # the commit window moves with the reports
    # sequential: the phase starts with outer_step_started
    seq = [ev("outer_step_started", 10.0 * p, step=p) for p in range(5)]
    seq += [ev("inner_phase", 10.0 * p + 5, phase=p, seconds=5.0, steps=4) for p in range(5)]
    seq += [ev("outer_step_committed", 10.0 * s + 1, step=s, seconds_comm=4.0) for s in range(1, 6)]
    assert measure(seq, 2, 5)["utilization"] == 0.5
