"""All-reduce rounds between libp2p peers: bulk session setup and commit-or-abort.

A round is (run id, round id, ordered member list). Each member:
  1. opens a bulk session to its ring successor over libp2p (`/p2ptrain/bulk/1.0.0`): the
     successor answers with a fresh secret, its raw bulk port and a one-time token; the
     sender dials that port (direct path) or, if it cannot, both keep using the libp2p
     stream for frames (fallback path, e.g. relayed peers);
  2. runs the data plane (`p2ptrain.ring.allreduce`) in a worker thread;
  3. votes: sends (ok, sha256 of its result) to every other member over
     `/p2ptrain/round/1.0.0`, and commits only when every member voted ok with the same
     digest. A failure anywhere becomes an abort vote, so the others stop at once instead
     of waiting for a timeout; a missing vote fails the round after `commit_timeout`.
The caller's tensor is never touched: `allreduce` returns a new array or raises RoundFailed.

Known limit (as in any commit protocol without a coordinator): a member that dies after
sending some but not all of its votes can leave the others split between commit and
abort. The window is the few milliseconds of one vote fan-out; the training layer detects
a split through the params hash each member publishes after a step and resyncs.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field

import numpy as np
import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from p2ptrain import butterfly
from p2ptrain.bulk import FrameChannel, RateLimitedIO, SocketIO, derive_key, new_secret, session_tag
from p2ptrain.control import ControlError, check_control_length, decode_control, pack as _pack
from p2ptrain.dht.libp2p_rpc import read_exactly
from p2ptrain.identity import peer_id_from_str
from p2ptrain.ring import RingConfig, RingError
from p2ptrain.streamio import StreamIO, dial as _dial
from p2ptrain.ring import allreduce as ring_allreduce

log = logging.getLogger("p2ptrain.allreduce")

BULK_PROTOCOL = TProtocol("/p2ptrain/bulk/1.0.0")
VOTE_PROTOCOL = TProtocol("/p2ptrain/round/1.0.0")
TOKEN_LEN = 16


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
    sub_chunk_bytes: int = 1 << 20
    """fp32 bytes per pipelined frame."""
    setup_timeout: float = 15.0
    """Seconds to set up both bulk sessions (members may start a little apart)."""
    frame_timeout: float = 20.0
    """Seconds without a frame before the data plane gives up."""
    commit_timeout: float = 10.0
    """Seconds to collect every member's vote after our own data plane finished."""
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


@dataclass
class _Pending:
    """A round this node takes part in, waiting for its predecessor's session and votes."""

    prev: bytes
    tag: bytes
    key: bytes = b""
    channel: FrameChannel | None = None
    ready: trio.Event = field(default_factory=trio.Event)
    votes: dict[bytes, dict] = field(default_factory=dict)  # sender -> {ok, digest, blame, reason}
    vote_event: trio.Event = field(default_factory=trio.Event)


async def _read_msg(stream) -> dict:
    n = check_control_length(await read_exactly(stream, 4))
    return decode_control(await read_exactly(stream, n))


class AllReduceService:
    """Serves bulk-session and vote requests for this node and runs rounds.

    Start with `await nursery.start(service.run)`; then `await service.allreduce(...)`."""

    def __init__(self, host, identity, config: AllReduceConfig | None = None, listen_ip: str = "127.0.0.1") -> None:
        self.host = host
        self.identity = identity
        self.config = config or AllReduceConfig()
        self.listen_ip = listen_ip
        self.port = 0
        self._rounds: dict[bytes, _Pending] = {}
        self._early_votes: dict[bytes, dict[bytes, dict]] = {}
        self._inbox: dict[bytes, dict[bytes, bytes]] = {}  # exchange tag -> sender -> payload
        self._inbox_event = trio.Event()
        self._tokens: dict[bytes, tuple[_Pending, trio.Event]] = {}

    # -- service ---------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # JIT-compile the kernels before announcing readiness: a first round that compiles
        # for seconds would make the other members time out waiting for our frames.
        await trio.to_thread.run_sync(_warm_kernels)
        listener = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await listener.bind((self.listen_ip, 0))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self.host.set_stream_handler(BULK_PROTOCOL, self._handle_bulk)
        self.host.set_stream_handler(VOTE_PROTOCOL, self._handle_vote)
        async with trio.open_nursery() as nursery:
            task_status.started(self.port)
            with listener:
                while True:
                    conn, _ = await listener.accept()
                    nursery.start_soon(self._handle_raw, conn)

    async def _handle_raw(self, conn) -> None:
        """A raw bulk connection: its first bytes are a token we handed out over libp2p."""
        try:
            with trio.fail_after(5):
                token = b""
                while len(token) < TOKEN_LEN:
                    chunk = await conn.recv(TOKEN_LEN - len(token))
                    if not chunk:
                        raise EOFError
                    token += chunk
        except (trio.TooSlowError, EOFError, OSError):
            log.warning("bulk connection dropped: reason=no-token")
            conn.close()
            return
        entry = self._tokens.pop(token, None)
        if entry is None:
            log.warning("bulk connection dropped: reason=unknown-token")
            conn.close()
            return
        pending, done = entry
        sock = socket.socket(fileno=conn.detach())
        sock.setblocking(True)
        pending.channel = FrameChannel(self._wrap(SocketIO(sock, self.config.frame_timeout)),
                                       pending.key, pending.tag, ID(pending.prev).to_base58())
        done.set()

    def _wrap(self, io):
        return RateLimitedIO(io, self.config.send_rate_mbps) if self.config.send_rate_mbps else io

    async def _handle_bulk(self, stream) -> None:
        """Our predecessor asks for a session for a round we are (or are about to be) in."""
        sender = stream.muxed_conn.peer_id.to_bytes()
        try:
            with trio.fail_after(self.config.setup_timeout):
                hello = await _read_msg(stream)
                tag = hello.get("tag")
                if not isinstance(tag, bytes):
                    raise ValueError("no session tag")
                while tag not in self._rounds:  # the sender may start first: wait for us
                    await trio.sleep(0.01)
                pending = self._rounds[tag]
                if pending.prev != sender:
                    raise PermissionError("not our ring predecessor for this round")
                secret, token = new_secret(), os.urandom(TOKEN_LEN)
                pending.key = derive_key(secret, sender, self.identity.peer_id, tag)
                raw_done = trio.Event()
                self._tokens[token] = (pending, raw_done)
                await stream.write(_pack({"secret": secret, "port": self.port if self.config.direct else 0,
                                          "token": token}))
                choice = await _read_msg(stream)
                if choice.get("path") == "direct":
                    await raw_done.wait()
                    await stream.close()
                else:
                    self._tokens.pop(token, None)
                    pending.channel = FrameChannel(StreamIO(stream, self.config.frame_timeout), pending.key,
                                                   tag, ID(sender).to_base58())
            pending.ready.set()
        except Exception as exc:
            log.warning("bulk session from %s refused: %s", ID(sender), exc)
            with trio.move_on_after(1):
                await stream.reset()

    async def _handle_vote(self, stream) -> None:
        sender = stream.muxed_conn.peer_id.to_bytes()
        try:
            with trio.fail_after(5):
                msg = await _read_msg(stream)
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
                        own: list | None = None, check=None, robust=None) -> RoundResult:
        """Average `vec` with `members` (ring order, including us). Raises RoundFailed.

        `own` and `check` are passed to the data plane (see `p2ptrain.ring.allreduce`).
        With `robust` (a `RobustConfig`), the butterfly data plane combines the members' copies
        with that rule instead (`p2ptrain.butterfly.allreduce`; `own`, `check` as it defines)."""
        me = self.identity.peer_id
        ids = [peer_id_from_str(m) for m in members]
        if me not in ids or len(set(ids)) != len(ids):
            raise RoundFailed("we are not a member, or a member is listed twice")
        world, rank = len(ids), ids.index(me)
        tag = session_tag(run_id, round_id)
        if tag in self._rounds:
            raise RoundFailed(f"round {round_id} already running")
        # A robust round's sessions live under per-sender tags (_open_mesh): none under this one.
        pending = _Pending(prev=ids[(rank - 1) % world] if robust is None else b"", tag=tag)
        pending.votes.update(self._early_votes.pop(tag, {}))
        self._rounds[tag] = pending
        t0 = trio.current_time()
        send_ch = None
        mesh = _Mesh()
        channels = mesh.channels  # every channel of this round, closed on abort and at the end
        path = "none"
        voted = False
        scores = None
        try:
            if world > 1:
                with trio.fail_after(self.config.setup_timeout):
                    if robust is None:
                        send_ch, path = await self._open_session(ids[(rank + 1) % world], tag)
                        channels.append(send_ch)
                        await pending.ready.wait()
                        channels.append(pending.channel)
                    else:
                        path = await self._open_mesh(mesh, ids, rank, run_id, round_id)
            t_setup = trio.current_time()
            cfg = RingConfig(self.config.mode, sub_chunk_bytes=self.config.sub_chunk_bytes)
            failure: RingError | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._abort_on_vote, pending, channels)
                try:
                    if robust is None:
                        result, sent, digest = await trio.to_thread.run_sync(
                            ring_allreduce, vec, rank, world, send_ch, pending.channel, cfg,
                            self.config.frame_timeout, own, check)
                    else:
                        result, sent, digest, scores = await trio.to_thread.run_sync(
                            butterfly.allreduce, vec, rank, world, mesh.sends, mesh.recvs, cfg, robust,
                            self.config.frame_timeout, own, check)
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
                aborted = [ID(p).to_base58() for p, v in pending.votes.items() if not v["ok"]]
                raise RoundFailed(f"{aborted[0]} aborted the round" if aborted else f"data plane: {failure}",
                                  self._blamed(pending))
            t_data = trio.current_time()
            await self._vote(ids, tag, True, digest)
            await self._collect(pending, ids, digest)
            t_end = trio.current_time()
            return RoundResult(result, digest, sent, t_end - t0, path,
                               {"setup": round(t_setup - t0, 4), "data": round(t_data - t_setup, 4),
                                "commit": round(t_end - t_data, 4)}, scores)
        except trio.TooSlowError:
            await self._vote(ids, tag, False, "")
            raise RoundFailed("bulk session setup timed out") from None
        except (ControlError, EOFError, OSError, BaseLibp2pError) as exc:
            # A successor that died or answered garbage during setup fails the round, never the node.
            await self._vote(ids, tag, False, "")
            raise RoundFailed(f"bulk session setup failed: {exc!r}"[:300]) from None
        except RoundFailed as exc:
            if not voted:
                await self._vote(ids, tag, False, "")
            exc.blamed.update(self._blamed(pending))
            raise
        finally:
            late = [self._rounds[t].channel for t in mesh.tags if t in self._rounds]  # set after a timeout
            for ch in [*channels, pending.channel, *late]:
                if ch is not None:
                    await trio.to_thread.run_sync(ch.close)
            self._rounds.pop(tag, None)
            for sub in mesh.tags:
                self._rounds.pop(sub, None)

    @staticmethod
    def _blamed(pending: _Pending) -> dict[str, str]:
        return {v["blame"]: v["reason"] for v in pending.votes.values() if not v["ok"] and v["blame"]}

    async def _abort_on_vote(self, pending: _Pending, channels: list) -> None:
        """An abort vote from anyone closes our channels, so our data plane fails now
        rather than after frame_timeout."""
        while not any(not v["ok"] for v in pending.votes.values()):
            pending.vote_event = trio.Event()
            await pending.vote_event.wait()
        for ch in list(channels):
            if ch is not None:
                await trio.to_thread.run_sync(ch.close)

    async def _open_mesh(self, mesh: "_Mesh", ids: list[bytes], rank: int, run_id: str, round_id: str) -> str:
        """Butterfly sessions: one to and one from every other member. Each direction is an
        ordinary ring session under its own tag (round, sender), so the session handlers
        above serve it unchanged and a frame for one pair opens nowhere else."""
        me = self.identity.peer_id
        inbound = {}
        for i, peer in enumerate(ids):
            if i != rank:
                sub = session_tag(run_id, f"{round_id}/from/{ID(peer).to_base58()}")
                inbound[i] = self._rounds[sub] = _Pending(prev=peer, tag=sub)
                mesh.tags.append(sub)
        paths = set()

        async def out(i: int) -> None:
            ch, p = await self._open_session(ids[i], session_tag(run_id, f"{round_id}/from/{ID(me).to_base58()}"))
            mesh.sends[i] = ch
            mesh.channels.append(ch)
            paths.add(p)

        async with trio.open_nursery() as nursery:
            for i in inbound:
                nursery.start_soon(out, i)
        for i, pend in inbound.items():
            await pend.ready.wait()
            mesh.recvs[i] = pend.channel
            mesh.channels.append(pend.channel)
        return paths.pop() if len(paths) == 1 else "mixed"

    async def _open_session(self, nxt: bytes, tag: bytes) -> tuple[FrameChannel, str]:
        stream = await self.host.new_stream(ID(nxt), [BULK_PROTOCOL])
        await stream.write(_pack({"tag": tag}))
        reply = await _read_msg(stream)
        secret, port, token = reply.get("secret"), reply.get("port"), reply.get("token")
        if not (isinstance(secret, bytes) and len(secret) == 32 and isinstance(token, bytes)
                and isinstance(port, int)):
            raise RoundFailed("malformed bulk session reply")
        key = derive_key(secret, self.identity.peer_id, nxt, tag)
        remote = stream.get_remote_address() if hasattr(stream, "get_remote_address") else None
        # Through a relay or a punched NAT the peer's bulk port is unreachable (a NAT router
        # drops the SYN: a 3 s timeout every round), so only plain direct links try it.
        from p2ptrain.nat import DIRECT, connection_kinds

        plain = connection_kinds(self.host).get(ID(nxt).to_base58(), DIRECT) == DIRECT
        if port and remote and self.config.direct and plain:
            try:
                sock = await trio.to_thread.run_sync(_dial, remote[0], port, token)
            except OSError as exc:
                log.info("direct bulk dial to %s:%d failed (%s): using the libp2p stream", remote[0], port, exc)
            else:
                await stream.write(_pack({"path": "direct"}))
                with trio.move_on_after(1):
                    await stream.close()
                io = self._wrap(SocketIO(sock, self.config.frame_timeout))
                return FrameChannel(io, key, tag, ID(nxt).to_base58()), "direct"
        await stream.write(_pack({"path": "libp2p"}))
        io = self._wrap(StreamIO(stream, self.config.frame_timeout))
        return FrameChannel(io, key, tag, ID(nxt).to_base58()), "libp2p"

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

    async def _collect(self, pending: _Pending, ids: list[bytes], digest: str) -> None:
        others = [p for p in ids if p != self.identity.peer_id]
        with trio.move_on_after(self.config.commit_timeout):
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
        raise RoundFailed(f"no vote from {', '.join(missing)} within {self.config.commit_timeout:.0f}s")


@dataclass
class _Mesh:
    """A butterfly round's channels by member index, and the session tags it registered."""

    sends: dict = field(default_factory=dict)
    recvs: dict = field(default_factory=dict)
    channels: list = field(default_factory=list)
    tags: list = field(default_factory=list)


def _warm_kernels() -> None:
    from p2ptrain import kernels as K

    x = np.linspace(-1, 1, 4096, dtype=np.float32)
    q, meta = K.quantize(x)
    q2, m2 = K.ring_hop(q, meta, x)
    K.owner_hop(q2, m2, x, 0.5)
    K.dequantize(q, meta)
