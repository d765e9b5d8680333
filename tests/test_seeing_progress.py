"""Issue 33 item 6, seeing progress: the effective configuration and its sources, an ETA and
the total, log lines that do not tear the progress bar, quiet stderr in human mode, `status`
without --run, and presence withdrawn on a clean exit."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from conftest import trio_test
from p2ptrain.config import describe, resolve
from p2ptrain.net.node import NodeConfig
from p2ptrain.procs import run as run_cli


def test_resolve_records_each_values_source_without_changing_precedence():
    sources: dict = {}
    toml = {"node": {"dial_timeout": 7.0, "bootstrap_timeout": 9.0, "max_connections": 10}}
    env = {"P2PTRAIN_NODE_BOOTSTRAP_TIMEOUT": "3", "P2PTRAIN_NODE_MAX_CONNECTIONS": "12"}
    cfg = resolve(NodeConfig, {"max_connections": 20, "announce": None}, toml, "node", env, sources=sources)
    assert (cfg.max_connections, cfg.bootstrap_timeout, cfg.dial_timeout) == (20, 3.0, 7.0)
    rows = {n: (v, s) for n, v, s in describe(cfg, sources, "node")}
    assert rows["[node] max_connections"] == (20, "flag")
    assert rows["[node] bootstrap_timeout"] == (3.0, "$P2PTRAIN_NODE_BOOTSTRAP_TIMEOUT")
    assert rows["[node] dial_timeout"] == (7.0, "file [node]")
    assert rows["[node] announce"] == ([], "default")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_show_config_prints_every_setting_and_its_source(tmp_path):
    (tmp_path / "p.toml").write_text("[node]\ndial_timeout = 0.5\n")
    boot = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/12D3KooWGRUVh8bSMBbScx1EP8VmD8zCYvUBNgsJShqxnvnP4ycz"
    env = {**os.environ, "P2PTRAIN_NODE_BOOTSTRAP_TIMEOUT": "1"}
    for flag in ("--show-config", "-v"):
        args = ([flag] if flag == "-v" else []) + ["status", "--bootstrap", boot, "--config", str(tmp_path / "p.toml")]
        args += [flag] if flag != "-v" else []
        r = run_cli([*args], timeout=60,
                    cwd=tmp_path, env=env)
        assert r.returncode == 2, r.stderr  # nobody at the bootstrap: after the configuration is shown
        err = r.stderr
        assert "effective configuration" in err, err
        assert "[node] bootstrap_timeout = 1.0  ($P2PTRAIN_NODE_BOOTSTRAP_TIMEOUT)" in err
        assert "[node] dial_timeout      = 0.5  (file [node])" in err
        assert f"[node] bootstrap         = ['{boot}']  (flag)" in err
        assert "[node] max_connections   = 64  (default)" in err
    quiet = subprocess.run([sys.executable, "-m", "p2ptrain", "status", "--bootstrap", boot], capture_output=True,
                           text=True, timeout=60, cwd=tmp_path, env=env)
    assert "effective configuration" not in quiet.stderr


_NOISE = r"""
import logging, sys, trio, multiaddr
from libp2p.transport.tcp.tcp import TCP
from p2ptrain.events import EventSink, setup_logging
setup_logging("-v" in sys.argv)
events = EventSink("me", "--json" in sys.argv)
events.emit("step_timing", step=3, seconds={"ready": 0.01, "elect": 0.2})
events.emit("checkpoint_snapshot", step=3, seconds=0.01, bytes=100)
events.emit("checkpoint_written", step=3, seconds=0.02)
events.emit("outer_step_committed", step=4, loss=4.25, val_loss=4.5, params_sha256="ab" * 32, members=["a", "b"])
events.emit("outer_step_skipped", step=5, reason="no round committed")
events.emit("checkpoint_failed", step=5, reason="disk full", resume_from=4)

async def dial():
    try:
        await TCP().dial(multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/%s"))
    except Exception as exc:
        print("dial raised", type(exc).__name__, file=sys.stderr)
trio.run(dial)
"""


def _noise(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NOISE % _closed_port(), *flags], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_human_stderr_shows_what_a_person_needs_and_debug_shows_everything():
    r = _noise()
    assert "step 4 committed: loss 4.2500 val 4.5000 2 member(s)" in r.stderr
    assert "outer_step_skipped step=5 reason=no round committed" in r.stderr
    assert "W p2ptrain: checkpoint_failed step=5 reason=disk full" in r.stderr
    assert "dial raised OpenConnectionError" in r.stderr  # the dialler still hears of it
    for noise in ("step_timing", "checkpoint_snapshot", "checkpoint_written", "Failed to open TCP stream", "{'ready'"):
        assert noise not in r.stderr, r.stderr
    for loud in (_noise("-v"), _noise(env={"P2PTRAIN_DEBUG": "1"})):
        for line in ("step_timing step=3", "checkpoint_snapshot step=3", "checkpoint_written step=3",
                     "Failed to open TCP stream"):
            assert line in loud.stderr, loud.stderr
    js = _noise("--json")
    assert [line.split('"event": "')[1].split('"')[0] for line in js.stdout.splitlines()] == [
        "step_timing", "checkpoint_snapshot", "checkpoint_written", "outer_step_committed", "outer_step_skipped",
        "checkpoint_failed"]


RUN = "r" * 16


def test_presence_records_round_trip_and_hostile_run_names_are_dropped():
    import msgpack

    from p2ptrain.records.codecs import RecordError, decode_presence, encode_presence

    info = decode_presence(encode_presence(["/ip4/1.2.3.4/tcp/5"], "trainer", run=RUN))
    assert info == {"addrs": ["/ip4/1.2.3.4/tcp/5"], "role": "trainer", "conns": {}, "run": RUN, "left": False}
    gone = decode_presence(encode_presence(["/ip4/1.2.3.4/tcp/5"], "trainer", {"x": "direct"}, run=RUN, left=True))
    assert gone["left"] and gone["addrs"] == [] and gone["conns"] == {}
    with pytest.raises(RecordError):  # `status` prints it
        decode_presence(encode_presence([], "peer", run="\x1b[2J" + RUN))
    with pytest.raises(RecordError):  # no loose types
        decode_presence(msgpack.packb({"addrs": [], "role": "peer", "left": 1}))


@trio_test()
async def test_status_sees_training_peers_and_runs_and_a_clean_exit_shows_offline_at_once():
    import io

    import trio

    from p2ptrain.cli.status import namespace_lines
    from p2ptrain.events import EventSink
    from p2ptrain.net.presence import Presence, PresenceConfig
    from p2ptrain.records import RunRecords

    def read_peers(node, namespace):
        return RunRecords(node, namespace).read_presence()
    from test_dht_memory import join_all, make_swarm

    net, nodes = make_swarm(8)
    await join_all(nodes)
    trainer, idler, reader = nodes[1], nodes[2], nodes[5]
    ids = {n: n.identity.peer_id_str for n in nodes}
    sink = lambda n: EventSink(ids[n], True, out=io.StringIO())  # noqa: E731
    async with trio.open_nursery() as nursery:
        for n in nodes:
            await nursery.start(n.run)
        training = Presence(trainer, ["/ip4/127.0.0.1/tcp/1"],
                            sink(trainer), PresenceConfig(namespace=RUN), role="trainer")
        idle = Presence(idler, ["/ip4/127.0.0.1/tcp/2"], sink(idler), PresenceConfig(), role="peer")
        scope_t, scope_i = trio.CancelScope(), trio.CancelScope()

        async def run_in(scope, presence, *, task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await presence.run(task_status=task_status)

        await nursery.start(run_in, scope_t, training)
        await nursery.start(run_in, scope_i, idle)
        lobby = await read_peers(reader, "lobby")
        assert set(lobby) == {ids[trainer], ids[idler]}
        assert lobby[ids[trainer]]["run"] == RUN and lobby[ids[idler]]["run"] is None
        assert set(await read_peers(reader, RUN)) == {ids[trainer]}
        text = "\n".join(namespace_lines("lobby", lobby))
        assert f"run {RUN}: 1 peer(s) training (p2ptrain status --run {RUN})" in text
        assert f"{ids[trainer]}  trainer run {RUN} /ip4/127.0.0.1/tcp/1" in text

        await trio.sleep(30)  # well into the records' 90 s life
        left_at = trio.current_time()
        scope_t.cancel()  # a clean exit (Ctrl-C, max steps): the task is cancelled
        await trio.sleep(0)
        with trio.fail_after(60):
            while ids[trainer] in await read_peers(reader, "lobby"):
                await trio.sleep(0.5)
        assert trio.current_time() - left_at < 5
        assert await read_peers(reader, RUN) == {}
        assert set(await read_peers(reader, "lobby")) == {ids[idler]}
        await trio.sleep(200)  # the "left" records are not re-stored, and nothing comes back
        assert set(await read_peers(reader, "lobby")) == {ids[idler]} and await read_peers(reader, RUN) == {}
        nursery.cancel_scope.cancel()


def test_goal_pace_and_eta():
    from p2ptrain.train.progress import Pace, goal, step_label

    assert goal(3, 40, 10, 100) == (3, 10)  # --max-outer-steps counts this peer's commits
    assert goal(3, 40, 0, 100) == (40, 100)  # else the run's planned schedule
    assert goal(3, 140, 0, 100) is None and goal(3, 40, 0, None) is None
    assert step_label(40, (3, 10)) == "outer step 40 (4 of 10)" and step_label(40, None) == "outer step 40"
    pace = Pace(10, 100, window=3)
    bar = pace.bar(40, 0, 40, False, 100.0)  # the first inner phase starts the clock
    assert bar.label == "outer step 40 (1 of 10)" and bar.eta() is None
    assert pace.eta(5, 101.0) is None
    assert pace.commit(1, 41, 110.0) == {"goal_done": 1, "goal_total": 10, "step_seconds": 10.0, "eta_seconds": 90.0}
    for k, t in ((2, 120.0), (3, 130.0)):
        pace.commit(k, 40 + k, t)
    assert pace.step_seconds() == 10.0
    assert pace.eta(7, 130.0) == 70.0 and pace.eta(7, 134.0) == 66.0 and pace.eta(0, 134.0) == 0.0
    assert pace.eta(7, 145.0) == 60.0  # the current step runs long: the six after it still count
    assert pace.commit(4, 44, 170.0) == {"goal_done": 4, "goal_total": 10, "step_seconds": 20.0,
                                         "eta_seconds": 120.0}  # slower now: the window forgets old steps
    assert pace.bar(44, 4, 44, False, 171.0).label == "outer step 44 (5 of 10)"
    ahead = pace.bar(45, 4, 44, False, 172.0)  # overlapped: step 45's phase trains while 44 commits
    assert ahead.label == "outer step 45 (6 of 10)" and ahead.eta() is not None
    pace.commit(5, 45, time.monotonic())  # the ETA the bar shows counts from the newest commit
    assert ahead.eta() == pytest.approx(5 * pace.step_seconds(), abs=1.0)
    assert pace.bar(44, 4, 44, True, 171.0) is None  # --json: the events are the output
    plain = Pace()  # no goal: no k of N, no ETA
    assert plain.commit(1, 5, 10.0) == {} and plain.bar(5, 1, 5, False, 11.0).label == "outer step 5"
    planned = Pace(0, 100)
    planned.commit(1, 41, 0.0)
    assert planned.commit(2, 42, 30.0) == {"goal_done": 42, "goal_total": 100, "step_seconds": 30.0,
                                           "eta_seconds": 58 * 30.0}


def test_bar_and_log_lines_say_k_of_n_with_an_eta(caplog):
    import io
    import logging

    from p2ptrain.events import human
    from p2ptrain.train.progress import Progress

    out = io.StringIO()
    bar = Progress("outer step 40 (4 of 10)", "inner steps", tty=True, out=out, eta=lambda: 75.0)
    for i in range(1, 6):
        bar(i, 5)
    assert out.getvalue().endswith("outer step 40 (4 of 10): [" + "#" * 30 + "] 5/5 inner steps, ETA 1m15s\n")
    caplog.set_level(logging.INFO, logger="p2ptrain.train.progress")
    logged = Progress("outer step 40 (4 of 10)", "inner steps", tty=False, out=io.StringIO(), eta=lambda: 3700.0)
    logged(5, 5)
    assert caplog.messages[-1] == "outer step 40 (4 of 10): 5/5 inner steps (100%), ETA 1h01m"
    line = human("outer_step_committed", {"step": 41, "loss": 3.5, "val_loss": 3.75, "params_sha256": "c" * 64,
                                          "members": ["a", "b", "c"], "goal_done": 4, "goal_total": 10,
                                          "step_seconds": 12.5, "eta_seconds": 75.0})
    assert line == ("step 41 committed (4 of 10): loss 3.5000 val 3.7500 3 member(s) 12.5 s/step ETA 1m15s "
                    "params cccccccccccc")


_TORN = r"""
import logging, sys, threading
from p2ptrain.events import setup_logging
from p2ptrain.train.progress import Progress
import p2ptrain.train.progress as pr
pr.REDRAW = 0.0
setup_logging()
log = logging.getLogger("p2ptrain.test")
bar = Progress("outer step 3", "inner steps", tty=True)
for i in range(1, 11):
    bar(i, 10)
    if i in (3, 7):  # from another thread, as records come while the worker thread draws
        t = threading.Thread(target=log.warning, args=("peer %s is slow", i))
        t.start(); t.join()
log.warning("after the bar")
"""


def _screen(raw: str) -> list[str]:
    """What a terminal shows for `raw`: \r returns to the line's start, ESC[K erases to its end."""
    lines, cur, col, i = [], [], 0, 0
    while i < len(raw):
        if raw.startswith("\x1b[K", i):
            del cur[col:]
            i += 3
            continue
        c = raw[i]
        if c == "\r":
            col = 0
        elif c == "\n":
            lines.append("".join(cur))
            cur, col = [], 0
        else:
            cur[col:col + 1] = [c]
            col += 1
        i += 1
    if cur:
        lines.append("".join(cur))
    return lines


def test_log_lines_print_above_the_bar_not_into_it():
    r = subprocess.run([sys.executable, "-c", _TORN], capture_output=True, timeout=60)  # bytes: keep the \r
    assert r.returncode == 0, r.stderr
    screen = _screen(r.stderr.decode())
    assert len(screen) == 4, screen
    for line, said in zip(screen, ("peer 3 is slow", "peer 7 is slow", None, "after the bar")):
        if said is not None:  # a whole log line of its own, no bar in it
            assert re.fullmatch(r"\d\d:\d\d:\d\d W p2ptrain\.test: " + said, line), screen
    assert screen[2] == "outer step 3: [" + "#" * 30 + "] 10/10 inner steps"


@pytest.mark.integration
def test_a_clean_exit_shows_offline_at_once_over_real_libp2p(procs, tmp_path):
    """The withdrawal runs while the node is being cancelled: its host must still be up
    (Node.on_leave), which only real libp2p shows."""
    import json
    import signal
    import time

    from conftest import start_bootstrap, start_peer

    _, boot = start_bootstrap(procs)
    peer = start_peer(procs, boot, "p")
    me = peer.wait_event(lambda e: e["event"] == "listening", 60)["peer"]

    def lobby() -> set:
        r = run_cli(["status", "--bootstrap", boot, "--json"],
                    timeout=60, cwd=tmp_path)
        return {p["remote"] for p in json.loads(r.stdout.splitlines()[-1])["peers"]}

    deadline = time.monotonic() + 30
    while me not in lobby():
        assert time.monotonic() < deadline
        time.sleep(0.5)
    peer.kill(signal.SIGINT)
    peer.proc.wait(15)
    assert peer.proc.returncode == 0
    assert me not in lobby()  # not up to PresenceConfig.ttl (90 s) later
    human = subprocess.run([sys.executable, "-m", "p2ptrain", "status", "--bootstrap", boot], capture_output=True,
                           text=True, timeout=60, cwd=tmp_path)
    assert human.stdout.startswith("0 peer(s) in 'lobby':") and human.stderr == ""  # the answer, no client chatter
