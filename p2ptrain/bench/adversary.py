"""TEST ONLY: scripted misbehaviour for the hostile-peer tests.

A node runs one of these only when started with P2PTRAIN_ADVERSARY=<mode> (read by `join`);
honest nodes use `Honest`, which changes nothing. Keeping the attacks in one clearly named
module keeps them out of the real code paths.

Modes:
  forge   signs its contribution header with a key that is not its own
  nan     sends NaN values, with a header claiming finite norms
  norm    sends its pseudo-gradient scaled 1000x (honest header)
  replay  re-sends the header it would have signed for the previous step
  chunk   trains honestly but serves every blob (checkpoint chunks, chunk manifests) with
          one byte flipped
  signflip  sends -10 x its pseudo-gradient (header true to the bytes it sends)
  noise     sends Gaussian noise with 10 x its pseudo-gradient's norm
  zeros     free-rides: sends zeros
The last three are what robust aggregation is for (bench robust runs the same attacks).
Issue 15's red team (`bench redteam`) adds:
  early-ready  claims ready_at = 1.0 in every ready record (hole 2: the election deadline)
  chunknorm    signs its true total norm but chunk norms of 1e30, and sends 1000 x its
               pseudo-gradient (hole 4: frames are bounded by the chunk norms)
  sybil        free-rides (zeros, which earn no standing) in the first 2 steps it takes
               part in, then sends -4 x its pseudo-gradient, header true to it: within the
               10x-median outlier rule, and one such peer among 4 honest cancels their mean
               (what standing's probation is for)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from p2ptrain.identity import Identity

MODES = ("forge", "nan", "norm", "replay", "chunk", "signflip", "noise", "zeros", "early-ready", "chunknorm",
         "sybil")


def flip_one_byte(data: bytes) -> bytes:
    if not data:
        return data
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    return bytes(bad)


class Honest:
    tamper = None  # what a BlobServer does to the bytes it serves (None: nothing)

    def corrupt(self, delta: np.ndarray) -> np.ndarray:
        return delta

    def header(self, header, identity: Identity, sign) -> bytes:
        return sign(header, identity)

    def ready_at(self, now: float) -> float:
        return now


class Adversary(Honest):
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.steps_seen: set[int] = set()  # sybil: steps it sent a header for
        self.attacking = False
        if mode == "chunk":
            self.tamper = flip_one_byte

    def corrupt(self, delta: np.ndarray) -> np.ndarray:
        if self.mode == "nan":
            bad = delta.copy()
            bad[::7] = np.nan
            return bad
        if self.mode == "norm":
            return delta * np.float32(1000.0)
        if self.mode == "signflip":
            return delta * np.float32(-10.0)
        if self.mode == "noise":
            z = np.random.default_rng(0).standard_normal(delta.size)
            return (z * (10 * np.linalg.norm(delta) / max(np.linalg.norm(z), 1e-30))).astype(np.float32)
        if self.mode == "zeros":
            return np.zeros_like(delta)
        if self.mode == "chunknorm":
            return delta * np.float32(1000.0)
        if self.mode == "sybil":
            self.attacking = len(self.steps_seen) >= 2
            return delta * np.float32(-4.0) if self.attacking else np.zeros_like(delta)
        return delta

    def ready_at(self, now: float) -> float:
        return 1.0 if self.mode == "early-ready" else now

    def header(self, header, identity: Identity, sign) -> bytes:
        if self.mode == "forge":
            return sign(header, Identity.generate())
        if self.mode == "norm":  # honest about its own (huge) norms
            scaled = dataclasses.replace(header, chunk_norms=tuple(1000 * x for x in header.chunk_norms),
                                         norm=1000 * header.norm)
            return sign(scaled, identity)
        if self.mode == "chunknorm":  # true total, chunk norms that admit anything
            return sign(dataclasses.replace(header, chunk_norms=tuple(1e30 for _ in header.chunk_norms)), identity)
        if self.mode == "sybil":
            self.steps_seen.add(header.step)
        if self.mode in ("signflip", "noise", "zeros", "sybil"):  # honest about the bytes it sends
            f = {"zeros": 0.0, "sybil": 4.0 if self.attacking else 0.0}.get(self.mode, 10.0)
            scaled = dataclasses.replace(header, chunk_norms=tuple(f * x for x in header.chunk_norms),
                                         norm=f * header.norm)
            return sign(scaled, identity)
        if self.mode == "replay":
            return sign(dataclasses.replace(header, step=header.step - 1), identity)
        return sign(header, identity)


def make(mode: str) -> Honest:
    if not mode:
        return Honest()
    if mode not in MODES:
        raise ValueError(f"unknown adversary mode {mode!r}; one of {', '.join(MODES)}")
    return Adversary(mode)
