"""Commit votes around the ring, on the round's own bulk channels.

After its data plane, each member signs (session tag, its rank, the result digest) and the
votes travel the ring as an all-gather of W-1 small frames: at hop s a member sends the
vote it received at hop s-1 (its own at s = 0) and receives the vote of member
(rank - 1 - s) mod W. Every vote is checked before it is forwarded: the digest must equal
ours and the Ed25519 signature must be the voter's, so a forwarder cannot forge a vote.
A member that holds all W valid votes commits.

Why not a libp2p stream per vote, as before: opening W-1 streams per member took 20-90 ms
per round here, more than the data plane's own gap to the raw-socket ceiling; these frames
ride connections that are already open and cost one thread wake-up per hop.

Aborts do not travel here. A member that fails sends abort votes over libp2p to everyone
(`AllReduceService`) and closes its channels, which fails its neighbours' gathers at once.
Synchronous, no trio: it runs in the round's worker thread right after the data plane.
"""

from __future__ import annotations

import struct
from typing import Callable

from p2ptrain.reduce import roundtrace
from p2ptrain.reduce.ring import Channel, FrameId, RingError

VOTE_CHUNK = 0xFFFFFFFF  # data frames use chunk * 1000 + sub, far below
DIGEST = 32
SIGNATURE = 64
VOTE_LEN = DIGEST + SIGNATURE


def vote_message(tag: bytes, rank: int, world: int, digest: bytes) -> bytes:
    """What member `rank` signs: bound to the session (round, members' order) and the result."""
    return b"p2ptrain-vote-v1" + tag + struct.pack(">HH", rank, world) + digest


def gather(send_ch: Channel, recv_ch: Channel, rank: int, world: int, tag: bytes, digest: bytes,
           sign: Callable[[bytes], bytes], verify: Callable[[int, bytes, bytes], bool]) -> list[bytes]:
    """Every member's signature (by rank) once all `world` voted for `digest`: the round's
    commit certificate (`p2ptrain.reduce.commit`). Raises RingError otherwise.

    `sign(message)` signs with our key; `verify(member, signature, message)` checks a member's."""
    if len(digest) != DIGEST:
        raise ValueError("digest must be 32 bytes")
    base = 2 * world - 2  # data frames use steps 0 .. 2W-3: vote frames never share a nonce
    sigs = [b""] * world
    sigs[rank] = sign(vote_message(tag, rank, world, digest))
    out = digest + sigs[rank]
    buf = bytearray(VOTE_LEN)
    for s in range(world - 1):
        fid = FrameId(base + s, VOTE_CHUNK)
        send_ch.send(fid, memoryview(out))
        roundtrace.mark(f"vote{s}_sent")
        got = recv_ch.recv(fid, memoryview(buf))
        roundtrace.mark(f"vote{s}_in")
        if got != VOTE_LEN:
            raise RingError(f"vote frame has {got} bytes")
        voter = (rank - 1 - s) % world
        if bytes(buf[:DIGEST]) != digest:
            raise RingError(f"member {voter} got a different result")
        if not verify(voter, bytes(buf[DIGEST:]), vote_message(tag, voter, world, digest)):
            raise RingError(f"the vote of member {voter} fails its signature")
        out = bytes(buf)
        sigs[voter] = out[DIGEST:]
    return sigs
