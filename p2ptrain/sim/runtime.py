"""How a simulated peer runs: its node, event sink and disk, and the deterministic trio run.

`SimNode` is what `p2ptrain.peer.run_peer` needs of a node; `SimEvents` feeds every event
to the world (and its invariants); `SimWriter` is the workdir that survives restarts.
`inline_to_thread` and `deterministic_deadlines` make one seed replay exactly
(`p2ptrain.sim.world.simulate` installs them for a run and restores trio after).
"""

from __future__ import annotations

import types

import trio

from p2ptrain.dht.node import DHTNode
from p2ptrain.identity import Identity
from p2ptrain.sim import model as vmodel
from p2ptrain.sim.host import SimHost
from p2ptrain.sim.net import SimNet


class SimEvents:
    """A peer's event sink (`p2ptrain.events.EventSink`'s interface) that feeds the world."""
    json_mode = True

    def __init__(self, world, name: str) -> None:
        self.world, self.peer = world, name

    def emit(self, event: str, **fields) -> dict:
        self.world.on_event(self.peer, event, fields)
        return fields


class SimNode:
    """What `p2ptrain.peer.run_peer` needs of a node, on the simulated network."""

    def __init__(self, identity: Identity, dht: DHTNode, host: SimHost, net: SimNet) -> None:
        self.identity, self.dht, self.rpc, self.host = identity, dht, dht.transport, host
        self.net = net
        self.config = types.SimpleNamespace(listen=[])  # nothing to bind: `peer.listen_ip` gives 0.0.0.0

    def conn_counts(self) -> dict[str, int]:
        return {"direct": 0}


class SimWriter:
    """The peer's checkpoint directory: kept across its restarts (its workdir)."""

    def __init__(self, disk: dict, key: bytes) -> None:
        self.disk, self.key = disk, key

    def submit(self, step: int, data: bytes) -> None:
        self.disk[self.key] = bytes(data)

    def close(self, timeout: float = 0.0) -> bool:
        return True


async def inline_to_thread(fn, *args, **_kw):
    """`trio.to_thread.run_sync` in the simulator: the call runs here, then its simulated cost."""
    vmodel.take_cost()
    out = fn(*args)
    await trio.sleep(vmodel.take_cost())
    return out


def deterministic_deadlines():
    """trio breaks ties between equal deadlines by id(cancel scope), a memory address: two
    peers waking at the same simulated instant would wake in another order in another run.
    While the simulator runs, ties break by the order the scopes were first seen instead
    (trio private API, trio 0.2x/0.3x; returns the original to restore)."""
    import heapq
    import itertools
    import weakref

    real = trio._core._run.Deadlines.add
    order: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    counter = itertools.count()

    def add(self, deadline, cancel_scope) -> None:
        tie = order.get(cancel_scope)
        if tie is None:
            tie = order[cancel_scope] = next(counter)
        heapq.heappush(self._heap, (deadline, tie, cancel_scope))
        self._active += 1

    trio._core._run.Deadlines.add = add
    return real
