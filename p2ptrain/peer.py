"""Building a training peer, in one place (the composition root).

`p2ptrain join` (`run.runner`), the library (`p2ptrain.DiLoCo`) and the simulator
(`p2ptrain.sim`) all assemble a peer here, from the I/O they choose:

  - `node`: the network side. Anything with `identity`, `dht` (a `p2ptrain.dht.node.DHTNode`
    on any `RpcTransport`), `rpc` (`local_addrs()`, `learn_addrs(peer, addrs)`), `host` (what
    blobs are served on and fetched from: a libp2p host, or the simulator's), `config.listen`
    and `conn_counts()` -- `p2ptrain.net.node.Node`, or `p2ptrain.sim.world.SimNode`;
  - the model side (`p2ptrain.train.modelside.ModelSide`);
  - `Parts`: the all-reduce service, blob server, checkpoint writer and contributor classes
    (the product's by default; tests and the simulator pass others);
  - the clock is trio's: under `trio.testing.MockClock` everything runs in simulated time.

Before this module, three places built peers and drifted: the library passed the run's
`allreduce` straight to the service ("sparse" failed at start: only the CLI mapped it), and a
torchrun node ignored `--eval-batches`. What a run's settings mean for its parts is decided
here once (`service_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trio

from p2ptrain.ckpt import checkpoint
from p2ptrain.ckpt.fetch import BlobServer, ServeConfig
from p2ptrain.reduce.service import AllReduceConfig, AllReduceService
from p2ptrain.run.round import Contributor
from p2ptrain.run.spec import RunSpec
from p2ptrain.train import modelside

KEEP_CHECKPOINTS = 3


def checkpoint_dir(workdir: Path, run_id: str) -> Path:
    return Path(workdir) / "checkpoints" / run_id[:16]


def make_writer(workdir: Path, run_id: str, events, cls=checkpoint.AsyncWriter) -> checkpoint.AsyncWriter:
    """The run's checkpoint directory, written in a background thread (newest 3 kept)."""
    return cls(checkpoint_dir(workdir, run_id), KEEP_CHECKPOINTS,
               on_written=lambda step, sec, path: events.emit("checkpoint_written", step=step, seconds=round(sec, 4)),
               on_failed=lambda step, reason, resume_from: events.emit(
                   "checkpoint_failed", step=step, reason=reason, resume_from=resume_from))


@dataclass(frozen=True)
class Parts:
    """The components a peer is built from. The product uses these defaults; tests
    (tests/fakes/hostile_peer.py) pass subclasses that misbehave and the simulator passes
    its own network's, so no test switch lives in the product."""
    contributor: type = Contributor
    blob_server: type = BlobServer
    """(host, config=ServeConfig) -> a `p2ptrain.ckpt.fetch.BlobServer`"""
    writer: object = make_writer
    """(workdir, run_id, events) -> a checkpoint writer (`submit`, `close`)"""
    service: type = AllReduceService
    """(host, identity, AllReduceConfig, listen_ip=...) -> the all-reduce service"""
    local: object = None
    """(spec, ds, peer_id, state, threads, device, precision) -> the model side; None: a
    single-process LocalModel (a torchrun node passes p2ptrain.train.leader's, issue 19)"""
    state_scorer: object = None
    """(local) -> what scores a state before it is adopted (`state_losses(data, seed)`: rules
    H1 and H3, `p2ptrain.train.scorer.checked_load`); None: the loss gate's scorer, where the
    model side has one (`p2ptrain.train.scorer.make_scorer`)"""


def service_config(spec: RunSpec) -> AllReduceConfig:
    """The all-reduce service a run needs. Sparse runs use the service for its exchanges
    only (the compressed all-gather, `reduce.sparse`): its ring mode is unused, so int8."""
    exchange = float(spec.timeouts.exchange)
    return AllReduceConfig(mode="int8" if spec.train.allreduce == "sparse" else spec.train.allreduce,
                           setup_timeout=exchange * 2, frame_timeout=exchange * 4, commit_timeout=exchange * 2,
                           early_ttl=spec.timeouts.early_ttl)


def blob_server(node, parts: Parts = Parts(), config: ServeConfig | None = None):
    """What this peer serves (manifest, data shards, checkpoint chunks) on its host."""
    return parts.blob_server(node.host, config=config or ServeConfig())


def listen_ip(node) -> str:
    """The IPv4 address the node listens on (bulk links bind there), 0.0.0.0 if none."""
    for addr in getattr(node.config, "listen", ()):
        bits = addr.split("/")
        if len(bits) > 2 and bits[1] == "ip4":
            return bits[2]
    return "0.0.0.0"


async def run_peer(node, spec: RunSpec, run_id: str, local, events, config, *, workdir: Path,
                   parts: Parts = Parts(), blobs=None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Train in run `run_id` until the trainer is done (or cancelled): start the all-reduce
    service, build the trainer, run it; the last checkpoint reaches the writer's disk before
    this returns. `task_status.started(trainer)` once the trainer is built."""
    from p2ptrain.train.trainer import Trainer

    modelside.check(local)
    blobs = blobs if blobs is not None else blob_server(node, parts)
    svc = parts.service(node.host, node.identity, service_config(spec), listen_ip=listen_ip(node))
    writer = parts.writer(workdir, run_id, events)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(svc.run)
            trainer = Trainer(node, svc, blobs, writer, spec, run_id, local, events, config, parts.contributor(),
                              state_scorer=parts.state_scorer(local) if parts.state_scorer else None)
            task_status.started(trainer)
            await trainer.run()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(writer.close)
