"""`p2ptrain demo`: a whole local network on this machine, as separate processes.

Starts a bootstrap and N peers on 127.0.0.1 (real libp2p, real processes), waits until every
peer has found every other through the DHT, shows what each sees, and shuts down cleanly.
With --json, every child's event lines are forwarded, each tagged with its own peer id.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from p2ptrain.cli.common import CLIError


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run a bootstrap and N peers locally and show the network")
    p.add_argument("--peers", type=int, default=3, help="number of peers (default 3)")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for discovery")
    p.add_argument("--workdir", help="where logs and keys go (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="forward every peer's JSON events")
    p.set_defaults(func=run)


def run(args) -> int:
    from p2ptrain.procs import ProcessGroup

    if not 1 <= args.peers <= 32:
        raise CLIError(f"--peers {args.peers} is out of range", "use 1 to 32 peers on one machine")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="p2ptrain-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    say(f"demo: logs and keys in {work}")
    t0 = time.monotonic()
    with ProcessGroup(work) as group:
        boot = group.start(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key",
                            str(work / "bootstrap.key"), "--json"], "bootstrap")
        baddr = boot.first_line(60)
        say(f"demo: bootstrap at {baddr}")
        peers = [group.start(["join", "--bootstrap", baddr, "--listen", "/ip4/127.0.0.1/tcp/0",
                              "--workdir", str(work / f"peer{i}"), "--json"], f"peer{i}")
                 for i in range(args.peers)]
        ids = [p.wait_event(lambda e: e["event"] == "listening", 60)["peer"] for p in peers]
        seen: dict[str, set[str]] = {pid: set() for pid in ids}
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline and any(seen[i] < set(ids) - {i} for i in ids):
            for p, pid in zip(peers, ids):
                try:
                    ev = p.wait_event(lambda e: e["event"] == "peer_discovered", 0.1)
                except TimeoutError:
                    continue
                seen[pid].add(ev["remote"])
        if args.json:
            for p in [boot, *peers]:
                for ev in p.all_events:
                    print(json.dumps(ev))
    ok = all(seen[i] >= set(ids) - {i} for i in ids)
    say(f"\n{'peer':<54} {'found':>5}  of {len(ids) - 1}")
    for pid in ids:
        say(f"{pid:<54} {len(seen[pid] & set(ids)):>5}")
    say(f"\ndemo: {'every peer found every other' if ok else 'discovery INCOMPLETE'} "
        f"in {time.monotonic() - t0:.1f}s; all processes stopped")
    return 0 if ok else 1
