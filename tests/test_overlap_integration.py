"""Issue 17 end to end: a bootstrap and 3 real trainer processes on 127.0.0.1 train a run
initialised with `--overlap eager`: the inner steps of phase t+1 start before round t commits,
the committed params are identical on every member after every step, and the loss falls."""

from __future__ import annotations


import numpy as np
import pytest

from conftest import start_bootstrap
from p2ptrain.identity import load_or_create
from test_training_integration import committed, start_trainers
from p2ptrain.procs import run as run_cli

pytestmark = pytest.mark.integration
STEPS = 4


def _init_overlap(d, inner_steps: int, planned: int, *extra: str):
    out = run_cli(
        ["init", "--out", str(d / "run"), "--key", str(d / "initiator.key"),
         "--inner-steps", str(inner_steps), "--batch-size", "4", "--seq-len", "64", "--warmup", "5",
         "--planned-outer-steps", str(planned), "--join-window", "20", "--group-size", "4", "--seed", "3",
         "--overlap", "eager", *extra],
        timeout=300, cwd=d)
    assert out.returncode == 0, out.stderr
    assert 'overlap = "eager"' in (d / "run" / "run.toml").read_text()
    return d / "run", out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def overlap_run(tmp_path_factory):
    return _init_overlap(tmp_path_factory.mktemp("overlap-run"), 6, 6)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("overlap-keys")
    paths = [d / f"peer{i}.key" for i in range(3)]
    for p in paths:
        load_or_create(p)
    return paths


def test_three_peers_overlapped_run_identical_params_loss_falls(procs, overlap_run, keys):
    boot, baddr = start_bootstrap(procs)
    peers = start_trainers(procs, baddr, overlap_run, keys, 3, STEPS)
    steps = [[committed(p, s) for p in peers] for s in range(1, STEPS + 1)]
    for evs in steps:
        assert len({e["params_sha256"] for e in evs}) == 1, evs  # bit-identical committed state
        assert all(len(e["members"]) == 3 for e in evs), evs
    val = [evs[0]["val_loss"] for evs in steps]
    assert val[-1] < val[0], val
    for p in peers:
        evs = p.all_events
        started = {e["phase"]: e["t"] for e in evs if e["event"] == "inner_phase_started"}
        done = {e["step"]: e["t"] for e in evs if e["event"] == "outer_step_committed"}
        # overlap: phase t+1's inner steps began before round t committed (state step t+1)
        for t in range(STEPS):
            assert started[t + 1] <= done[t + 1], (t, started, done)
        phases = [e for e in evs if e["event"] == "inner_phase"]
        assert {e["phase"] for e in phases} >= set(range(STEPS)), phases
        assert all(e["seconds"] > 0 for e in phases)


@pytest.mark.parametrize("which", ["overlap_run", "stream_run"])
def test_peer_killed_mid_run_the_others_go_on_without_it_and_never_fork(procs, which, keys, report, request):
    """The survivors commit every step from the kill on, as a pair, their params identical at
    every step. The dead peer no stream opens to is silent at once in a roster confirmation,
    and an election expecting it finds it gone instead of waiting out the join window. Before (xfail until this session): survivors that left a failed
    attempt seconds apart gave up on each other and stalled, one rejected the other for a
    missing header, and a refused bulk session ended a node with an ExceptionGroup. Then
    (under a loaded machine): the survivors found the dead member at different attempts, the
    one still naming it was taken for another view, both skipped and waited `retry_wait`
    (tests/test_round_memory.py, the crashed-member-at-different-attempts test)."""
    import signal

    boot, baddr = start_bootstrap(procs)
    peers = start_trainers(procs, baddr, request.getfixturevalue(which), keys, 3, 8)
    for s in (1, 2):
        evs = [committed(p, s) for p in peers]
        assert len({e["params_sha256"] for e in evs}) == 1
    peers[2].kill(signal.SIGKILL)
    alive = peers[:2]
    pairs = [(2, 3, round(evs[0]["t"], 2))]
    for s in range(3, 9):
        evs = [committed(p, s, timeout=120) for p in alive]
        assert len({e["params_sha256"] for e in evs}) == 1, (s, evs)  # never two states for one step
        pairs.append((s, len(evs[0]["members"]), round(evs[0]["t"], 2)))
        if len(evs[0]["members"]) == 2 and len(pairs) >= 2 and pairs[-2][1] == 2:
            break
    two = [s for s, n, _ in pairs if n == 2]
    assert two, pairs  # the survivors committed steps as a group of two
    gaps = [round(b[2] - a[2], 2) for a, b in zip(pairs, pairs[1:])]
    report(f"{which}, peer killed after step 2: (step, members) {[(s, n) for s, n, _ in pairs]}, "
           f"seconds between commits {gaps} (join window 20 s)")
    assert max(gaps, default=0) < 15, gaps  # a dead peer is found gone, not waited out (window 20 s)


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory):
    return _init_overlap(tmp_path_factory.mktemp("stream-run"), 6, 12, "--fragments", "2")


def test_streaming_run_reduces_one_fragment_per_step_identically_on_every_member(procs, stream_run, keys):
    """`init --fragments 2` (Streaming DiLoCo): phases of H / P = 3 steps, and outer step t
    reduces fragment t mod 2 only. Every member commits the same params at every step, and
    between two committed states only that step's fragment of the params and momentum moved
    (read back from a member's checkpoints)."""
    from p2ptrain.ckpt import checkpoint
    from p2ptrain.run.runner import checkpoint_dir
    from p2ptrain.train import fragments

    run_path, rid = stream_run
    assert "fragments = 2" in (run_path / "run.toml").read_text()
    boot, baddr = start_bootstrap(procs)
    peers = start_trainers(procs, baddr, stream_run, keys, 3, STEPS)
    steps = [[committed(p, s) for p in peers] for s in range(1, STEPS + 1)]
    for evs in steps:
        assert len({e["params_sha256"] for e in evs}) == 1, evs
        assert all(len(e["members"]) == 3 for e in evs), evs
    assert steps[-1][0]["val_loss"] < steps[0][0]["val_loss"], [evs[0]["val_loss"] for evs in steps]
    assert {e["steps"] for e in peers[0].all_events if e["event"] == "inner_phase"} >= {3}  # H / P
    if not any(e["event"] == "checkpoint_written" and e["step"] == STEPS for e in peers[0].all_events):
        peers[0].wait_event(lambda e: e["event"] == "checkpoint_written" and e["step"] == STEPS, 60)
    states = {}
    for path in sorted(checkpoint_dir(procs.log_dir / "p0", rid).glob("step-*.p2ck")):
        arrays, meta = checkpoint.decode(path.read_bytes())
        states[meta["outer_step"]] = arrays
    assert len(states) >= 2, sorted(states)
    for t in sorted(states)[:-1]:
        if t + 1 not in states:
            continue
        a, b = states[t], states[t + 1]
        n = a["outer"].size
        moved = np.flatnonzero((a["outer"] != b["outer"]) | (a["momentum"] != b["momentum"]))
        frag = fragments.index(n, 2, t % 2)
        assert moved.size > 0 and np.isin(moved, frag).all(), (t, moved.size, frag.size)


@pytest.fixture(scope="module")
def slow_overlap_run(tmp_path_factory):
    """An overlapped run whose outer steps (H = 40) take longer than a newcomer's catch-up, as
    on real links: with 1-2 s steps a joiner's checkpoint fetch is always a step behind."""
    return _init_overlap(tmp_path_factory.mktemp("overlap-run-h40"), 40, 20)


@pytest.fixture(scope="module")
def slow_stream_run(tmp_path_factory):
    """The same with streaming steps (--fragments 2: phases of 20 steps, half the payload)."""
    return _init_overlap(tmp_path_factory.mktemp("stream-run-h40"), 40, 20, "--fragments", "2")


@pytest.mark.parametrize("which", ["slow_overlap_run", "slow_stream_run"])
def test_newcomer_joins_an_overlapped_run_and_commits_identically(procs, which, keys, request):
    """A peer that starts after the others announces itself one step ahead, adopts that
    step's state, contributes zeros to its first round while its first phase trains, and
    then commits the same params as the others (streaming: zeros of its step's fragment)."""
    run = request.getfixturevalue(which)
    boot, baddr = start_bootstrap(procs)
    first = start_trainers(procs, baddr, run, keys[:2], 2, 200)  # still training when it joins
    [committed(p, 1) for p in first]
    run_path, rid = run
    work = procs.log_dir / "late"
    work.mkdir(parents=True, exist_ok=True)
    late = procs.start(["join", "--bootstrap", baddr, "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(keys[2]),
                        "--workdir", str(work), "--run", rid, "--max-outer-steps", "2", "--threads", "1",
                        "--json"], "late")
    joined = late.wait_event(lambda e: e["event"] == "outer_step_committed" and len(e["members"]) == 3, 240)
    step = joined["step"]
    evs = [committed(p, step) for p in first]
    assert {e["params_sha256"] for e in evs} == {joined["params_sha256"]}, (joined, evs)
    nxt = [committed(p, step + 1) for p in [*first, late]]
    assert len({e["params_sha256"] for e in nxt}) == 1 and all(len(e["members"]) == 3 for e in nxt), nxt
