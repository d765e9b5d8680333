"""`p2ptrain join`: join the network; with --manifest or --run, train in that run."""

from __future__ import annotations

from pathlib import Path

from p2ptrain.cli.common import (DEFAULT_HOME, CLIError, add_node_args, load_identity, node_config, run_id_arg,
                                 run_service, section, show_config)


def add_parser(sub) -> None:
    p = sub.add_parser("join", help="join the network and (with --run/--manifest) a training run")
    p.add_argument("--bootstrap", action="append", metavar="MADDR", required=False,
                   help="entry point /ip4/ADDRESS/tcp/PORT/p2p/<id> or /dns4/HOST/tcp/PORT/p2p/<id> (repeatable)")
    p.add_argument("--workdir", metavar="DIR", help=f"state directory: key, checkpoints (default {DEFAULT_HOME}); one join at a time")
    which = p.add_mutually_exclusive_group()
    # --run-id: the same, for torchrun, whose own parser takes `--run` for its --run-path
    which.add_argument("--run", "--run-id", dest="run", metavar="RUN_ID",
                       help="join this run: manifest and state come from peers")
    which.add_argument("--manifest", metavar="RUN_TOML", help="publish and join the run in this manifest")
    p.add_argument("--max-outer-steps", type=int, default=None, help="leave after N committed outer steps")
    p.add_argument("--threads", type=int, default=None, help="torch threads for inner steps")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="held-out batches (of 16 sequences) scored after each committed step (default 8)")
    p.add_argument("--min-peers", type=int, default=None, help="at a run's start, wait for this many trainers")
    p.add_argument("--dashboard", metavar="HOST:PORT", help="serve the live web dashboard here (e.g. 127.0.0.1:8080)")
    from p2ptrain.train.devicecfg import add_device_args  # --device, --precision (torch-free)

    add_device_args(p)
    add_node_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    # A typo must cost neither a DHT lookup and a wait nor libp2p's import (2 s): checked first.
    args.run = run_id_arg(args.run) if args.run else None
    from p2ptrain.events import EventSink
    from p2ptrain.net.limits import LimitsConfig
    from p2ptrain.net.nat import NatConfig
    from p2ptrain.net.node import Node
    from p2ptrain.net.presence import Presence, PresenceConfig

    cfg, toml = node_config(args)
    if isinstance(node_ranks := _ranks(args, toml), int):  # torchrun: rank 0's parts, or a rank's exit code
        return node_ranks
    if not cfg.bootstrap:
        raise CLIError("no bootstrap given", "pass --bootstrap /ip4/.../tcp/.../p2p/<peer id>")
    workdir, held = _hold_workdir(args)  # noqa: F841 - one process per workdir, until this one exits
    if not args.key:
        args.key = str(workdir / "node.key")
    identity = load_identity(args)
    events = EventSink(identity.peer_id_str, args.json)
    manifest, run_id = _read_manifest(args)
    nat_cfg = section(NatConfig, toml, "nat")
    namespace = run_id or args.run or "lobby"
    limits_cfg = section(LimitsConfig, toml, "limits")  # per-peer limits: [limits], P2PTRAIN_LIMITS_*
    presence_cfg = section(PresenceConfig, toml, "presence", {"namespace": namespace})
    if args.run or manifest:
        from p2ptrain.train.trainer import TrainerConfig

        trainer_cfg = section(TrainerConfig, toml, "trainer", {
            "max_outer_steps": args.max_outer_steps, "threads": args.threads, "min_peers": args.min_peers, "eval_batches": args.eval_batches})
        from p2ptrain.train.device import config_from_args

        try:
            device_cfg = config_from_args(args)
        except ValueError as exc:
            raise CLIError(str(exc)) from None

    dashboard_cfg = None
    if args.dashboard:
        from p2ptrain.dashboard.server import DashboardConfig

        dashboard_cfg = section(DashboardConfig, toml, "dashboard", {"listen": args.dashboard})
    show_config(args)

    async def main() -> None:
        import trio

        from p2ptrain.net.nat import connection_kinds

        node = Node(identity, cfg, events, nat=nat_cfg, limits=limits_cfg)
        conns = lambda: connection_kinds(node.host)  # noqa: E731 - shown by `status`
        try:
            async with trio.open_nursery() as nursery:
                if dashboard_cfg is not None:
                    from p2ptrain.dashboard.server import Dashboard

                    await nursery.start(Dashboard(dashboard_cfg, events, node, namespace, run_id or args.run or "").run)
                await nursery.start(node.run)
                if args.run or manifest:
                    from p2ptrain.run.runner import run_training

                    presence = Presence(node.dht, node.rpc.local_addrs(), events, presence_cfg, role="trainer",
                                        conns=conns)
                    await _announce(nursery, node, presence)
                    await run_training(node, manifest, run_id or args.run, args.manifest, workdir, events,
                                       trainer_cfg, device=device_cfg, **node_ranks)
                    await _stop_ranks(node_ranks)
                    nursery.cancel_scope.cancel()
                    return
                presence = Presence(node.dht, node.rpc.local_addrs(), events, presence_cfg, conns=conns)
                await _announce(nursery, node, presence)
                await trio.sleep_forever()
        finally:
            events.emit("left")

    run_service(main)
    if node_ranks:  # rank 0 of a torchrun node: the others stopped; close the group with them
        from p2ptrain.train import ranks

        ranks.leave(0)
    return 0


async def _announce(nursery, node, presence) -> None:
    """Our presence, withdrawn when the node leaves, before its host stops (a clean exit
    shows offline at once: Node.on_leave)."""
    node.on_leave.append(presence.withdraw)
    await nursery.start(presence.run)


def _hold_workdir(args) -> tuple:
    """(the workdir, made usable; its lock file, held open by this process): two processes on
    one workdir would be one peer id twice (issue 33)."""
    from p2ptrain.cli import workdir as wd

    work = wd.prepare(args.workdir or DEFAULT_HOME)
    return work, wd.lock(work)


def _ranks(args, toml) -> dict | int:
    """Under torchrun (issue 19): join the node's process group. Rank 0 goes on as the peer
    and gets the run_training arguments that make its model side a LeaderModel; every other
    rank trains its shard on rank 0's commands and returns its exit code here. Outside
    torchrun: {} (an ordinary single-process peer)."""
    from p2ptrain.train import ranks

    try:
        env = ranks.detect()
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if env is None:
        return {}
    if not (args.run or args.manifest):
        raise CLIError("torchrun ranks only make sense in a run", "pass --run RUN_ID or --manifest RUN_TOML")
    from p2ptrain.peer import Parts
    from p2ptrain.train import leader
    from p2ptrain.train.device import config_from_args, resolve_device

    try:
        device = ranks.rank_device(resolve_device(config_from_args(args).device), env)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    cfg = section(ranks.RanksConfig, toml, "ranks")
    ranks.init(env, device, cfg)
    if env.leader:
        return {"parts": Parts(local=leader.factory(env, cfg))}
    ranks.tag_logs(env.rank)
    try:
        code = ranks.follow(env, device)
    except BaseException:
        ranks.close()
        raise
    ranks.leave(code)  # the group closed with rank 0's; no interpreter teardown (see there)
    return code  # not reached


async def _stop_ranks(node_ranks: dict) -> None:
    """Rank 0 done training: the other ranks leave with it (issue 19)."""
    if node_ranks:
        import trio

        from p2ptrain.train import ranks

        await trio.to_thread.run_sync(ranks.send_cmd, ranks.STOP)


def _read_manifest(args) -> tuple:
    """(manifest, run id) of --manifest, or (None, None)."""
    if not args.manifest:
        return None, None
    from p2ptrain.run import manifest as mf

    try:
        return mf.read(Path(args.manifest))
    except mf.ManifestError as exc:
        raise CLIError(str(exc), "use the run.toml written by `p2ptrain init`") from None
