"""`p2ptrain status`: the network as a short-lived DHT client sees it."""

from __future__ import annotations

import json
import sys

from p2ptrain.cli.common import CLIError, add_node_args, node_config, run_id_arg, run_service, show_config


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="show the peers the network knows about")
    p.add_argument("--bootstrap", action="append", metavar="MADDR", help="entry point /ip4/ADDRESS/tcp/PORT/p2p/<id> or /dns4/HOST/... (repeatable)")
    p.add_argument("--namespace", default="lobby", help="presence namespace (a run id, or 'lobby')")
    p.add_argument("--run", metavar="RUN_ID",
                   help="show this training run: peers, last committed step, loss, connection kinds")
    add_node_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    if args.run:  # before libp2p's import (2 s): a typo is a one-line error at once
        args.run = args.namespace = run_id_arg(args.run)
    import trio

    from p2ptrain.events import EventSink
    from p2ptrain.identity import Identity
    from p2ptrain.net.node import Node
    from p2ptrain.records import RunRecords

    if not args.listen:
        args.listen = ["/ip4/127.0.0.1/tcp/0"]  # a client needs no reachable address
    cfg, _ = node_config(args)
    show_config(args)
    if not getattr(args, "verbose", False):  # a throwaway client: its own start is no news, stdout has the answer
        import logging

        logging.getLogger("p2ptrain").setLevel(logging.WARNING)
    if not cfg.bootstrap:
        raise CLIError("no bootstrap given", "pass --bootstrap /ip4/.../tcp/.../p2p/<peer id>")
    identity = Identity.generate()  # a throwaway client identity: status publishes nothing
    events = EventSink(identity.peer_id_str, False)

    states: dict = {}

    async def main() -> dict:
        node = Node(identity, cfg, events, dht_server=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            peers = await RunRecords(node.dht, args.namespace).read_presence()
            if args.run:
                states.update(await RunRecords(node.dht, args.run).state_view())
            nursery.cancel_scope.cancel()
        return peers

    peers = run_service(main) or {}
    if args.run:
        return _print_run(args, identity, peers, states)
    if args.json:
        print(json.dumps({"event": "status", "t": round(__import__("time").time(), 3),
                          "peer": identity.peer_id_str, "namespace": args.namespace,
                          "peers": [{"remote": p, **info} for p, info in sorted(peers.items())],
                          "runs": runs_seen(peers)}))
    else:
        print("\n".join(namespace_lines(args.namespace, peers)))
    sys.stdout.flush()
    return 0


def runs_seen(peers: dict) -> dict[str, int]:
    """run id -> how many of `peers` train in it (peers in a run keep a lobby record naming it)."""
    runs: dict[str, int] = {}
    for info in peers.values():
        if info.get("run"):
            runs[info["run"]] = runs.get(info["run"], 0) + 1
    return dict(sorted(runs.items()))


def namespace_lines(namespace: str, peers: dict) -> list[str]:
    """What `status` prints for a namespace (the lobby by default): each peer, the run it
    trains in, and the runs seen with the command that shows one."""
    lines = [f"{len(peers)} peer(s) in '{namespace}':"]
    for p, info in sorted(peers.items()):
        run = f" run {info['run']}" if info.get("run") else ""
        lines.append(f"  {p}  {info['role']:<7}{run} {' '.join(info['addrs'])}".rstrip())
        if info.get("conns"):
            lines.append("      " + ", ".join(f"{q[-8:]} {kind}" for q, kind in sorted(info["conns"].items())))
    runs = runs_seen(peers)
    for run, n in runs.items():
        lines.append(f"run {run}: {n} peer(s) training (p2ptrain status --run {run})")
    if not runs and namespace == "lobby":
        lines.append("no run seen: peers in a run show here while they train")
    return lines


def _print_run(args, identity, peers: dict, states: dict) -> int:
    import time

    rows = []
    for pid in sorted(set(peers) | set(states)):
        st = states.get(pid, {})
        rows.append({"remote": pid, "online": pid in peers, "step": st.get("step"), "loss": st.get("loss"),
                     "val_loss": st.get("val_loss"), "params_sha256": st.get("params"),
                     "connections": st.get("conns", {}),
                     "addrs": (peers.get(pid) or st).get("addrs", []),
                     "conns": (peers.get(pid) or {}).get("conns", {})})
    if args.json:
        print(json.dumps({"event": "status", "t": round(time.time(), 3), "peer": identity.peer_id_str,
                          "run": args.run, "peers": rows}))
        return 0
    print(f"run {args.run}: {len(rows)} peer(s)")
    print(f"  {'peer':<54}{'online':>7}{'step':>6}{'loss':>9}{'val':>9}  {'params':<13} connections")
    for r in rows:
        fmt = lambda x: f"{x:.4f}" if isinstance(x, (int, float)) else "-"
        conns = ", ".join(f"{n} {k}" for k, n in sorted(r["connections"].items())) or "-"
        print(f"  {r['remote']:<54}{'yes' if r['online'] else 'no':>7}"
              f"{(r['step'] if r['step'] is not None else '-'):>6}{fmt(r['loss']):>9}"
              f"{fmt(r['val_loss']):>9}  {(r['params_sha256'] or '-')[:12]:<13} {conns}")
        _print_conns(r["conns"])
    return 0


def _print_conns(conns: dict) -> None:
    """How this peer reaches each neighbour: direct, hole-punched or relayed."""
    if conns:
        print("      " + ", ".join(f"{p[-8:]} {kind}" for p, kind in sorted(conns.items())))
