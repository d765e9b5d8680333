"""All-reduce rounds between libp2p peers: commit-or-abort around the data plane.

A round is (run id, round id, ordered member list). Each member:
  1. gets a bulk channel to its ring successor and one from its predecessor
     (`p2ptrain.reduce.sessions`: an idle persistent link if there is one, else a fresh session
     over libp2p, on a raw TCP connection where reachable and on the libp2p stream if not);
  2. runs the data plane (`p2ptrain.reduce.ring.allreduce`) and then the commit votes
     (`p2ptrain.reduce.ringvote`: every member's signed digest travels the ring on the same
     channels) in one worker thread;
  3. commits only when every member voted for the same digest. A failure anywhere becomes
     an abort vote sent to every member over `/p2ptrain/round/1.0.0`, so the others stop
     at once instead of waiting for a timeout; a missing vote fails the round after
     `frame_timeout`. A committed round hands its links back for the next one; any other
     ending closes them.
The caller's tensor is never touched: `allreduce` returns a new array or raises RoundFailed.
Robust rounds (`p2ptrain.reduce.butterfly`) keep one session per member pair and vote over libp2p.

Known limit (as in any commit protocol without a coordinator): a member that dies while the
votes travel can leave the others split between commit and abort (those that already held
every vote commit). The window is a few milliseconds of vote hops; the training layer
detects a split through the params hash each member publishes after a step and resyncs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from p2ptrain.reduce import butterfly
from p2ptrain.reduce import ringvote
from p2ptrain.reduce.bulk import session_tag
from p2ptrain.reduce.control import ControlError, pack as _pack
from p2ptrain.identity import peer_id_from_str, public_from_peer_id_bytes, verify
from p2ptrain.reduce.ring import ArenaPool, RingConfig, RingError
from p2ptrain.reduce.ring import allreduce as ring_allreduce
from p2ptrain.reduce.sessions import BULK_PROTOCOL, BulkSessions, Inbound, read_msg

log = logging.getLogger("p2ptrain.reduce.service")

VOTE_PROTOCOL = TProtocol("/p2ptrain/round/1.0.0")
__all__ = ["AllReduceConfig", "AllReduceService", "BULK_PROTOCOL", "RoundFailed", "RoundResult", "VOTE_PROTOCOL"]


class RoundFailed(Exception):
    """The round aborted on this member; no tensor was changed.

    `blamed`: members caught sending bad data (peer id -> reason), by us or by others."""

    def __init__(self, message: str, blamed: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.blamed = blamed or {}


@dataclass
class AllReduceConfig:
    mode: str = "int8"
    """'int8' or 'fp32' on the wire."""
    sub_chunk_bytes: int = 4 << 20
    """fp32 bytes per pipelined frame (4 MiB: a 1 MiB int8 frame, as in the raw-socket
    ceiling; 1 MiB frames measured ~10 % slower from per-frame overhead)."""
    setup_timeout: float = 15.0
    """Seconds to set up both bulk sessions (members may start a little apart)."""
    frame_timeout: float = 20.0
    """Seconds without a frame (or a vote) before the round gives up."""
    commit_timeout: float = 10.0
    """Robust rounds: seconds to collect every member's vote after our own data plane finished."""
    direct: bool = True
    """Try a raw TCP connection for bulk bytes; False forces the libp2p stream."""
    send_rate_mbps: float = 0.0
    """Cap on bulk send rate in MB/s (0 = none), e.g. to leave room on a home uplink."""

    def __post_init__(self) -> None:
        RingConfig(self.mode, sub_chunk_bytes=self.sub_chunk_bytes)
        for name in ("setup_timeout", "frame_timeout", "commit_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.send_rate_mbps < 0:
            raise ValueError("send_rate_mbps must be >= 0")


@dataclass
class RoundResult:
    result: np.ndarray
    digest: str
    sent_bytes: int
    seconds: float
    path: str
    """'direct' or 'libp2p' for our outgoing bulk session."""
    phases: dict = field(default_factory=dict)
    """Seconds spent in setup, data plane and commit votes (for benches)."""
    scores: list | None = None
    """Robust rounds: each owner's per-member scores (identical on every member)."""
    reused: bool = False
    """Both ring channels ran on persistent links (no libp2p session this round)."""


@dataclass
class _Pending:
    """A round this node takes part in: its abort/robust votes as they arrive."""

    tag: bytes
    votes: dict[bytes, dict] = field(default_factory=dict)  # sender -> {ok, digest, blame, reason}
    vote_event: trio.Event = field(default_factory=trio.Event)


class AllReduceService:
    """Serves bulk-session and vote requests for this node and runs rounds.

    Start with `await nursery.start(service.run)`; then `await service.allreduce(...)`."""

    def __init__(self, host, identity, config: AllReduceConfig | None = None, listen_ip: str = "127.0.0.1") -> None:
        self.host = host
        self.identity = identity
        self.sessions = BulkSessions(host, identity, config or AllReduceConfig(), listen_ip)
        self._arenas = ArenaPool()
        self._rounds: dict[bytes, _Pending] = {}
        self._early_votes: dict[bytes, dict[bytes, dict]] = {}
        self._inbox: dict[bytes, dict[bytes, bytes]] = {}  # exchange tag -> sender -> payload
        self._inbox_event = trio.Event()

    @property
    def config(self) -> AllReduceConfig:
        return self.sessions.config

    @config.setter
    def config(self, value: AllReduceConfig) -> None:
        self.sessions.config = value  # read at each round: a bench swaps it between rounds

    @property
    def port(self) -> int:
        return self.sessions.port

    # -- service ---------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # JIT-compile the kernels before announcing readiness: a first round that compiles
        # for seconds would make the other members time out waiting for our frames.
        await trio.to_thread.run_sync(_warm_kernels)
        self.host.set_stream_handler(VOTE_PROTOCOL, self._handle_vote)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.sessions.run)
            task_status.started(self.port)

    async def _handle_vote(self, stream) -> None:
        sender = stream.muxed_conn.peer_id.to_bytes()
        try:
            with trio.fail_after(5):
                msg = await read_msg(stream)
            tag = msg.get("tag")
            if not isinstance(tag, bytes):
                raise ValueError("malformed message")
            if msg.get("kind") == "data":
                data = msg.get("data")
                if not isinstance(data, bytes):
                    raise ValueError("malformed data message")
                box = self._inbox.setdefault(tag, {})
                if len(self._inbox) > 256:  # bounded: stale exchanges are forgotten
                    self._inbox.pop(next(iter(self._inbox)))
                box[sender] = data
                self._inbox_event.set()
                self._inbox_event = trio.Event()
                return
            ok, digest = msg.get("ok"), msg.get("digest")
            blame, reason = msg.get("blame") or "", msg.get("reason") or ""
            if not isinstance(ok, bool) or not isinstance(digest, str) or not isinstance(blame, str):
                raise ValueError("malformed vote")
            vote = {"ok": ok, "digest": digest, "blame": blame[:100], "reason": str(reason)[:200]}
            pending = self._rounds.get(tag)
            if pending is None:
                early = self._early_votes.setdefault(tag, {})
                if len(self._early_votes) > 256:  # bounded: stale rounds are forgotten
                    self._early_votes.pop(next(iter(self._early_votes)))
                early[sender] = vote
            else:
                pending.votes[sender] = vote
                pending.vote_event.set()
        except Exception as exc:
            log.warning("vote from %s dropped: %s", ID(sender), exc)
        finally:
            with trio.move_on_after(1):
                await stream.close()

    # -- rounds ----------------------------------------------------------------------
    async def allreduce(self, vec: np.ndarray, run_id: str, round_id: str, members: list[str],
                        own: list | None = None, check=None, robust=None,
                        out: np.ndarray | None = None) -> RoundResult:
        """Average `vec` with `members` (ring order, including us). Raises RoundFailed.

        `own`, `check` and `out` (a buffer for the result, reused across rounds saves page
        faults) are passed to the data plane (see `p2ptrain.reduce.ring.allreduce`).
        With `robust` (a `RobustConfig`), the butterfly data plane combines the members' copies
        with that rule instead (`p2ptrain.reduce.butterfly.allreduce`; `own`, `check` as it defines)."""
        me = self.identity.peer_id
        ids = [peer_id_from_str(m) for m in members]
        if me not in ids or len(set(ids)) != len(ids):
            raise RoundFailed("we are not a member, or a member is listed twice")
        world, rank = len(ids), ids.index(me)
        tag = session_tag(run_id, round_id)
        if tag in self._rounds:
            raise RoundFailed(f"round {round_id} already running")
        config = self.config  # one config for the whole round
        pending = _Pending(tag)
        pending.votes.update(self._early_votes.pop(tag, {}))
        self._rounds[tag] = pending
        t0 = trio.current_time()
        mesh = _Mesh()
        channels = mesh.channels  # every channel of this round, closed on abort and at the end
        path = "none"
        voted = committed = False
        scores = None
        try:
            if world > 1:
                with trio.fail_after(config.setup_timeout):
                    async with trio.open_nursery() as nursery:
                        # A member that failed before we are connected (its link was gone, say)
                        # ends our setup too, instead of leaving us waiting for setup_timeout.
                        nursery.start_soon(self._cancel_on_abort, pending, nursery.cancel_scope)
                        if robust is None:
                            path = await self._open_ring(mesh, ids, rank, tag)
                        else:
                            path = await self._open_mesh(mesh, ids, rank, run_id, round_id)
                        nursery.cancel_scope.cancel()
                aborted = self._aborted(pending)
                if aborted:
                    raise RoundFailed(f"{aborted[0]} aborted the round", self._blamed(pending))
            t_setup = trio.current_time()
            cfg = RingConfig(config.mode, sub_chunk_bytes=config.sub_chunk_bytes)
            failure: RingError | None = None
            t_data = t_setup
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._abort_on_vote, pending, channels)
                try:
                    if robust is None:
                        result, sent, digest, t_data = await trio.to_thread.run_sync(
                            self._ring_and_votes, vec, rank, world, mesh, cfg, config.frame_timeout, own,
                            check, out, ids, tag)
                    else:
                        result, sent, digest, scores = await trio.to_thread.run_sync(
                            butterfly.allreduce, vec, rank, world, mesh.sends, mesh.recvs, cfg, robust,
                            config.frame_timeout, own, check)
                        t_data = trio.current_time()
                except RingError as exc:
                    failure = exc
                nursery.cancel_scope.cancel()
            if failure is not None:
                if failure.blame:
                    # Tell everyone who cheated before anything else: they retry without it.
                    await self._vote(ids, tag, False, "", failure.blame, failure.reason)
                    voted = True
                    raise RoundFailed(f"bad data from {failure.blame}: {failure.reason}",
                                      {failure.blame: failure.reason} | self._blamed(pending))
                await trio.sleep(0.2)  # an accuser's vote usually arrives right behind the failure
                aborted = self._aborted(pending)
                raise RoundFailed(f"{aborted[0]} aborted the round" if aborted else f"data plane: {failure}",
                                  self._blamed(pending))
            if robust is None:
                # Every member's signed vote arrived on the ring; an abort that raced it still wins.
                aborted = self._aborted(pending)
                if aborted:
                    raise RoundFailed(f"{aborted[0]} aborted the round", self._blamed(pending))
            else:
                t_data = trio.current_time()
                await self._vote(ids, tag, True, digest)
                await self._collect(pending, ids, digest, config.commit_timeout)
            committed = True
            t_end = trio.current_time()
            return RoundResult(result, digest, sent, t_end - t0, path,
                               {"setup": round(t_setup - t0, 4), "data": round(t_data - t_setup, 4),
                                "commit": round(t_end - t_data, 4)}, scores,
                               reused=mesh.reused())
        except trio.TooSlowError:
            await self._vote(ids, tag, False, "")
            raise RoundFailed("bulk session setup timed out") from None
        except (ControlError, EOFError, OSError, BaseLibp2pError, RingError) as exc:
            # A successor that died or answered garbage during setup fails the round, never the node.
            await self._vote(ids, tag, False, "")
            raise RoundFailed(f"bulk session setup failed: {exc!r}"[:300]) from None
        except RoundFailed as exc:
            if not voted:
                await self._vote(ids, tag, False, "")
            exc.blamed.update(self._blamed(pending))
            raise
        finally:
            # Inbound sessions that completed after a timeout are closed too.
            late = [inb for inb in map(self.sessions.forget, mesh.tags) if inb is not None]
            late_channels = [inb.channel for inb in late if inb.channel not in channels]
            if committed:
                # At a frame boundary on both ends: the links serve the next round.
                self.sessions.keep(mesh.out_links, mesh.in_links)
                kept = set(map(id, mesh.link_channels))
                channels[:] = [ch for ch in channels if id(ch) not in kept]
            for ch in [*channels, *late_channels]:
                if ch is not None:
                    await trio.to_thread.run_sync(ch.close, committed)
            self._rounds.pop(tag, None)

    def _ring_and_votes(self, vec, rank, world, mesh: "_Mesh", cfg, timeout, own, check, out, ids, tag):
        """The data plane, then the signed votes on the same channels (worker thread)."""
        send_ch, recv_ch = mesh.sends.get(0), mesh.recvs.get(0)  # none for a round of one
        result, sent, digest = ring_allreduce(vec, rank, world, send_ch, recv_ch, cfg, timeout, own, check,
                                              out, self._arenas)
        t_data = trio.from_thread.run_sync(trio.current_time)
        if world == 1:
            return result, sent, digest, t_data
        publics = [public_from_peer_id_bytes(p) for p in ids]
        ringvote.gather(send_ch, recv_ch, rank, world, tag, bytes.fromhex(digest), self.identity.sign,
                        lambda i, sig, msg: verify(publics[i], sig, msg))
        return result, sent, digest, t_data

    async def _open_ring(self, mesh: "_Mesh", ids: list[bytes], rank: int, tag: bytes) -> str:
        """Our channel to the successor and the one from the predecessor, set up together."""
        world = len(ids)
        inb = self.sessions.expect(ids[(rank - 1) % world], tag)
        mesh.tags.append(tag)
        paths = []

        async def out() -> None:
            ch, p, link = await self.sessions.open_out(ids[(rank + 1) % world], tag)
            mesh.add_send(0, ch, link)
            paths.append(p)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(out)
            await self.sessions.wait_in(inb)
            mesh.add_recv(0, inb)
        return paths[0]

    @staticmethod
    def _blamed(pending: _Pending) -> dict[str, str]:
        return {v["blame"]: v["reason"] for v in pending.votes.values() if not v["ok"] and v["blame"]}

    @staticmethod
    def _aborted(pending: _Pending) -> list[str]:
        return [ID(p).to_base58() for p, v in pending.votes.items() if not v["ok"]]

    @staticmethod
    async def _wait_abort(pending: _Pending) -> None:
        while not any(not v["ok"] for v in pending.votes.values()):
            pending.vote_event = trio.Event()
            await pending.vote_event.wait()

    async def _cancel_on_abort(self, pending: _Pending, scope: trio.CancelScope) -> None:
        await self._wait_abort(pending)
        scope.cancel()

    async def _abort_on_vote(self, pending: _Pending, channels: list) -> None:
        """An abort vote from anyone closes our channels, so our data plane fails now
        rather than after frame_timeout."""
        await self._wait_abort(pending)
        for ch in list(channels):
            if ch is not None:
                await trio.to_thread.run_sync(ch.close)

    async def _open_mesh(self, mesh: "_Mesh", ids: list[bytes], rank: int, run_id: str, round_id: str) -> str:
        """Butterfly sessions: one to and one from every other member. Each direction is an
        ordinary ring session under its own tag (round, sender), so the session handlers
        serve it unchanged and a frame for one pair opens nowhere else."""
        me = self.identity.peer_id
        inbound: dict[int, Inbound] = {}
        for i, peer in enumerate(ids):
            if i != rank:
                sub = session_tag(run_id, f"{round_id}/from/{ID(peer).to_base58()}")
                inbound[i] = self.sessions.expect(peer, sub)
                mesh.tags.append(sub)
        paths = set()

        async def out(i: int) -> None:
            ch, p, link = await self.sessions.open_out(
                ids[i], session_tag(run_id, f"{round_id}/from/{ID(me).to_base58()}"))
            mesh.add_send(i, ch, link)
            paths.add(p)

        async def inn(i: int) -> None:
            await self.sessions.wait_in(inbound[i])
            mesh.add_recv(i, inbound[i])

        async with trio.open_nursery() as nursery:
            for i in inbound:
                nursery.start_soon(out, i)
                nursery.start_soon(inn, i)
        return paths.pop() if len(paths) == 1 else "mixed"

    async def _vote(self, ids: list[bytes], tag: bytes, ok: bool, digest: str, blame: str = "",
                    reason: str = "") -> None:
        await self._send_all(ids, _pack({"tag": tag, "ok": ok, "digest": digest, "blame": blame,
                                         "reason": reason}))

    async def exchange(self, run_id: str, round_id: str, members: list[str], payload: bytes,
                       timeout: float) -> dict[str, bytes | None]:
        """Send `payload` to every other member and collect theirs (None where it did not
        arrive within `timeout`). Used for roster confirmation and contribution headers."""
        ids = [peer_id_from_str(m) for m in members]
        tag = session_tag(run_id, round_id)
        box = self._inbox.setdefault(tag, {})
        await self._send_all(ids, _pack({"tag": tag, "kind": "data", "data": payload}))
        others = [p for p in ids if p != self.identity.peer_id]
        with trio.move_on_after(timeout):
            while not all(p in box for p in others):
                await self._inbox_event.wait()
        box = self._inbox.pop(tag, box)
        out = {ID(p).to_base58(): box.get(p) for p in others}
        out[self.identity.peer_id_str] = payload
        return out

    async def _send_all(self, ids: list[bytes], msg: bytes) -> None:

        async def one(peer: bytes) -> None:
            try:
                with trio.fail_after(5):
                    stream = await self.host.new_stream(ID(peer), [VOTE_PROTOCOL])
                    await stream.write(msg)
                    await stream.close()
            except Exception as exc:
                log.info("vote to %s not delivered: %r", ID(peer), exc)

        async with trio.open_nursery() as nursery:
            for peer in ids:
                if peer != self.identity.peer_id:
                    nursery.start_soon(one, peer)

    async def _collect(self, pending: _Pending, ids: list[bytes], digest: str, timeout: float) -> None:
        others = [p for p in ids if p != self.identity.peer_id]
        with trio.move_on_after(timeout):
            while True:
                for peer in others:
                    vote = pending.votes.get(peer)
                    if vote is not None and not vote["ok"]:
                        raise RoundFailed(f"{ID(peer)} aborted the round", self._blamed(pending))
                    if vote is not None and vote["digest"] != digest:
                        raise RoundFailed(f"{ID(peer)} got a different result")
                if all(p in pending.votes for p in others):
                    return
                pending.vote_event = trio.Event()
                await pending.vote_event.wait()
        missing = [ID(p).to_base58() for p in others if p not in pending.votes]
        raise RoundFailed(f"no vote from {', '.join(missing)} within {timeout:.0f}s")


@dataclass
class _Mesh:
    """A round's channels by member index, the links under them, and its session tags."""

    sends: dict = field(default_factory=dict)
    recvs: dict = field(default_factory=dict)
    channels: list = field(default_factory=list)
    tags: list = field(default_factory=list)
    out_links: list = field(default_factory=list)
    in_links: list = field(default_factory=list)
    link_channels: list = field(default_factory=list)

    def add_send(self, i: int, ch, link) -> None:
        self.sends[i] = ch
        self.channels.append(ch)
        if link is not None:
            self.out_links.append(link)
            self.link_channels.append(ch)

    def add_recv(self, i: int, inb: Inbound) -> None:
        self.recvs[i] = inb.channel
        self.channels.append(inb.channel)
        if inb.link is not None:
            self.in_links.append(inb.link)
            self.link_channels.append(inb.channel)

    def reused(self) -> bool:
        """A ring round that ran on links made by earlier rounds only (before keep() counts it)."""
        links = self.out_links + self.in_links
        return len(links) == 2 == len(self.channels) and all(link.rounds for link in links)


def _warm_kernels() -> None:
    from p2ptrain import kernels as K

    x = np.linspace(-1, 1, 4096, dtype=np.float32)
    q, meta = K.quantize(x)
    q2, m2 = K.ring_hop(q, meta, x)
    K.owner_hop(q2, m2, x, 0.5)
    K.dequantize(q, meta)
