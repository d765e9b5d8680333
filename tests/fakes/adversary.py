"""Hostile components for tests: fakes of the parts a trainer is built from
(`p2ptrain.run.runner.Parts`), each misbehaving one way. The product has no switch for any
of this; tests/fakes/hostile_peer.py starts a real peer built from these parts.

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
  ckpt-pause:STEP:SECONDS  trains honestly, but stalls halfway through writing that step's
          checkpoint (so a test can SIGKILL it mid-write)
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from p2ptrain.ckpt import checkpoint
from p2ptrain.ckpt.fetch import BlobServer
from p2ptrain.identity import Identity
from p2ptrain.run.round import Contributor

CONTRIBUTION_MODES = ("forge", "nan", "norm", "replay", "signflip", "noise", "zeros")


def flip_one_byte(data: bytes) -> bytes:
    if not data:
        return data
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    return bytes(bad)


class CorruptBlobServer(BlobServer):
    """Serves every blob through `corrupt` (default: one byte flipped)."""

    def __init__(self, host, *args, corrupt=flip_one_byte, **kwargs) -> None:
        super().__init__(host, *args, **kwargs)
        self.corrupt = corrupt

    def view(self, blob) -> memoryview:
        return memoryview(self.corrupt(bytes(blob)))


class HostileContributor(Contributor):
    def __init__(self, mode: str) -> None:
        if mode not in CONTRIBUTION_MODES:
            raise ValueError(f"unknown contribution attack {mode!r}; one of {', '.join(CONTRIBUTION_MODES)}")
        self.mode = mode

    def payload(self, delta: np.ndarray) -> np.ndarray:
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
        return delta

    def sign(self, header, identity: Identity) -> bytes:
        if self.mode == "forge":
            return super().sign(header, Identity.generate())
        if self.mode in ("norm", "signflip", "noise", "zeros"):  # honest about the bytes it sends
            f = {"norm": 1000.0, "zeros": 0.0}.get(self.mode, 10.0)
            header = dataclasses.replace(header, chunk_norms=tuple(f * x for x in header.chunk_norms),
                                         norm=f * header.norm)
        elif self.mode == "replay":
            header = dataclasses.replace(header, step=header.step - 1)
        return super().sign(header, identity)


class PausingWriter(checkpoint.AsyncWriter):
    """Writes half of step `pause_step`'s file, says so, then stalls `seconds` (a real torn
    write, as a crash mid-write leaves it)."""

    def __init__(self, directory, keep, on_written=None, *, events=None, pause_step: int, seconds: float) -> None:
        super().__init__(directory, keep, on_written)
        self.events, self.pause_step, self.seconds = events, pause_step, seconds

    def _write(self, step: int, data: bytes) -> None:
        if step != self.pause_step:
            return super()._write(step, data)
        path = self.path(step)
        with open(checkpoint.tmp_path(path), "wb") as f:
            f.write(memoryview(data)[:len(data) // 2])
            f.flush()
        if self.events is not None:
            self.events.emit("checkpoint_write_paused", step=step)
        time.sleep(self.seconds)
        super()._write(step, data)
