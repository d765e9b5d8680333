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
  dropfwd  trains and sends its own contribution honestly, but every reduce-scatter partial
           sum it receives is dropped after it passed the frame check: what it forwards
           carries only its own values, and as the owner of its chunk it publishes
           own / W. Smaller norms pass every check, it signs honest votes on the bytes
           everyone decodes, so the round commits without half of the other members'
           chunk contributions (issue 15, hole 5: known, not defended; DESIGN "What ring
           verification can and cannot catch"). Ring rounds only (robust rounds: honest).
  anti     sends -ANTI_SCALE (2.5) x its pseudo-gradient from its first step, header true to
           it: an update against descent, as large as the tightest norm bound allows (an
           honest anchor's probation factor, 3x: `run.influence.objections`) with a margin
           for the spread of honest norms, since it signs before it sees theirs (issue 32
           item 9: k such Sybils against H honest members)
  selective:PEER,...  exchanges round control traffic (roster confirmations, headers,
           votes) only with the listed peers: it sends to nobody else and resets every
           control stream anyone else opens to it (issue 31 item 5, issue 32 "selective")
  inflate:PEER,...    names the listed peers (its Sybil pool) in every roster confirmation
           it sends, its view hashed as an honest one (view inflation)
  slowloris           trains honestly, but every bulk frame it sends (data and votes)
           leaves one byte every 0.1 s, and it never votes to abort (issue 32 item 4)
  trickle             trains honestly, but is silent 0.9 x the others' frame timeout before
           each bulk frame it sends, then sends it whole: no frame breaks a rule, so nobody is
           blamed, and every round it is in closes at its data budget (the simulator's
           `trickle`, `sim.attacks.slowest`); it never votes to abort
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

import numpy as np
import trio

import p2ptrain  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from p2ptrain.ckpt.fetch import BlobServer
from p2ptrain import kernels as K
from p2ptrain.identity import Identity, peer_id_from_str, public_from_peer_id_bytes, verify
from p2ptrain.reduce import ring, ringvote
from p2ptrain.reduce.ctlstreams import CONTROL_PROTOCOL
from p2ptrain.reduce.outcome import Plane
from p2ptrain.reduce.service import VOTE_PROTOCOL, AllReduceService
from p2ptrain.run.round import Contributor
from p2ptrain.bench.trickle import PausingService, TricklingService

CONTRIBUTION_MODES = ("forge", "nan", "norm", "replay", "signflip", "noise", "zeros", "early-ready",
                      "chunknorm", "sybil", "anti")
ANTI_SCALE = 2.5
"""The anti-update's size in units of the Sybil's own honest norm: under the probation bound
(3 x an honest member's anchor, its own norm this round), with room for honest norms up to
17 % below the Sybil's own."""
# What an honest-about-its-bytes attacker scales its header's norms by.
_HEADER_SCALE = {"norm": 1000.0, "zeros": 0.0, "sybil": 4.0, "signflip": 10.0, "noise": 10.0, "anti": ANTI_SCALE}


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

    def _ring_and_votes(self, vec, rnd, mesh, cfg, timeout, extras, since=None, gating=None) -> Plane:
        world = len(rnd.ids)
        send_ch, recv_ch = mesh.sends.get(0), mesh.recvs.get(0)
        own, check, out, on_own = extras[:4]
        result, sent, digest = ring.allreduce(vec, rnd.rank, world, send_ch, recv_ch, cfg, timeout, own, check,
                                              out, self._arenas, on_own)
        plane = Plane(result, sent, digest, t_data=trio.from_thread.run_sync(trio.current_time))
        if world == 1:  # alone: nobody to withhold from
            plane.sigs = [self.board.sign_vote(rnd, digest)]
            return plane
        for ch in (send_ch, recv_ch):
            if ch is not None:
                ch.close()
        self.withheld += 1
        plane.gather_error = "vote withheld"
        return plane


class _DroppingRound(ring._RingRound):
    """The honest ring schedule, except that every reduce-scatter frame it receives is
    replaced by zeros after the frame check saw it (it was honest: nobody is blamed) and
    before it is mixed in. `dropped` keeps what was thrown away (fp32, per element)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.dropped = np.zeros_like(self.vec)
        self.dropped_terms = 0  # (member, chunk) contributions thrown away
        self._zeros = np.zeros(self.scratch.size, np.float32)

    def step(self, fid, c: int, j: int, buf: memoryview) -> None:
        if fid.step <= self.world - 2:  # a partial sum of fid.step + 1 members' chunk c
            lo, hi = self.lay[c][j]
            m = hi - lo
            if self.fp32:
                vals = np.frombuffer(buf, np.float32)
                self.dropped[lo:hi] = vals
                vals[:] = 0.0
            else:
                q, meta = ring._split(buf, m)
                K.dequantize(q, meta, self.cfg.block, out=self.dropped[lo:hi])
                K.quantize(self._zeros[:m], self.cfg.block, q=q, meta=meta)
            if j == 0:
                self.dropped_terms += fid.step + 1
        super().step(fid, c, j, buf)


def dropping_allreduce(vec, rank, world, send_ch, recv_ch, cfg, timeout, own, check, out, pool, on_own=None):
    """`ring.allreduce` with `_DroppingRound`: (result, sent, digest, the round)."""
    vec = np.ascontiguousarray(vec, dtype=np.float32).ravel()
    ring._set_kernel_threads(cfg.kernel_threads)
    rr = _DroppingRound(vec, rank, world, send_ch, recv_ch, cfg, own, check, out, pool, on_own)
    return (*rr.run(timeout), rr)


def drop_stats(vec: np.ndarray, result: np.ndarray, rr: _DroppingRound) -> dict:
    """How much of the other members' contribution the committed mean lacks. The mean is
    (total - dropped) / W, so the others' sum is W * mean + dropped - ours (int8 error aside)."""
    w = rr.world
    others = w * result.astype(np.float64) + rr.dropped - vec
    n_others = float(np.linalg.norm(others))
    return {"dropped_contributions": rr.dropped_terms, "other_contributions": w * (w - 1),
            "dropped_norm_fraction": round(float(np.linalg.norm(rr.dropped)) / max(n_others, 1e-30), 4)}


class DroppingService(AllReduceService):
    """Ring rounds run `_DroppingRound`, then the honest signed vote gather on the digest of
    the (doctored) bytes every member decoded: the round commits. Robust rounds are honest.
    After each committed ring round it prints an `attacker_dropfwd` JSON line (the red-team
    bench reads the last one) and keeps the figures in `stats`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stats: list[dict] = []  # one per committed ring round
        self._last: dict | None = None
        self.quiet = False

    def _ring_and_votes(self, vec, rnd, mesh, cfg, timeout, extras, since=None, gating=None) -> Plane:
        world = len(rnd.ids)
        if world == 1:
            return super()._ring_and_votes(vec, rnd, mesh, cfg, timeout, extras, since, gating)
        send_ch, recv_ch = mesh.sends.get(0), mesh.recvs.get(0)
        result, sent, digest, rr = dropping_allreduce(vec, rnd.rank, world, send_ch, recv_ch, cfg, timeout,
                                                      *extras[:3], self._arenas, extras[3])
        self._last = drop_stats(np.ascontiguousarray(vec, np.float32).ravel(), result, rr)
        plane = Plane(result, sent, digest, t_data=trio.from_thread.run_sync(trio.current_time))
        publics = [public_from_peer_id_bytes(p) for p in rnd.ids]
        try:  # honest votes: the digest is of what every member decoded
            plane.sigs = ringvote.gather(send_ch, recv_ch, rnd.rank, world, rnd.tag, bytes.fromhex(digest),
                                         self.identity.sign, lambda i, sig, msg: verify(publics[i], sig, msg))
        except ring.RingError as exc:
            plane.gather_error = str(exc)
        return plane

    async def allreduce(self, vec, run_id, round_id, members, own=None, check=None, robust=None, out=None,
                        on_own=None):
        self._last = None
        res = await super().allreduce(vec, run_id, round_id, members, own=own, check=check, robust=robust, out=out,
                                      on_own=on_own)
        if self._last is not None:  # committed with our drops in it
            self.stats.append({"round": round_id, **self._last})
            if not self.quiet:
                fr = [s["dropped_norm_fraction"] for s in self.stats]
                sys.stdout.write(json.dumps({
                    "event": "attacker_dropfwd", "rounds_committed": len(fr), **self._last,
                    "dropped_norm_fraction_mean": round(float(np.mean(fr)), 4),
                    "dropped_norm_fractions": fr[-20:]}) + "\n")
                sys.stdout.flush()
        return res


class SelectiveService(AllReduceService):
    """Talks round control (roster confirmations, headers, abort and commit messages) with
    `answers` only: sends to nobody else, and resets every control stream anyone else opens
    to it, as a refused dial. Its DHT traffic and training are honest: it wants to be elected."""

    def __init__(self, *args, answers=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.answers = {peer_id_from_str(p) for p in answers} | {self.identity.peer_id}
        self.refused = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(super().run)
            self.host.set_stream_handler(VOTE_PROTOCOL, self._refusing(self._handle_vote))
            self.host.set_stream_handler(CONTROL_PROTOCOL, self._refusing(self.ctl.serve))
            task_status.started(port)

    def _refusing(self, handler):
        async def handle(stream) -> None:
            if stream.muxed_conn.peer_id.to_bytes() in self.answers:
                return await handler(stream)
            self.refused += 1
            with trio.move_on_after(1):
                await stream.reset()
        return handle

    async def _send_all(self, ids: list[bytes], msg: bytes) -> set[bytes]:
        return await super()._send_all([p for p in ids if p in self.answers], msg)


class InflatingService(AllReduceService):
    """Adds `pool` to the view of every roster confirmation it sends (hashed as an honest
    view would be: `p2ptrain.sim.service._inflated`, the simulator's same attack)."""

    def __init__(self, *args, pool=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pool = tuple(pool)

    async def exchange(self, run_id, round_id, members, payload, timeout, unreachable_silent=False,
                       answer_strangers=False, absent=None, cut=None, split=None):
        from p2ptrain.sim.service import _inflated

        if round_id.endswith("/roster"):
            payload = _inflated(payload, run_id, round_id, self.pool)
        return await super().exchange(run_id, round_id, members, payload, timeout, unreachable_silent,
                                      answer_strangers, absent, cut, split)


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
        if self.mode == "anti":
            return delta * np.float32(-ANTI_SCALE)
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
    if mode == "dropfwd":
        return Parts(service=DroppingService)
    if mode.startswith("selective:"):
        return Parts(service=functools.partial(SelectiveService, answers=mode.split(":", 1)[1].split(",")))
    if mode.startswith("inflate:"):
        return Parts(service=functools.partial(InflatingService, pool=mode.split(":", 1)[1].split(",")))
    if mode == "slowloris":
        return Parts(service=TricklingService)
    if mode == "trickle":
        return Parts(service=PausingService)
    if mode == "extra-honest":  # the red-team bench's control: the same process, nothing hostile
        return Parts()
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
