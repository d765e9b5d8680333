"""Who trains which step, from the members' `state` records.

Each member stores its newest state (outer step, params hash, checkpoint hash, losses,
addresses, connection counts) after every committed step (`RunRecords.publish_state`). The
election reads them to know whom to expect (`peers_at_step`); `p2ptrain status` and the
dashboard read them through `p2ptrain.records.RunRecords.state_view`. Which state a peer
adopts is not a vote of these records: it is the run's head, chosen from provider records
(`p2ptrain.ckpt.providers.choose`, docs/PROTOCOL.md rule H1).
"""

from __future__ import annotations

from p2ptrain.identity import peer_id_to_str
from p2ptrain.records import RunRecords


async def peers_at_step(dht, run_id: str, step: int) -> set[str]:
    """Peers whose published state is at outer step `step` (they are training it now)."""
    return {p for p, s in (await peer_steps(dht, run_id)).items() if s == step}


async def peer_steps(dht, run_id: str) -> dict[str, int]:
    """peer -> the outer step of its published state."""
    return {peer_id_to_str(sub): st.step for sub, st in await RunRecords(dht, run_id).read_states()}
