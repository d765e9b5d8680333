"""A run's tokenizer and token stream between peers, so `join --run ID` alone works.

Every peer that holds the run's data serves it: the token arrays (train and validation, as
the data-only checkpoint format of p2ptrain.ckpt.checkpoint) are cut into content-addressed
chunks (p2ptrain.ckpt.chunks) served by its BlobServer, along with the tokenizer.json bytes,
and a signed DHT record `/p2ptrain/<run>/data` names them (chunk-manifest hash, blob hash,
tokenizer hash, addresses). A joiner that lacks the data, or whose local files tokenize to
another content hash, downloads the chunks from every provider at once with the
checkpoint download (p2ptrain.ckpt.download: per-chunk verification, donors excluded on a
bad chunk), then recomputes the token stream's content hash and accepts it only if it
equals the one the initiator signed in the manifest. The record is untrusted: a lying
provider costs time, never wrong tokens. The tokenizer is fetched by its signed hash the
same way (one blob, hash-checked).

Fetched data and tokenizers are kept under WORKDIR/data/ so a restart needs no network.
"""

from __future__ import annotations

import hashlib
import logging
import random
from pathlib import Path

import numpy as np
import trio

from p2ptrain.ckpt import checkpoint, chunks
from p2ptrain.ckpt.download import DownloadConfig, download
from p2ptrain.ckpt.fetch import FetchError, race
from p2ptrain.ckpt.providers import Choice
from p2ptrain.identity import peer_id_to_str
from p2ptrain.net.node import NodeError
from p2ptrain.records import DataRecord, RunRecords
from p2ptrain.train.data import Dataset, _hash
from p2ptrain.train.tokenize import MAX_TOKENIZER_BYTES

log = logging.getLogger("p2ptrain.train.shards")
FORMAT = "p2ptrain-tokens-v1"


def max_data_bytes(spec) -> int:
    """Most bytes a run's token blob may have (the manifest's n_tokens, when it has one)."""
    n = spec.data.n_tokens
    return 4 * int(n) + (1 << 20) if isinstance(n, int) and n > 0 else 1 << 36


# -- the token blob (pure) ---------------------------------------------------------------
def encode_dataset(ds: Dataset) -> bytes:
    dtype = ds.train.dtype.name
    # the checkpoint format has no uint32: ids of large vocabularies (< 2**31) travel as int32
    view = (lambda a: a.view(np.int32)) if dtype == "uint32" else (lambda a: a)
    return checkpoint.encode({"train": view(ds.train), "val": view(ds.val)},
                             {"format": FORMAT, "kind": ds.hash_kind, "dtype": dtype, "spec": ds.spec,
                              "files": [ds.n_train_files, ds.n_val_files]})


def decode_dataset(data: bytes, spec) -> Dataset:
    """The token stream in `data` if it is the one the run (`RunSpec`) pins; CheckpointError if not."""
    arrays, meta = checkpoint.decode(data, max_data_bytes(spec))
    dtype, kind, files = meta.get("dtype"), meta.get("kind"), meta.get("files")
    if meta.get("format") != FORMAT or dtype not in ("uint8", "uint16", "uint32") or not isinstance(kind, str):
        raise checkpoint.CheckpointError("not a token stream blob")
    if not ({"train", "val"} <= set(arrays) and arrays["train"].ndim == 1 and arrays["val"].ndim == 1):
        raise checkpoint.CheckpointError("token stream blob lacks 1-D train/val arrays")
    train, val = (arrays[k].view(np.dtype(dtype)) for k in ("train", "val"))
    if train.dtype.itemsize != arrays["train"].dtype.itemsize:
        raise checkpoint.CheckpointError("token stream blob dtype does not match its arrays")
    content = _hash(kind, train, val)
    if content != spec.data.content_hash:
        raise checkpoint.CheckpointError(f"token stream hashes to {content[:16]}..., not the run's")
    n = files if isinstance(files, list) and len(files) == 2 and all(type(x) is int for x in files) else [0, 0]
    return Dataset(spec.data.spec, train, val, content, n[0], n[1], kind)


# -- serving -------------------------------------------------------------------------------
async def serve(node, blobs, run_id: str, ds: Dataset, tokenizer: bytes | None, chunk_bytes: int) -> None:
    """Serve this peer's copy of the run's data and tokenizer, and advertise it."""
    blob = await trio.to_thread.run_sync(encode_dataset, ds)
    manifest, parts = await trio.to_thread.run_sync(chunks.split, blob, chunk_bytes)
    for h, part in zip(manifest.chunks, parts):
        blobs.add_known(h, part)
    blobs.add_known(manifest.digest(), manifest.encode())
    tok = blobs.add(tokenizer) if tokenizer else ""
    # re-stored by the DHT until we leave
    await RunRecords(node.dht, run_id).publish_data(DataRecord(manifest.digest(), manifest.sha256, tok,
                                                               tuple(node.rpc.local_addrs())))


async def _records(node, run_id: str) -> list[tuple[str, DataRecord]]:
    """Other peers' data records (their addresses go to the address book)."""
    return [(peer_id_to_str(sub), r) for sub, r in await RunRecords(node.dht, run_id).read_data()
            if sub != node.identity.peer_id]


# -- fetching --------------------------------------------------------------------------------
async def fetch_tokenizer(node, run_id: str, sha: str, timeout: float = 120.0,
                          config: DownloadConfig | None = None) -> bytes:
    """The tokenizer by its signed hash, raced among the peers whose data record names it
    (`fetch.race`: a few at a time in a random order, each with a first-byte deadline),
    so records copied by peers that never answer cannot hold the join for their timeouts."""
    config = config or DownloadConfig()

    def check(data: bytes) -> bytes:
        if hashlib.sha256(data).hexdigest() != sha:
            raise ValueError("does not match its hash")
        return data

    with trio.move_on_after(timeout):
        while True:
            peers = [peer for peer, r in await _records(node, run_id) if r.tok == sha]
            random.shuffle(peers)
            _, data, bad = await race(node.host, peers, sha, MAX_TOKENIZER_BYTES, check, width=config.race_width,
                                      first_byte=config.first_byte_timeout, timeout=30.0)
            for peer, why in bad.items():
                log.warning("tokenizer from %s: %s", peer, why)
            if data is not None:
                return data
            await trio.sleep(1.0)  # peers that failed may serve it on the next round
    raise NodeError(f"no peer served the run's tokenizer {sha[:16]}... within {timeout:.0f}s",
                    "try again when a peer of the run is online, or keep tokenizer.json next to run.toml")


async def fetch_dataset(node, run_id: str, spec, events, timeout: float = 300.0) -> tuple[Dataset, bytes]:
    """The run's token stream from peers, hash-checked against the run's signed content hash."""
    bad: set[str] = set()
    with trio.move_on_after(timeout):
        while True:
            groups: dict[tuple[str, str], list[str]] = {}
            for peer, r in await _records(node, run_id):
                if peer not in bad:
                    groups.setdefault((r.manifest, r.sha256), []).append(peer)
            if groups:
                (digest, sha), peers = max(groups.items(), key=lambda kv: len(kv[1]))
                try:
                    data, rep = await download(node.host, Choice(0, digest, sha, "", tuple(sorted(peers)), ()),
                                               max_bytes=max_data_bytes(spec))
                    ds = await trio.to_thread.run_sync(decode_dataset, data, spec)
                    events.emit("data_fetched", content_hash=ds.content_hash, tokens=ds.n_tokens, **rep.summary())
                    return ds, data
                except (FetchError, checkpoint.CheckpointError) as exc:
                    log.warning("token stream from %s rejected: %s", peers, exc)
                    if isinstance(exc, checkpoint.CheckpointError):
                        bad.update(peers)  # they serve another stream under this run
            await trio.sleep(1.0)
    raise NodeError(f"no peer served the run's data within {timeout:.0f}s", "try again when a peer of the run is online")


def _read_verified(path: Path, sha: str) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if hashlib.sha256(data).hexdigest() == sha else None


async def obtain(node, blobs, spec, run_id: str, manifest_path: str | None, workdir: Path,
                 events, chunk_bytes: int = chunks.CHUNK_BYTES) -> Dataset:
    """The run's dataset: local files, else this workdir's copy, else peers; then served."""
    from p2ptrain.train.local import DataMismatch, load_run_data

    store = Path(workdir) / "data"
    sha = spec.data.tokenizer_sha256 or ""
    tok = None
    if sha:
        places = ([Path(manifest_path).parent / "tokenizer.json"] if manifest_path else []) + [store / f"{sha}.json"]
        tok = next((d for d in (_read_verified(p, sha) for p in places) if d is not None), None)
        if tok is None:
            tok = await fetch_tokenizer(node, run_id, sha)
            await trio.to_thread.run_sync(_save, store / f"{sha}.json", tok)
    content = spec.data.content_hash
    try:
        ds = await trio.to_thread.run_sync(load_run_data, spec, tok)
    except (DataMismatch, ValueError) as exc:
        cached = store / f"{content}.p2ck"
        ds = None
        if cached.is_file():
            try:
                ds = await trio.to_thread.run_sync(decode_dataset, cached.read_bytes(), spec)
            except checkpoint.CheckpointError:
                log.warning("%s is damaged; fetching the data again", cached)
        if ds is None:
            log.info("run data not usable locally (%s); fetching it from peers", exc)
            events.emit("data_fetch_started", reason=str(exc)[:200])
            try:
                ds, blob = await fetch_dataset(node, run_id, spec, events)
            except NodeError as err:
                raise NodeError(f"{err} (and locally: {exc})", "give the run's data files at the manifest's "
                                "path, or try again when a peer of the run is online") from None
            await trio.to_thread.run_sync(_save, cached, blob)
    await serve(node, blobs, run_id, ds, tok, chunk_bytes)
    return ds


def _save(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.write_atomic(path, data)
