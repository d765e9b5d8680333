"""`p2ptrain bootstrap`: run an entry point (DHT server + relay v2 hop + AutoNAT)."""

from __future__ import annotations

from p2ptrain.cli.common import add_node_args, load_identity, node_config, run_service, section, show_config


def add_parser(sub) -> None:
    p = sub.add_parser("bootstrap", help="run a bootstrap/relay node (prints its multiaddr first)")
    add_node_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from p2ptrain.bootstrap.server import AddressFirstSink, RelayConfig, run_bootstrap

    cfg, toml = node_config(args, bootstrap=[])
    from p2ptrain.net.limits import LimitsConfig

    relay = section(RelayConfig, toml, "relay")
    limits = section(LimitsConfig, toml, "limits")  # per-peer limits: [limits], P2PTRAIN_LIMITS_*
    show_config(args)
    identity = load_identity(args, "bootstrap.key")
    events = AddressFirstSink(identity.peer_id_str, args.json)

    async def main() -> None:
        try:
            await run_bootstrap(identity, cfg, relay, events, limits)
        finally:
            events.emit("left")

    run_service(main)
    return 0
