"""Joining a run: get and verify the manifest, data and starting state, then train.

`p2ptrain join --manifest` has everything locally; `--run ID` gets the manifest from the
DHT (checked against the id: any peer may serve it) and the state from peers by hash. A
restarted peer resumes from its newest local checkpoint and catches up if the run moved on.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio

from p2ptrain import peer
from p2ptrain.ckpt import checkpoint
from p2ptrain.run import manifest as mf
from p2ptrain.config import ConfigError, resolve
from p2ptrain.ckpt.catchup import fetch_checkpoint
from p2ptrain.ckpt.download import Resume
from p2ptrain.ckpt.fetch import FetchError, ServeConfig
from p2ptrain.net.node import NodeError
from p2ptrain.peer import Parts, checkpoint_dir, make_writer  # noqa: F401 - re-exported for callers
from p2ptrain.records import RunRecords
from p2ptrain.run.roundparts import transfer_budget
from p2ptrain.run.spec import RunSpec
from p2ptrain.train.lineage import CATCH_UP_WAIT
from p2ptrain.train.trainer import TrainerConfig

log = logging.getLogger("p2ptrain.run.runner")


async def get_manifest(dht, run_id: str, timeout: float = 60.0, progress_every: float = 5.0) -> dict:
    """The run's manifest from the DHT, verified against its id. Says every `progress_every`
    seconds what it still waits for: a run nobody serves used to mean a minute of silence."""
    start = trio.current_time()
    note_at = start + progress_every
    with trio.move_on_after(timeout):
        while True:
            m, copies = await RunRecords(dht, run_id).read_manifest()
            if m is not None:
                return m
            if (now := trio.current_time()) >= note_at:
                note_at = now + progress_every
                log.info("waiting for run %s...'s manifest: %s (%.0fs of %.0fs; a peer of that run must be "
                         "online)", run_id[:16], f"{copies} copies found, none valid" if copies else
                         "no peer has published it yet", now - start, timeout)
            await trio.sleep(1.0)
    raise NodeError(f"no peer served a valid manifest for run {run_id[:16]}... within {timeout:.0f}s",
                    "check the run id, and that a peer of that run is online")


def newest_local_checkpoint(workdir: Path, run_id: str) -> bytes | None:
    d = checkpoint_dir(workdir, run_id)
    for path in sorted(d.glob("step-*.p2ck"), reverse=True):
        data = path.read_bytes()
        try:
            checkpoint.decode(data)
            return data
        except checkpoint.CheckpointError:
            log.warning("checkpoint %s is damaged; trying an older one", path)
    return None


async def starting_state(node, spec: RunSpec, run_id: str, manifest_path: str | None, workdir: Path,
                         events) -> bytes:
    local = await trio.to_thread.run_sync(newest_local_checkpoint, workdir, run_id)
    if local is not None:
        return local
    genesis = spec.genesis.sha256
    if manifest_path:
        path = Path(manifest_path).parent / "genesis.p2ck"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise NodeError(f"{path} is missing", "keep genesis.p2ck next to run.toml") from None
        if checkpoint.sha256(data) != genesis:
            raise NodeError(f"{path} does not match the manifest's genesis hash", "re-run `p2ptrain init`")
        return data
    # Start from the genesis whenever we can rebuild it (the model config and seed imply it; an
    # HF model's weights file does not travel): the trainer then adopts the run's head through
    # its catch-up, which scores a head against the genesis before loading it
    # (`scorer.checked_load`). A newcomer that loaded the best-attested head unchecked took a
    # planted state of noise for the run (red team `plant`: 3 of 4 honest peers at step 10**6).
    rebuilt = await trio.to_thread.run_sync(rebuilt_genesis, spec)
    if rebuilt is not None:
        return rebuilt
    return await fetch_state(node, run_id, spec, events)


def rebuilt_genesis(spec: RunSpec) -> bytes | None:
    """The run's genesis rebuilt from its manifest, if it hashes to the signed one (blocking)."""
    from p2ptrain.train.local import genesis_state

    if spec.model.config.get("kind") == "hf":  # its genesis is a weights file, and rebuilding costs a model
        return None
    try:
        data = genesis_state(spec)
    except (ValueError, OSError, RuntimeError) as exc:  # e.g. an HF model whose weights we lack
        log.info("cannot rebuild the genesis here: %s", exc)
        return None
    return data if checkpoint.sha256(data) == spec.genesis.sha256 else None


async def fetch_state(node, run_id: str, spec: RunSpec, events, timeout: float | None = None) -> bytes:
    """A newcomer's starting state: the run's best-attested checkpoint, from its peers, within
    `timeout` (default: its bytes at the bulk floor rate, at least `CATCH_UP_WAIT`:
    `roundparts.transfer_budget`), and within `CATCH_UP_WAIT` of the last fetch tried when
    nobody advertises one (a wrong run id must not wait out a big model's budget)."""
    if timeout is None:
        timeout = transfer_budget(peer.service_config(spec), spec.genesis.bytes, CATCH_UP_WAIT)
    idle = min(timeout, CATCH_UP_WAIT)
    idle_until = trio.current_time() + idle
    resume = Resume()  # a try whose donors all failed leaves its verified chunks to the next
    with trio.move_on_after(timeout):
        while trio.current_time() <= idle_until:
            try:
                got = await fetch_checkpoint(node, run_id, spec, events, resume=resume)
            except FetchError as exc:
                log.warning("state fetch failed: %s", exc)
                got, idle_until = None, trio.current_time() + idle
            if got is not None and got[1] is not None:
                return got[1]
            await trio.sleep(1.0)
    raise NodeError(f"could not fetch the run's state from any peer within {timeout:.0f}s", "try again later")


async def run_training(node, manifest: dict | None, run_id: str, manifest_path: str | None, workdir: Path,
                       events, config: TrainerConfig, parts: Parts = Parts(), device=None) -> None:
    from p2ptrain.train import shards
    from p2ptrain.train.device import DeviceConfig
    from p2ptrain.train.local import LocalModel

    if manifest is None:
        manifest = await get_manifest(node.dht, run_id)
    try:
        spec = RunSpec.from_dict(manifest)
    except mf.ManifestError as exc:
        raise NodeError(str(exc), "upgrade p2ptrain to join this run") from None
    try:
        serve_cfg = resolve(ServeConfig, section="serve")
    except ConfigError as exc:
        raise NodeError(str(exc), "fix the P2PTRAIN_SERVE_* variable") from None
    blobs = peer.blob_server(node, parts, serve_cfg)
    blobs.add(mf.encode(manifest))
    await RunRecords(node.dht, run_id).publish_manifest(manifest)
    # local files, else peers (hash-checked against the run's signed content hash); then served
    ds = await shards.obtain(node, blobs, spec, run_id, manifest_path, workdir, events, serve_cfg.chunk_kib << 10)
    state = await starting_state(node, spec, run_id, manifest_path, workdir, events)
    try:
        dc = device or DeviceConfig()
        local = await trio.to_thread.run_sync(parts.local or LocalModel, spec, ds, node.identity.peer_id, state, config.threads,
                                              dc.device, dc.precision)
    except checkpoint.CheckpointError as exc:
        # Hash-checked bytes that still do not fit this run's model: a broken local
        # checkpoint, or a state its group attested wrongly. Say so; never train on it.
        raise NodeError(f"the run's state does not load: {exc}",
                        "move the workdir's checkpoints/ aside to start from the peers' state, or try again later") from None
    except ValueError as exc:  # a run this node cannot train as configured (e.g. fragments, torchrun ranks)
        raise NodeError(f"cannot train this run here: {exc}", "join it as one process per node, or start another run") from None
    await peer.run_peer(node, spec, run_id, local, events, config, workdir=workdir, parts=parts, blobs=blobs)
