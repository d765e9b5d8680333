"""A hostile peer for `bench redteam` (`python -m p2ptrain.bench.planter RUN_DIR ...`): it
tries to plant its own state on every peer that starts, joins or catches up (issue 15,
holes 3 and 5). Real libp2p, its own process and identity; it trains nothing. It:
  - serves a checkpoint of the run's model whose parameters are noise and whose metadata
    sets the outer lr to 50 (hole 3: hyperparameters from a checkpoint),
  - advertises it as step 10**6, committed by a "group" of one naming only itself (hole 3:
    `_quorum` accepted it, `choose` preferred the newest step),
  - publishes a state record at step 10**6 (hole 5: `latest_state` trusted one record, and
    every newcomer waited 120 s for a checkpoint of that step),
  - and does the same from `--sybils` extra identities whose provider records name each
    other as the committing group (they serve nothing: only the record layer sees them).
Prints one JSON line {"event": "planted", ...} once its records are stored, then stays up
(serving) until killed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FAKE_STEP = 10**6


def poisoned_state(genesis: bytes) -> bytes:
    import numpy as np

    from p2ptrain.ckpt import checkpoint

    arrays, meta = checkpoint.decode(genesis)
    rng = np.random.default_rng(0)
    arrays = dict(arrays)
    arrays["outer"] = rng.standard_normal(np.asarray(arrays["outer"]).size).astype(np.float32)
    meta = dict(meta, outer_step=FAKE_STEP, steps=FAKE_STEP,
                config={"lr": 50.0, "momentum": 0.0, "nesterov": False})
    return checkpoint.encode(arrays, meta)


async def plant(args) -> None:
    import trio

    from p2ptrain.ckpt.download import CheckpointServer
    from p2ptrain.ckpt.fetch import BlobServer
    from p2ptrain.clock import wall_time
    from p2ptrain.dht.record import make_record
    from p2ptrain.events import EventSink
    from p2ptrain.identity import Identity
    from p2ptrain.net.node import Node, NodeConfig
    from p2ptrain.records import codecs, keys

    ident = Identity.generate()
    node = Node(ident, NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[args.bootstrap]),
                EventSink(ident.peer_id_str, False))
    data = poisoned_state(Path(args.run_dir, "genesis.p2ck").read_bytes())
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        addrs = node.rpc.local_addrs()
        server = CheckpointServer(BlobServer(node.host))
        m = await server.publish(node.dht, args.run, data, FAKE_STEP, "ab" * 32, [ident.peer_id_str], addrs)

        def state(sha: str) -> bytes:
            return codecs.encode_state(codecs.State(FAKE_STEP, "ab" * 32, sha, addrs=tuple(addrs)))
        await node.dht.store(keys.state(args.run), state(m.sha256), ttl=600)
        sybils = [Identity.generate() for _ in range(args.sybils)]
        names = [s.peer_id_str for s in sybils]
        for s in sybils:  # records only: signed by identities that cost nothing to make
            value = codecs.encode_provider(FAKE_STEP, "cd" * 32, "ef" * 32, "ab" * 32, names, addrs)
            await node.dht.store_record(make_record(s, keys.providers(args.run), value, wall_time() + 600))
            await node.dht.store_record(make_record(s, keys.state(args.run), state("ef" * 32),
                                                    wall_time() + 600))
        print(json.dumps({"event": "planted", "peer": ident.peer_id_str, "sybils": names, "step": FAKE_STEP}),
              flush=True)
        while True:  # re-publish now and then: records expire, peers come and go
            await trio.sleep(60)
            await node.dht.store(keys.state(args.run), state(m.sha256), ttl=600)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="planter")
    p.add_argument("run_dir", help="the run's directory (run.toml, genesis.p2ck)")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--sybils", type=int, default=2)
    args = p.parse_args(argv)
    import trio

    try:
        trio.run(plant, args)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
