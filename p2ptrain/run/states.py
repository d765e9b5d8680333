"""A run's `state` records over the DHT: publishing ours, reading everyone's.

Each member stores its newest state (outer step, params hash, checkpoint hash, losses,
addresses, connection counts) under `keys.state(run)` after every committed step. Readers:
catch-up and the election (`latest_state`, `peers_at_step`), `p2ptrain status` and the
dashboard (`run_states`). The codec is `p2ptrain.run.records`; this module adds only the DHT
I/O, so it stays free of torch, numba and the all-reduce.
"""

from __future__ import annotations

import logging

from p2ptrain.ckpt import providers
from p2ptrain.identity import peer_id_to_str
from p2ptrain.run import keys, records

log = logging.getLogger("p2ptrain.run.states")
STATE_TTL = 600.0


async def publish(dht, run_id: str, state: records.State) -> int:
    return await dht.store(keys.state(run_id), records.encode_state(state), ttl=STATE_TTL)


async def read(dht, run_id: str) -> list[tuple[bytes, records.State]]:
    """Every peer's published state, decoded once: (peer id bytes, state). Providers'
    addresses go to the address book, so their checkpoints can be fetched."""
    out = []
    for sub, rec in (await dht.get(keys.state(run_id))).items():
        try:
            st = records.decode_state(rec.value)
        except records.RecordError as exc:
            log.info("state record of %s dropped: %s", peer_id_to_str(sub), exc)
            continue
        out.append((sub, st))
        dht.transport.learn_addrs(sub, list(st.addrs))
    return out


async def run_states(dht, run_id: str) -> dict[str, dict]:
    """peer id -> its published state (step, params hash, checkpoint hash, losses, addrs)."""
    return {peer_id_to_str(sub): st.to_dict() for sub, st in await read(dht, run_id)}


async def peers_at_step(dht, run_id: str, step: int) -> set[str]:
    """Peers whose published state is at outer step `step` (they are training it now)."""
    return {peer_id_to_str(sub) for sub, st in await read(dht, run_id) if st.step == step}


async def latest_state(dht, run_id: str) -> tuple[int, str, list[bytes]] | None:
    """(step, checkpoint hash, providers) of the run's current state: the one the most peers
    publish (`p2ptrain.ckpt.providers.best_state`: one record's word is not the run's state)."""
    votes: dict[tuple[int, str], list[bytes]] = {}
    for sub, st in await read(dht, run_id):
        votes.setdefault((st.step, st.ckpt), []).append(sub)
    best = providers.best_state(votes)
    if best is None:
        return None
    (step, digest), publishers = best
    return step, digest, publishers
