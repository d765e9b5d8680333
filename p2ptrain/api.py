"""The library entry point: bring your own `nn.Module`, optimizer and data.

    from p2ptrain import DiLoCo
    torch.manual_seed(0)         # the same starting weights on every peer: they are part of the run id
    model = MyModel()
    opt = torch.optim.AdamW(model.parameters())
    diloco = DiLoCo(model, opt, run="my-run", bootstrap=["/ip4/.../tcp/4001/p2p/12D3KooW..."],
                    inner_steps=100)
    for batch in data:
        loss = model.loss(batch); loss.backward(); opt.step(); opt.zero_grad()
        diloco.step(loss)        # every inner_steps calls: the outer step, over the network
    diloco.close()

A runnable example (tested verbatim): the README's "The library" section.

It runs the same network side as `p2ptrain join` (node, DHT, election, verified int8 ring,
Nesterov outer step: `p2ptrain.train.trainer.Trainer`) in a background thread with its own trio
loop. The only difference is who drives the inner steps: here your loop does, and
`step()` blocks on the H-th call until the outer step is done (or skipped) and the model
holds the new outer parameters. The run is a `p2ptrain.run.spec.RunSpec` like any other:
its id (the SHA-256 of the spec's canonical encoding, `p2ptrain.run.manifest.run_id`) covers
every setting members must share (inner steps, group size, outer lr and momentum, all-reduce
mode, aggregation, timeouts) and the genesis hash of the starting parameters, so peers that
differ in any of them are never grouped together, and a checkpoint fetch is bounded by the
genesis size. There is no initiator: every peer derives the same id from the same arguments.

Import p2ptrain before torch (or set OMP_WAIT_POLICY=passive): see p2ptrain/__init__.py for
why an active OpenMP wait policy makes torch ~27x slower next to the ring's numba kernels.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

from p2ptrain.ckpt import checkpoint
from p2ptrain.run import manifest as mf
from p2ptrain.run.spec import SPARSE_DEFAULTS, USER, DataSpec, GenesisSpec, ModelSpec, RunSpec, TimeoutsSpec, TrainSpec
from p2ptrain.train.outer import OuterConfig, OuterOptimizer


class _UserModel:
    """The `LocalModel` interface the Trainer expects, driven by the user's own loop."""

    def __init__(self, model: torch.nn.Module, inner_steps: int, outer: OuterConfig, evaluate,
                 outer_opt: OuterOptimizer | None = None) -> None:
        self.model = model
        self.H = inner_steps
        # outer_opt: a multi-rank node's HostOuter (p2ptrain.api_ranks), over all ranks' shards
        self.outer = outer_opt or OuterOptimizer(model, outer)
        self.step = 0
        self.n_params = int(self.outer.numel)
        self._evaluate = evaluate
        self.lock = threading.Condition()
        self.calls = 0
        self.losses: list[float] = []
        self.tokens = 0
        self.outer_done = True  # the user may run its first H steps straight away
        self.applied = False
        self.closed = False

    # called from the trainer's worker threads
    def inner(self, progress=None):
        t0 = time.perf_counter()
        with self.lock:
            self.outer_done = True
            self.lock.notify_all()
            while self.calls < self.H and not self.closed:
                self.lock.wait(0.5)
            if self.closed:
                raise RuntimeError("DiLoCo closed")
            self.calls = 0
            self.outer_done = False
            losses, self.losses = self.losses, []
            tokens, self.tokens = self.tokens, 0
        return (float(np.mean(losses)) if losses else math.nan), tokens, time.perf_counter() - t0

    def pseudo_gradient(self) -> np.ndarray:
        return np.ascontiguousarray(self.outer.pseudo_gradient(self.model).numpy(), np.float32)

    def outer_step(self, avg: np.ndarray) -> str:
        self.outer.step(torch.from_numpy(np.array(avg, np.float32)))
        self.step += 1
        self.applied = True
        return self.outer.params_sha256()

    evaluates_committed = False
    """The user's `evaluate` scores the user's model: before the next inner phase."""

    def evaluate(self, max_batches: int = 8, committed: bool = False) -> float:
        return float(self._evaluate()) if self._evaluate else math.nan

    def state_bytes(self) -> bytes:
        from p2ptrain.train.local import encode_state

        return encode_state(self.outer, self.step)

    def load_state_at(self, data: bytes) -> None:
        from p2ptrain.train.local import decode_state

        sd, self.step = decode_state(data)
        self.outer.load_state_dict(sd)


def library_spec(outer: OuterOptimizer, *, run: str, inner_steps: int, group_size: int, outer_lr: float,
                 outer_momentum: float, allreduce: str, aggregation: str, join_window: float) -> RunSpec:
    """The run a library user's arguments describe; `outer` holds the starting parameters.
    No timestamp, no initiator: peers given the same arguments and model derive the same id."""
    from p2ptrain.train.local import encode_state

    genesis = encode_state(outer, 0)  # step 0: the starting parameters, zero momentum
    return RunSpec(
        name=run, created=0, model=ModelSpec({"source": USER, "n_params": int(outer.numel)}),
        data=DataSpec(USER, ""),
        train=TrainSpec(inner_steps=int(inner_steps), group_size=int(group_size), outer_lr=float(outer_lr),
                        outer_momentum=float(outer_momentum), allreduce=allreduce, aggregation=aggregation,
                        **(SPARSE_DEFAULTS if allreduce == "sparse" else {})),
        timeouts=TimeoutsSpec(join_window=float(join_window), exchange=5.0),
        genesis=GenesisSpec(checkpoint.sha256(genesis), len(genesis)))


class DiLoCo:
    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *, run: str,
                 bootstrap: list[str], inner_steps: int = 100, group_size: int = 8, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, allreduce: str = "int8", aggregation: str = "mean",
                 join_window: float = 30.0,
                 listen: str = "/ip4/0.0.0.0/tcp/0", key: str | Path | None = None,
                 workdir: str | Path | None = None, evaluate=None, tokens_per_step: int = 0,
                 json_events: bool = False, min_peers: int = 1, timeout: float = 120.0) -> None:
        from p2ptrain import workdir as wd
        from p2ptrain.identity import load_or_create

        self.inner_optimizer = inner_optimizer
        self.tokens_per_step = tokens_per_step
        self._follower = None
        if self._multirank(model, inner_steps, OuterConfig(outer_lr, outer_momentum)):
            return  # a non-zero torchrun rank: no network side of its own (issue 19)
        if not hasattr(self, "local"):
            self.local = _UserModel(model, inner_steps, OuterConfig(outer_lr, outer_momentum), evaluate)
        self.spec = library_spec(self.local.outer, run=run, inner_steps=inner_steps, group_size=group_size,
                                 outer_lr=outer_lr, outer_momentum=outer_momentum, allreduce=allreduce,
                                 aggregation=aggregation, join_window=join_window)
        self.run_id = mf.run_id(self.spec.to_dict())
        # The run id is the same every time the script runs: a rerun is the same peer (its key
        # and checkpoints in its workdir) and resumes where it stopped, as `p2ptrain join` does.
        # With a fresh key and step 0 it took its own last run's records for others' (issue 33).
        if workdir:
            self.workdir, self._lock = Path(workdir), wd.claim(Path(workdir))
        else:  # one slot per process at once: two scripts on one machine are two peers
            self.workdir, self._lock = wd.claim_slot(Path.home() / ".p2ptrain" / "lib" / self.run_id[:16])
        self.identity = load_or_create(Path(key) if key else self.workdir / "node.key")
        self._resume()
        self._bootstrap, self._listen, self._json = list(bootstrap), listen, json_events
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token = None
        self._cancel = None
        self._min_peers = min_peers
        self._thread = threading.Thread(target=self._serve, daemon=True, name="p2ptrain-diloco")
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"p2ptrain node did not start within {timeout:.0f}s")
        if self._error is not None:
            raise self._error

    def _resume(self) -> None:
        """Load the newest checkpoint of this run in the workdir into the model, if any."""
        from p2ptrain.run.runner import newest_local_checkpoint

        if type(self.local) is not _UserModel:
            return  # a torchrun node's rank 0: applying it needs the other ranks, still in __init__
        saved = newest_local_checkpoint(self.workdir, self.run_id)
        if saved is not None:
            self.local.load_state_at(saved)
            logging.getLogger("p2ptrain.api").info("run %s resumed at outer step %d from %s", self.run_id[:16],
                                                   self.local.step, self.workdir)

    def _multirank(self, model, inner_steps: int, outer: OuterConfig) -> bool:
        """Under torchrun with N > 1 ranks (p2ptrain.api_ranks): rank 0 gets a LeaderUserModel
        and goes on; True on the other ranks, which only follow rank 0's commands."""
        from p2ptrain.train import ranks

        env = ranks.detect()
        if env is None:
            return False
        from p2ptrain import api_ranks

        group = api_ranks.command_group(env, model)
        if env.leader:
            self.local = api_ranks.LeaderUserModel(model, inner_steps, outer, env, group)
            return False
        self._follower = api_ranks.Follower(model, inner_steps, env, group)
        return True

    @property
    def outer_step_count(self) -> int:
        return self._follower.step_count if self._follower is not None else self.local.step

    def step(self, loss: float | torch.Tensor | None = None) -> bool:
        """Record one inner step. On every `inner_steps`-th call, block until the outer step
        finished; returns True when it changed the model (committed or caught up)."""
        if self._follower is not None:
            return self._follower.step()
        if self._error is not None:
            raise RuntimeError("the p2ptrain network thread failed") from self._error
        m = self.local
        with m.lock:
            if loss is not None:
                m.losses.append(float(loss.detach() if torch.is_tensor(loss) else loss))
            m.tokens += self.tokens_per_step
            m.calls += 1
            if m.calls < m.H:
                return False
            before = m.step
            m.lock.notify_all()
            while not m.outer_done or m.calls >= m.H:
                if self._error is not None or not self._thread.is_alive():
                    raise RuntimeError("the p2ptrain network thread stopped") from self._error
                m.lock.wait(0.5)
            return m.step != before

    def close(self) -> None:
        if self._follower is not None:
            return
        with self.local.lock:
            self.local.closed = True
            self.local.lock.notify_all()
        if self._token is not None and self._cancel is not None:
            try:
                import trio

                trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
            except Exception:
                pass
        self._thread.join(30)
        if getattr(self, "_lock", None) is not None:
            os.close(self._lock)  # the workdir is free for the next DiLoCo (the writer has finished)
            self._lock = None
        if hasattr(self.local, "release"):
            self.local.release()  # rank 0 of a multi-rank node: no rank waits for it after this

    # -- the network thread ------------------------------------------------------------
    def _serve(self) -> None:
        import trio

        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to the user's thread
            if not self.local.closed:
                self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        import trio

        from p2ptrain import peer
        from p2ptrain.events import EventSink
        from p2ptrain.net.nat import NatConfig
        from p2ptrain.net.node import Node, NodeConfig
        from p2ptrain.train.trainer import TrainerConfig

        self._token = trio.lowlevel.current_trio_token()
        events = EventSink(self.identity.peer_id_str, self._json)
        # Same NAT traversal as `p2ptrain join`: AutoNAT, relay reservations, DCUtR.
        node = Node(self.identity, NodeConfig(listen=[self._listen], bootstrap=self._bootstrap), events,
                    nat=NatConfig())
        async with trio.open_nursery() as nursery:
            self._cancel = nursery.cancel_scope
            await nursery.start(node.run)
            # the same peer as `p2ptrain join` builds (p2ptrain.peer): one composition root
            await nursery.start(functools.partial(
                peer.run_peer, node, self.spec, self.run_id, self.local, events,
                TrainerConfig(min_peers=self._min_peers), workdir=self.workdir))
            self._ready.set()

