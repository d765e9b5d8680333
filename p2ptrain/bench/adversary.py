"""Hostile peers for the benches that attack a real run (`p2ptrain bench redteam`).

`python -m p2ptrain.bench.adversary MODE join ...` is a real `p2ptrain join` process (node,
DHT, all-reduce service, trainer) built with one hostile part: the runner's `Parts` seam
(`p2ptrain.run.runner.run_training(parts=...)`). The product has no switch for any of this:
`join` itself never misbehaves. Tests reuse these parts (tests/fakes/).

Modes:
  forge    signs its contribution header with a key that is not its own
  nan      sends NaN values, with a header claiming finite norms
  norm     sends its pseudo-gradient scaled 1000x (honest header)
  replay   re-sends the header it would have signed for the previous step
  signflip sends -10 x its pseudo-gradient (header true to the bytes it sends)
  noise    sends Gaussian noise with 10 x its pseudo-gradient's norm
  zeros    free-rides: sends zeros
  early-ready  claims ready_at = 1.0 in every ready record (issue 15, hole 2)
  chunknorm    signs its true total norm but chunk norms of 1e30, and sends 1000 x its
               pseudo-gradient (hole 4: frames are bounded by the chunk norms)
  sybil        free-rides (zeros, which earn no standing) in the first 2 steps it takes
               part in, then sends -4 x its pseudo-gradient, header true to it: within the
               10x-median outlier rule; one such peer among 4 honest cancels their mean
               (what standing's probation is for, p2ptrain.run.standing)
  chunk    trains honestly but serves every blob (checkpoint chunks, chunk manifests) with
           one byte flipped
  withhold trains and sends honest data, but withholds its commit vote in every ring round:
           after its data plane it closes its ring channels instead of joining the vote
           gather (issue 15, "withheld votes"); its group holds no certificate, so the round
           must abort on every member, never commit on some
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import numpy as np
import trio

import p2ptrain  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from p2ptrain.ckpt.fetch import BlobServer
from p2ptrain.identity import Identity
from p2ptrain.reduce import ring
from p2ptrain.reduce.service import AllReduceService, _Plane
from p2ptrain.run.round import Contributor

CONTRIBUTION_MODES = ("forge", "nan", "norm", "replay", "signflip", "noise", "zeros", "early-ready",
                      "chunknorm", "sybil")
# What an honest-about-its-bytes attacker scales its header's norms by.
_HEADER_SCALE = {"norm": 1000.0, "zeros": 0.0, "sybil": 4.0, "signflip": 10.0, "noise": 10.0}


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


class WithholdingService(AllReduceService):
    """Runs the ring's data plane honestly, then never sends its vote: it closes both ring
    channels (its neighbours' vote gathers fail at once) and signs nothing, so no member can
    hold a certificate. Its own `_decide` then asks for one (none exists) and aborts."""

    withheld = 0

    def _ring_and_votes(self, vec, rnd, mesh, cfg, timeout, own, check, out) -> _Plane:
        world = len(rnd.ids)
        send_ch, recv_ch = mesh.sends.get(0), mesh.recvs.get(0)
        result, sent, digest = ring.allreduce(vec, rnd.rank, world, send_ch, recv_ch, cfg, timeout, own, check,
                                              out, self._arenas)
        plane = _Plane(result, sent, digest, t_data=trio.from_thread.run_sync(trio.current_time))
        if world == 1:  # alone: nobody to withhold from
            plane.sigs = [self.board.sign_vote(rnd, digest)]
            return plane
        for ch in (send_ch, recv_ch):
            if ch is not None:
                ch.close()
        self.withheld += 1
        plane.gather_error = "vote withheld"
        return plane


class HostileContributor(Contributor):
    def __init__(self, mode: str) -> None:
        if mode not in CONTRIBUTION_MODES:
            raise ValueError(f"unknown contribution attack {mode!r}; one of {', '.join(CONTRIBUTION_MODES)}")
        self.mode = mode
        self.steps_seen: set[int] = set()  # sybil: steps it signed a header for
        self.attacking = False

    def payload(self, delta: np.ndarray) -> np.ndarray:
        if self.mode == "nan":
            bad = delta.copy()
            bad[::7] = np.nan
            return bad
        if self.mode in ("norm", "chunknorm"):
            return delta * np.float32(1000.0)
        if self.mode == "signflip":
            return delta * np.float32(-10.0)
        if self.mode == "sybil":
            self.attacking = len(self.steps_seen) >= 2
            return delta * np.float32(-4.0) if self.attacking else np.zeros_like(delta)
        if self.mode == "noise":
            z = np.random.default_rng(0).standard_normal(delta.size)
            return (z * (10 * np.linalg.norm(delta) / max(np.linalg.norm(z), 1e-30))).astype(np.float32)
        if self.mode == "zeros":
            return np.zeros_like(delta)
        return delta

    def sign(self, header, identity: Identity) -> bytes:
        if self.mode == "forge":
            return super().sign(header, Identity.generate())
        if self.mode == "sybil":
            self.steps_seen.add(header.step)
        if self.mode in _HEADER_SCALE:  # honest about the bytes it sends
            f = 0.0 if self.mode == "sybil" and not self.attacking else _HEADER_SCALE[self.mode]
            header = dataclasses.replace(header, chunk_norms=tuple(f * x for x in header.chunk_norms),
                                         norm=f * header.norm)
        elif self.mode == "chunknorm":  # true total, chunk norms that admit anything
            header = dataclasses.replace(header, chunk_norms=tuple(1e30 for _ in header.chunk_norms))
        elif self.mode == "replay":
            header = dataclasses.replace(header, step=header.step - 1)
        return super().sign(header, identity)

    def ready_at(self, now: float) -> float:
        return 1.0 if self.mode == "early-ready" else now


def parts_for(mode: str):
    from p2ptrain.run.runner import Parts

    if mode == "chunk":
        return Parts(blob_server=CorruptBlobServer)
    if mode == "withhold":
        return Parts(service=WithholdingService)
    HostileContributor(mode)  # validates the mode
    return Parts(contributor=functools.partial(HostileContributor, mode))


def main(argv: list[str], parts_for=parts_for) -> int:
    from p2ptrain.cli.main import main as cli_main
    from p2ptrain.run import runner

    mode, rest = argv[0], argv[1:]
    runner.run_training = functools.partial(runner.run_training, parts=parts_for(mode))
    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
