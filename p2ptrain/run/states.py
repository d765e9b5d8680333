"""The run's current state, from its members' `state` records.

Each member stores its newest state (outer step, params hash, checkpoint hash, losses,
addresses, connection counts) after every committed step (`RunRecords.publish_state`). This
module reads them for catch-up and the election (`latest_state`, `peers_at_step`); `p2ptrain
status` and the dashboard read them through `p2ptrain.records.RunRecords.state_view`.
"""

from __future__ import annotations

from p2ptrain.ckpt import providers
from p2ptrain.identity import peer_id_to_str
from p2ptrain.records import RunRecords


async def peers_at_step(dht, run_id: str, step: int) -> set[str]:
    """Peers whose published state is at outer step `step` (they are training it now)."""
    return {peer_id_to_str(sub) for sub, st in await RunRecords(dht, run_id).read_states() if st.step == step}


async def latest_state(dht, run_id: str) -> tuple[int, str, list[bytes]] | None:
    """(step, checkpoint hash, providers) of the run's current state: the one the most peers
    publish (`p2ptrain.ckpt.providers.best_state`: one record's word is not the run's state)."""
    votes: dict[tuple[int, str], list[bytes]] = {}
    for sub, st in await RunRecords(dht, run_id).read_states():
        votes.setdefault((st.step, st.ckpt), []).append(sub)
    best = providers.best_state(votes)
    if best is None:
        return None
    (step, digest), publishers = best
    return step, digest, publishers
