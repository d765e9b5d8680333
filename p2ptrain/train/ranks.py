"""A node is a machine, not a process (issue 19): the ranks of `torchrun ... -m p2ptrain join`.

One peer identity per machine. Rank 0 speaks for the node: it runs the libp2p node, the
election, the contribution round and the outer step, and owns the checkpoints and the
events. Every other rank only trains its FSDP2 shard (p2ptrain.train.sharded), in a loop
that waits for rank 0's commands. Why rank 0 speaks, rather than each rank reducing its
shard with the matching ranks of other peers: a peer's group, roster, signatures and
commit vote are per peer; N parallel rounds per step would each need them, and a round that
commits on rank 0's shard and aborts on rank 1's would break commit-or-abort for the node.
On one machine the gather to rank 0 is a local copy: rank 0's pseudo-gradient and outer
step, gather and scatter included, took as long as a single-process peer's within this
machine's noise (BENCHMARKS.md, issue 19).

The command protocol over the process group (all collectives; rank 0 is the source):
  header  int64[3] = (MAGIC, command, argument), broadcast from rank 0
  SETUP   then a JSON blob and the train/val token bytes (`bcast_bytes`)
  INNER   step t: every rank runs H inner steps on its rows of step t's batches
  GATHER  every rank's flat shard to rank 0 (`dist.gather`): the params for a pseudo-gradient
  APPLY   rank 0 scatters the full params it committed (or adopted: a catch-up) as shards
  EVAL    n: the validation loss over n batches (`--eval-batches`), rows split over the ranks
  STOP    leave the loop
  DONE    (p2ptrain.DiLoCo only, p2ptrain.api_ranks) the outer step is over: back to the user's loop
Ranks only ever write parameters on APPLY, which rank 0 sends after its outer step (or
checkpoint load) succeeded: they never hold a result rank 0 did not commit. Every wait is
bounded by the process group's timeout (`RanksConfig.timeout`); torchrun ends the other
ranks when one of them exits with an error.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("p2ptrain.train.ranks")
MAGIC = 0x1962
SETUP, INNER, GATHER, APPLY, EVAL, STOP, DONE = range(1, 8)
NAMES = {SETUP: "setup", INNER: "inner", GATHER: "gather", APPLY: "apply", EVAL: "eval", STOP: "stop",
         DONE: "done"}
MAX_SETUP_JSON = 1 << 20


@dataclass
class RanksConfig:
    timeout: float = 1800.0
    """Seconds any rank waits in one collective (rank 0's network round between two
    commands included) before it gives up with an error."""
    verify: bool = False
    """After each APPLY, gather the shards back and check they hash to the committed
    parameters (costs one gather and one hash per outer step; the tests turn it on)."""

    def __post_init__(self) -> None:
        if not 1.0 <= self.timeout <= 86400.0:
            raise ValueError(f"ranks timeout must be in [1, 86400] seconds, got {self.timeout}")


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def detect() -> RankEnv | None:
    """The torchrun rank of this process, or None when not started by torchrun (or with one
    rank: a single-rank node is the ordinary single-process peer)."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        return None
    if world <= 1:
        return None
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        raise ValueError("one p2ptrain node is one machine: run torchrun with --nnodes 1 on each machine "
                         "(each machine is its own peer)")
    return RankEnv(rank, world, local_rank)


def init(env: RankEnv, device: torch.device, cfg: RanksConfig) -> None:
    """Join the node's process group: gloo for host tensors (commands, shards, tokens), and
    NCCL for the FSDP collectives when the model trains on CUDA."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout))


def rank_device(device: torch.device, env: RankEnv) -> torch.device:
    """Rank r of a CUDA node trains on GPU LOCAL_RANK (torchrun's one-GPU-per-rank rule)."""
    if device.type != "cuda":
        return device
    if env.local_rank >= torch.cuda.device_count():
        raise ValueError(f"rank {env.rank}: {torch.cuda.device_count()} GPU(s) for {env.world} ranks; "
                         "use --nproc-per-node <= the GPU count")
    return torch.device("cuda", env.local_rank)


def make_mesh(device: torch.device, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,))


def close() -> None:
    """Leave the process group together: a rank that tore down its gloo pairs while another
    still used them made that rank abort (SIGABRT, "terminate called without an active
    exception") once in a CI-like run, which torchrun reports as a failed node."""
    if dist.is_initialized():
        try:
            dist.barrier()
        except Exception as exc:  # a rank already gone: leave anyway
            log.info("process group barrier at exit failed: %s", exc)
        dist.destroy_process_group()


def leave(code: int) -> None:
    """End a torchrun rank's process: close the group with the other ranks, flush what it
    wrote, and exit without interpreter teardown. gloo's threads outlive
    `destroy_process_group` and could abort the process while the interpreter finalized
    (SIGABRT, "terminate called without an active exception": seen in CI-like runs with the
    barrier in `close` too), which torchrun reports as a failed node after a clean run.
    Only for a rank whose work is done: the checkpoint writer has already been closed."""
    close()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def tag_logs(rank: int) -> None:
    """Prefix this process's stderr log lines with `rank r` (rank 0's stay the node's)."""
    for handler in logging.getLogger().handlers:
        fmt = handler.formatter or logging.Formatter()
        handler.setFormatter(_Tagged(fmt, f"[rank {rank}] "))


class _Tagged(logging.Formatter):
    def __init__(self, inner: logging.Formatter, tag: str) -> None:
        super().__init__()
        self.inner, self.tag = inner, tag

    def format(self, record: logging.LogRecord) -> str:
        return self.tag + self.inner.format(record)


def send_cmd(cmd: int, arg: int = 0, group=None) -> None:
    dist.broadcast(torch.tensor([MAGIC, cmd, arg], dtype=torch.int64), 0, group=group)


def recv_cmd(group=None) -> tuple[int, int]:
    t = torch.zeros(3, dtype=torch.int64)
    dist.broadcast(t, 0, group=group)
    magic, cmd, arg = (int(x) for x in t)
    if magic != MAGIC or cmd not in NAMES:
        raise RuntimeError(f"rank 0 sent a malformed command {t.tolist()} (mixed p2ptrain versions?)")
    return cmd, arg


def bcast_bytes(data: bytes | None, limit: int) -> bytes:
    """Rank 0's `data` on every rank (others pass None): its length first, checked against
    `limit` before anything that size is allocated."""
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, 0)
    size = int(n)
    if not 0 <= size <= limit:
        raise RuntimeError(f"rank 0 announced {size} bytes, over the {limit} allowed")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(size, dtype=torch.uint8)
    if size:
        dist.broadcast(buf, 0)
    return buf.numpy().tobytes()


def send_setup(spec_dict: dict, ds, peer_id: bytes, threads: int, precision: str) -> None:
    """SETUP: what a rank needs to build its shard. The tokens travel over the process group
    (one copy per rank, as each single-process peer holds): the other ranks have no network."""
    meta = {"spec": spec_dict, "peer_id": peer_id.hex(), "threads": threads, "precision": precision,
            "ds": {"spec": ds.spec, "content_hash": ds.content_hash, "n_train_files": ds.n_train_files,
                   "n_val_files": ds.n_val_files, "hash_kind": ds.hash_kind,
                   "train_dtype": ds.train.dtype.str, "val_dtype": ds.val.dtype.str}}
    send_cmd(SETUP)
    bcast_bytes(json.dumps(meta).encode(), MAX_SETUP_JSON)
    for arr in (ds.train, ds.val):
        bcast_bytes(np.ascontiguousarray(arr).tobytes(), 1 << 40)


def recv_setup():
    from p2ptrain.run.spec import RunSpec
    from p2ptrain.train.data import Dataset

    meta = json.loads(bcast_bytes(None, MAX_SETUP_JSON))
    d = meta["ds"]
    train = np.frombuffer(bcast_bytes(None, 1 << 40), dtype=np.dtype(d["train_dtype"]))
    val = np.frombuffer(bcast_bytes(None, 1 << 40), dtype=np.dtype(d["val_dtype"]))
    ds = Dataset(d["spec"], train, val, d["content_hash"], d["n_train_files"], d["n_val_files"], d["hash_kind"])
    return RunSpec.from_dict(meta["spec"]), ds, bytes.fromhex(meta["peer_id"]), int(meta["threads"]), meta["precision"]


def follow(env: RankEnv, device: torch.device, on_stop=None) -> int:
    """A non-zero rank's whole life: build the shard on SETUP, then obey rank 0 until STOP
    (`on_stop(model)`: the memory bench reports the shard there)."""
    from p2ptrain.train import sharded

    cmd, _ = recv_cmd()
    if cmd == STOP:
        return 0
    if cmd != SETUP:
        raise RuntimeError(f"rank {env.rank}: expected setup, got {NAMES[cmd]}")
    spec, ds, peer_id, threads, precision = recv_setup()
    model = sharded.ShardedModel(spec, ds, peer_id, threads, device, precision, env.rank, env.world,
                                 make_mesh(device, env.world))
    exchange_layout(model)
    log.info("shard of %d/%d values ready", int(model.local_numels.sum()), model.n_params)
    while True:
        cmd, arg = recv_cmd()
        if cmd == INNER:
            model.inner(arg)
        elif cmd == GATHER:
            send_shard(model)
        elif cmd == APPLY:
            recv_shard(model)
        elif cmd == EVAL:
            model.evaluate(arg)  # the leader's batch count: every rank runs the same forwards
        elif cmd == STOP:
            if on_stop is not None:
                on_stop(model)
            return 0
        else:
            raise RuntimeError(f"rank {env.rank}: unexpected {NAMES[cmd]} after setup")


def exchange_layout(model) -> np.ndarray:
    """Every rank's local numels per parameter ([world, n_params]) on every rank, and the
    padded shard size (the largest rank's) cached on the model for gather/scatter."""
    mine = torch.from_numpy(model.local_numels.copy())
    alls = [torch.zeros_like(mine) for _ in range(model.world)]
    dist.all_gather(alls, mine)
    model.layout = torch.stack(alls).numpy()
    model.pad = int(model.layout.sum(axis=1).max())
    return model.layout


def send_shard(model, group=None) -> None:
    """GATHER on a non-zero rank: this rank's flat shard to rank 0."""
    dist.gather(model.shard_flat(model.pad), None, dst=0, group=group)


def recv_shard(model, group=None) -> None:
    """APPLY on a non-zero rank: this rank's slice of rank 0's parameters into its shard."""
    buf = torch.zeros(model.pad, dtype=torch.float32)
    dist.scatter(buf, None, src=0, group=group)
    model.load_shard_flat(buf)


def gather_full(model, out: torch.Tensor, group=None) -> torch.Tensor:
    """GATHER on rank 0: every rank's shard, assembled into the full flat vector `out`."""
    from p2ptrain.train.sharded import assemble

    pieces = [torch.zeros(model.pad, dtype=torch.float32) for _ in range(model.world)]
    dist.gather(model.shard_flat(model.pad), pieces, dst=0, group=group)
    return assemble(pieces, model.layout, out)


def scatter_full(model, full: torch.Tensor, group=None) -> None:
    """APPLY on rank 0: every rank's slice of `full` (the committed or adopted params) sent."""
    from p2ptrain.train.sharded import split

    pieces = split(full, model.layout, model.pad)
    mine = torch.zeros_like(pieces[0])
    dist.scatter(mine, pieces, src=0, group=group)
    model.load_shard_flat(mine)
