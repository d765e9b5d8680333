"""The ring's wire buffers: one preallocated arena per round and direction of use, and a
pool that keeps them for the next round of the same shape (`p2ptrain.reduce.ring`).

Pure memory bookkeeping: no I/O, no threads of its own (the pool takes a lock because a
round's sender thread may still hold an arena when another round asks for one).
"""

from __future__ import annotations

import threading

import numpy as np

from p2ptrain.reduce.schedule import RingConfig, wire_bytes


class Arena:
    """One preallocated wire buffer holding a payload per (chunk, sub), in (chunk, sub)
    order. np.empty, not bytearray: nothing is zero-filled, every byte is written before it
    is read or sent."""

    def __init__(self, lay: list[list[tuple[int, int]]], cfg: RingConfig) -> None:
        self.cfg = cfg
        self.at: dict[tuple[int, int], tuple[int, int, int]] = {}  # (c, j) -> (offset, nbytes, m)
        off = 0
        for c, subs in enumerate(lay):
            for j, (lo, hi) in enumerate(subs):
                nb = wire_bytes(hi - lo, cfg)
                self.at[(c, j)] = (off, nb, hi - lo)
                off += nb
        self.buf = np.empty(off, np.uint8)

    def view(self, c: int, j: int) -> memoryview:
        off, nb, _ = self.at[(c, j)]
        return memoryview(self.buf[off:off + nb])

    def parts(self, c: int, j: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Array views of one payload: (fp32 values, None) or (int8 q, uint8 meta)."""
        off, nb, m = self.at[(c, j)]
        if self.cfg.mode == "fp32":
            return self.buf[off:off + nb].view(np.float32), None
        return self.buf[off:off + m].view(np.int8), self.buf[off + m:off + nb]


class ArenaPool:
    """Keeps a round's wire arenas for the next round of the same shape (thread-safe).

    Fresh buffers cost a page fault per 4 KiB on every round: ~8 ms of a member's ~100 ms of
    CPU in a 64 MiB round here. The raw-socket ceiling allocates once too. Holds at most
    `limit` arenas (two per ring round, about half the fp32 tensor's size between them)."""

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self._free: list[tuple[tuple, Arena]] = []
        self._lock = threading.Lock()

    def take(self, key: tuple, lay, cfg: RingConfig) -> Arena:
        with self._lock:
            for i, (k, arena) in enumerate(self._free):
                if k == key:
                    return self._free.pop(i)[1]
        return Arena(lay, cfg)

    def give(self, key: tuple, arena: Arena | None) -> None:
        if arena is None:
            return
        with self._lock:
            self._free.append((key, arena))
            if len(self._free) > self.limit:
                del self._free[:len(self._free) - self.limit]
