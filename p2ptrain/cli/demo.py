"""`p2ptrain demo`: the whole product on one machine, on the embedded default data.

Initiates a run (tiny model, the Python stdlib as text), starts a bootstrap and N peers as
separate processes (real libp2p on 127.0.0.1; the first publishes the run, the others join
by run id alone), trains for N outer steps, then reports per peer the outer steps committed
and final losses, a single-worker baseline's validation loss at the same compute, and the
bytes communicated against what data-parallel training would have sent. Writes a loss-curve
PNG. With --json, every peer's event lines are forwarded as they come, each with its own
`peer` id.
"""

from __future__ import annotations

import _thread
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from p2ptrain.cli.common import CLIError

H = 20
BATCH = 8
SEQ = 128


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run a whole training network locally (bootstrap + N peers)")
    p.add_argument("--peers", type=int, default=4, help="number of peers (default 4)")
    p.add_argument("--outer-steps", type=int, default=6, help="outer steps to train (default 6)")
    p.add_argument("--inner-steps", type=int, default=H, help=f"inner steps per outer step (default {H})")
    p.add_argument("--workdir", help="where the run, logs and plot go (default: a temporary directory)")
    p.add_argument("--no-baseline", action="store_true", help="skip the single-worker baseline")
    p.add_argument("--json", action="store_true", help="forward every peer's JSON events on stdout")
    p.add_argument("--dashboard", metavar="HOST:PORT", default="127.0.0.1:8080",
                   help="where the first peer serves the live dashboard (default 127.0.0.1:8080; "
                        "a free port if that one is taken)")
    p.add_argument("--no-dashboard", action="store_true", help="do not serve the dashboard")
    p.set_defaults(func=run)


def run(args) -> int:
    if not 1 <= args.peers <= 16:
        raise CLIError(f"--peers {args.peers} is out of range", "use 1 to 16 peers on one machine")
    if args.outer_steps < 1 or args.inner_steps < 1:
        raise CLIError("--outer-steps and --inner-steps must be >= 1")
    from p2ptrain.cli import workdir as wd

    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    # Absolute: init and every peer run with other working directories (issue 33).
    work = wd.prepare(args.workdir or tempfile.mkdtemp(prefix="p2ptrain-demo-"))
    held = wd.lock(work)  # noqa: F841 - one demo per workdir (each peer locks its own peerN below)
    dash = None if args.no_dashboard else _dashboard_addr(args.dashboard, say)
    tty = sys.stderr.isatty() and not args.json
    forward = _Forward() if args.json else None
    try:
        return _run(args, work, say, dash, tty, forward)
    except KeyboardInterrupt:
        if forward is not None and forward.closed:
            print("demo: stdout was closed; all processes stopped", file=sys.stderr, flush=True)
            return 141  # as a writer killed by SIGPIPE: `demo --json | head` ends the demo
        raise


class _Forward:
    """`demo --json`: each child's event on stdout as its line arrives (called from the
    children's reader threads). A reader that closed the pipe (`| head -n 1`) stops the demo
    the way Ctrl-C does, so the pipeline ends instead of training on for minutes unread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False

    def __call__(self, ev: dict) -> None:
        with self.lock:
            if self.closed:
                return
            try:
                sys.stdout.write(json.dumps(ev) + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):  # ValueError: stdout already closed here
                self.closed = True
                try:  # later writes (and the interpreter's exit flush) go nowhere, quietly
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, sys.stdout.fileno())
                except (OSError, ValueError):
                    pass
                _thread.interrupt_main()


def _run(args, work: Path, say, dash, tty: bool, forward) -> int:
    import subprocess

    from p2ptrain.procs import ProcessGroup

    say(f"demo: run, logs and plot in {work}")
    t0 = time.monotonic()
    init = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "init", "--out", str(work / "run"), "--key", str(work / "initiator.key"),
         "--inner-steps", str(args.inner_steps), "--batch-size", str(BATCH), "--seq-len", str(SEQ),
         "--planned-outer-steps", str(args.outer_steps), "--group-size", str(args.peers),
         "--join-window", "20", "--warmup", str(args.inner_steps)],
        capture_output=True, text=True, cwd=work)
    if init.returncode != 0:
        raise CLIError(f"init failed: {init.stderr.strip().splitlines()[-1] if init.stderr.strip() else init.returncode}")
    rid = init.stdout.strip().splitlines()[-1]
    say(f"demo: run {rid[:16]}... initiated (tiny Llama-style model, Python stdlib as training text)")
    committed: dict[str, list[dict]] = {}
    with ProcessGroup(work / "logs") as group:
        boot = group.start(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(work / "bootstrap.key"),
                            "--json"], "bootstrap", on_event=forward)
        baddr = boot.first_line(60)
        say(f"demo: bootstrap at {baddr}")
        peers = []
        for i in range(args.peers):
            which = ["--manifest", str(work / "run" / "run.toml")] if i == 0 else ["--run", rid]
            if i == 0 and dash:
                which += ["--dashboard", dash]
            peers.append(group.start(["join", "--bootstrap", baddr, "--listen", "/ip4/127.0.0.1/tcp/0",
                                      "--workdir", str(work / f"peer{i}"), *which, "--min-peers", str(args.peers),
                                      "--max-outer-steps", str(args.outer_steps), "--threads", "1", "--json"],
                                     f"peer{i}", on_event=forward))
        if dash:  # the first peer serves it before its node starts listening
            url = peers[0].wait_event(lambda e: e["event"] == "dashboard_listening", 120)["url"]
            say(f"demo: live dashboard at {url} (open it in a browser while the demo runs)")
        ids = [p.wait_event(lambda e: e["event"] == "listening", 120)["peer"] for p in peers]
        committed = {pid: [] for pid in ids}
        deadline = time.monotonic() + 120 + 60 * args.outer_steps
        while time.monotonic() < deadline and any(p.proc.poll() is None for p in peers):
            for p, pid in zip(peers, ids):
                try:
                    ev = p.wait_event(lambda e: e["event"] in ("outer_step_committed", "left"), 0.1)
                except (TimeoutError, RuntimeError):
                    continue
                if ev["event"] == "outer_step_committed":
                    committed[pid].append(ev)
                    line = (f"step {ev['step']:>3}  peer {pid[-6:]}  val {ev['val_loss']:.4f}  "
                            f"params {ev['params_sha256'][:12]}  inner {ev['seconds_inner']:.1f}s "
                            f"comm {ev['seconds_comm']:.1f}s")
                    say(("\r" if tty else "") + line)
        for p in peers:
            p.proc.wait(30) if p.proc.poll() is None else None
    return report(args, work, rid, ids, committed, say, time.monotonic() - t0)


def report(args, work: Path, rid: str, ids: list[str], committed: dict[str, list[dict]], say, seconds: float) -> int:
    from p2ptrain.plot import line_chart

    steps_done = {pid: len(evs) for pid, evs in committed.items()}
    say(f"\n{'peer':<54}{'steps':>6}{'train loss':>12}{'val loss':>10}")
    for pid in ids:
        evs = committed[pid]
        last = evs[-1] if evs else {}
        tl, vl = last.get("loss"), last.get("val_loss")
        tl_s = f"{tl:.4f}" if tl is not None else "-"
        vl_s = f"{vl:.4f}" if vl is not None else "-"
        say(f"{pid:<54}{steps_done[pid]:>6}{tl_s:>12}{vl_s:>10}")
    by_step: dict[int, list[dict]] = {}
    for evs in committed.values():
        for e in evs:
            by_step.setdefault(e["step"], []).append(e)
    identical = all(len({e["params_sha256"] for e in evs}) == 1 for evs in by_step.values())
    sent = sum(e["bytes_sent"] for evs in committed.values() for e in evs)
    n_params = _n_params(work)
    inner_total = sum(len(evs) for evs in committed.values()) * args.inner_steps
    # Data-parallel: every inner step each peer all-reduces fp32 gradients over a ring.
    w = max(1, len(ids))
    dp = inner_total * 2 * (w - 1) / w * 4 * n_params
    base = None
    if not args.no_baseline and committed and inner_total:
        say(f"\ndemo: single-worker baseline, {inner_total} inner steps (the same compute)...")
        base = _baseline(work, inner_total)
    val_curve = [(s, sum(e["val_loss"] for e in evs) / len(evs)) for s, evs in sorted(by_step.items())]
    train_curve = [(s, sum(e["loss"] for e in evs if e["loss"] is not None) /
                    max(1, sum(e["loss"] is not None for e in evs))) for s, evs in sorted(by_step.items())]
    series = {"train loss": train_curve, "val loss": val_curve}
    if base is not None and val_curve:
        series["1 worker val"] = [(val_curve[0][0], base), (val_curve[-1][0], base)]
    png = line_chart(series, work / "loss.png", title=f"diloco {len(ids)} peers, x = outer step")
    say("")
    say(f"identical parameters on every peer after every step: {identical}")
    if val_curve:
        say(f"validation loss: {val_curve[0][1]:.4f} after step 1 -> {val_curve[-1][1]:.4f} after step {val_curve[-1][0]}")
    if base is not None:
        say(f"single worker, same compute: validation loss {base:.4f}")
    if sent:
        say(f"bytes sent: {sent / 1e6:.1f} MB in all; data-parallel would have sent {dp / 1e6:.1f} MB "
            f"({dp / sent:.0f}x more)")
    say(f"loss curve: {png}")
    say(f"demo finished in {seconds:.0f}s; all processes stopped")
    ok = identical and all(steps_done[p] >= 1 for p in ids)
    return 0 if ok else 1


def _dashboard_addr(addr: str, say) -> str:
    """`addr`, or the same host with a free port when something already listens there."""
    import socket

    from p2ptrain.dashboard.server import parse_listen

    try:
        host, port = parse_listen(addr)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if port == 0:
        return addr
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            say(f"demo: {addr} is taken; the dashboard gets a free port instead")
            return f"{host}:0"
    return addr


def _n_params(work: Path) -> int:
    from p2ptrain.run import manifest as mf
    from p2ptrain.run.spec import RunSpec
    from p2ptrain.train.model import ModelConfig

    spec = RunSpec.from_dict(mf.read(work / "run" / "run.toml")[0])
    return ModelConfig.from_dict(spec.model.config).num_params()


def _baseline(work: Path, steps: int) -> float:
    """One worker, same model, data and optimizer, `steps` AdamW steps from genesis."""
    import numpy as np

    from p2ptrain.run import manifest as mf
    from p2ptrain.identity import Identity
    from p2ptrain.train.local import LocalModel, load_run_data

    from dataclasses import replace

    from p2ptrain.run.spec import RunSpec

    spec = RunSpec.from_dict(mf.read(work / "run" / "run.toml")[0])
    m = replace(spec, train=replace(spec.train, inner_steps=steps, planned_outer_steps=1))
    ds = load_run_data(m)
    genesis = (work / "run" / "genesis.p2ck").read_bytes()
    local = LocalModel(m, ds, Identity.from_seed(b"\x07" * 32).peer_id, genesis, threads=1)
    local.inner()
    val = local.evaluate()
    return float(val) if math.isfinite(val) else float(np.nan)
