"""One checkpoint donor process for `p2ptrain bench checkpoint`, driven by JSON on stdin.

    python -m p2ptrain.bench.checkpoint_worker --mb 256 --seed 1 --rate 25

It makes a deterministic `--mb` MiB blob (the same for every donor with the same seed),
serves it as chunks through a real libp2p node's BlobServer (the serving limiter capped at
`--rate` MB/s, 0 = uncapped), prints `donor_ready` (peer id, addrs, manifest hash, content
hash), then obeys commands: {"cmd": "rate", "mbps": X} (reconfigure the cap), {"cmd": "exit"}.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import numpy as np
import trio

from p2ptrain.ckpt.download import CheckpointServer
from p2ptrain.events import EventSink, setup_logging
from p2ptrain.ckpt.fetch import BlobServer, ServeConfig, TokenBucket
from p2ptrain.identity import Identity
from p2ptrain.net.node import Node, NodeConfig


def make_blob(mb: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(mb << 20)


async def main(args) -> None:
    identity = Identity.generate()
    events = EventSink(identity.peer_id_str, True)
    node = Node(identity, NodeConfig(listen=[args.listen]), EventSink(identity.peer_id_str, False))
    data = make_blob(args.mb, args.seed)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        cfg = ServeConfig(max_concurrent=args.concurrent, upload_mbps=args.rate, chunk_kib=args.chunk_kib)
        blobs = BlobServer(node.host, config=cfg)
        manifest, digest = CheckpointServer(blobs, cfg.chunk_kib << 10).serve(data)
        events.emit("donor_ready", addrs=node.rpc.local_addrs(), manifest=digest, sha256=manifest.sha256,
                    chunks=len(manifest.chunks))
        stdin = trio.wrap_file(sys.stdin)
        while True:
            line = await stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd.get("cmd") == "exit":
                break
            if cmd.get("cmd") == "rate":
                blobs.bucket = TokenBucket(float(cmd["mbps"]) * 1e6, cfg.burst_mb * 1e6)
                events.emit("rate_set", mbps=float(cmd["mbps"]), served_bytes=blobs.served_bytes)
        nursery.cancel_scope.cancel()


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m p2ptrain.bench.checkpoint_worker")
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", type=float, default=25.0, help="upload cap, MB/s (0 = uncapped)")
    ap.add_argument("--concurrent", type=int, default=4, help="requests served at once")
    ap.add_argument("--chunk-kib", type=int, default=4096)
    args = ap.parse_args(argv)
    setup_logging()
    logging.getLogger("p2ptrain").setLevel(logging.WARNING)
    trio.run(main, args)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
