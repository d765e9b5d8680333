"""Bulk sessions for all-reduce rounds: who sends frames to whom, on what, under which key.

A round needs, per ring neighbour, one authenticated and encrypted frame pipe
(`bulk.FrameChannel`). This module makes them, three ways, cheapest first:
  1. an idle persistent link to that peer (`p2ptrain.reduce.links`): one OPEN frame, no round trip;
  2. a fresh session over libp2p (`/p2ptrain/bulk/1.0.0`): the receiver answers with a fresh
     secret, its raw bulk port and a one-time token; the sender dials that port and the new
     connection becomes a persistent link for later rounds;
  3. the same session keeping the libp2p stream for frames, when the port cannot be reached
     (relayed or hole-punched peers: a NAT drops the SYN).
The receiver does not choose: it waits for whichever its predecessor used, reading an OPEN
frame on its idle link from that peer while also accepting a fresh session.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2ptrain.reduce.bulk import FrameBudget, FrameChannel, RateLimitedIO, SocketIO, derive_key, new_secret
from p2ptrain.reduce.control import check_control_length, decode_control, pack
from p2ptrain.dht.libp2p_rpc import read_exactly
from p2ptrain.reduce.links import OPEN_LEN, Link, LinkError, LinkTable, check_open, seal_open
from p2ptrain.reduce.ring import RingError
from p2ptrain.reduce.streamio import StreamIO, dial

log = logging.getLogger("p2ptrain.reduce.sessions")

BULK_PROTOCOL = TProtocol("/p2ptrain/bulk/1.0.0")
TOKEN_LEN = 16


async def read_msg(stream, head: bytes = b"") -> dict:
    """One control message; `head`: its first bytes, already read (at most its 4-byte length)."""
    n = check_control_length(head + await read_exactly(stream, 4 - len(head)))
    return decode_control(await read_exactly(stream, n))


@dataclass
class Inbound:
    """Where a round expects frames from `prev` under session `tag`."""

    prev: bytes
    tag: bytes
    key: bytes = b""
    channel: FrameChannel | None = None
    link: Link | None = None
    ready: trio.Event = field(default_factory=trio.Event)


class BulkSessions:
    """Serves the bulk protocol and the raw listener, and keeps the persistent links.

    `config` is the caller's AllReduceConfig (read at each use: a bench swaps it between
    rounds). Start with `await nursery.start(sessions.run)`."""

    def __init__(self, host, identity, config, listen_ip: str = "127.0.0.1", max_links: int = 32) -> None:
        self.host = host
        self.identity = identity
        self.config = config
        self.listen_ip = listen_ip
        self.port = 0
        self.out_links = LinkTable(max_links)
        self.in_links = LinkTable(max_links)
        self._inbound: dict[bytes, Inbound] = {}
        self._tokens: dict[bytes, tuple[Inbound, trio.Event, bytes]] = {}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await listener.bind((self.listen_ip, 0))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self.host.set_stream_handler(BULK_PROTOCOL, self._handle_bulk)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(self.port)
                with listener:
                    while True:
                        conn, _ = await listener.accept()
                        nursery.start_soon(self._handle_raw, conn)
        finally:
            self.out_links.close_all()
            self.in_links.close_all()

    # -- the receiving side ------------------------------------------------------------
    def expect(self, prev: bytes, tag: bytes) -> Inbound:
        inb = self._inbound[tag] = Inbound(prev, tag)
        return inb

    def forget(self, tag: bytes) -> Inbound | None:
        return self._inbound.pop(tag, None)

    async def wait_in(self, inb: Inbound) -> None:
        """Until `inb` has its channel: an OPEN frame on our idle link from `inb.prev`, or a
        fresh session from it, whichever the sender chose. Bound it with the caller's timeout."""
        link = self.in_links.take(inb.prev)
        if link is None:
            await inb.ready.wait()
            return

        async def via_link() -> None:
            try:
                await trio.lowlevel.wait_readable(link.sock)
                frame = bytearray(OPEN_LEN)
                # Abandoned if a fresh session wins meanwhile: closing the link (below) ends
                # the read, where waiting for it could take frame_timeout on a partial frame.
                budget = self._budget().seconds(OPEN_LEN)  # a trickled OPEN ends here
                await trio.to_thread.run_sync(link.io.recv_into, memoryview(frame), budget, abandon_on_cancel=True)
                key = check_open(link, self.identity.peer_id, inb.tag, bytes(frame))
            except (LinkError, RingError, OSError) as exc:
                # Closed by the peer, or out of step (a round it abandoned): a fresh session
                # from the sender still opens this round.
                log.info("bulk link from %s dropped: %s", ID(inb.prev), exc)
                return
            if not inb.ready.is_set():
                link.io.set_timeout(self.config.frame_timeout)
                inb.key, inb.link = key, link
                inb.channel = self._channel(self._wrap(link.io), key, inb.tag, ID(inb.prev).to_base58())
                inb.ready.set()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(via_link)
                await inb.ready.wait()
                nursery.cancel_scope.cancel()
        finally:
            if inb.link is not link:
                self.close(link)

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
        inb, done, secret = entry
        sock = socket.socket(fileno=conn.detach())
        sock.setblocking(True)
        io = SocketIO(sock, self.config.frame_timeout)
        inb.link = Link(inb.prev, io, secret)
        inb.channel = self._channel(self._wrap(io), inb.key, inb.tag, ID(inb.prev).to_base58())
        done.set()

    async def _handle_bulk(self, stream) -> None:
        """Our predecessor asks for a fresh session for a round we are (or are about to be) in."""
        sender = stream.muxed_conn.peer_id.to_bytes()
        try:
            with trio.fail_after(self.config.setup_timeout):
                hello = await read_msg(stream)
                tag = hello.get("tag")
                if not isinstance(tag, bytes):
                    raise ValueError("no session tag")
                while tag not in self._inbound:  # the sender may start first: wait for us
                    await trio.sleep(0.01)
                inb = self._inbound[tag]
                if inb.prev != sender:
                    raise PermissionError("not our ring predecessor for this round")
                secret, token = new_secret(), os.urandom(TOKEN_LEN)
                inb.key = derive_key(secret, sender, self.identity.peer_id, tag)
                raw_done = trio.Event()
                self._tokens[token] = (inb, raw_done, secret)
                await stream.write(pack({"secret": secret, "port": self.port if self.config.direct else 0,
                                         "token": token}))
                choice = await read_msg(stream)
                if choice.get("path") == "direct":
                    await raw_done.wait()
                    await stream.close()
                else:
                    self._tokens.pop(token, None)
                    inb.channel = self._channel(StreamIO(stream, self.config.frame_timeout), inb.key,
                                                tag, ID(sender).to_base58())
            inb.ready.set()
        except Exception as exc:
            log.warning("bulk session from %s refused: %s", ID(sender), exc)
            with trio.move_on_after(1):
                await stream.reset()

    # -- the sending side --------------------------------------------------------------
    async def open_out(self, nxt: bytes, tag: bytes) -> tuple[FrameChannel, str, Link | None]:
        """(channel, path, link) for sending round `tag`'s frames to `nxt`."""
        me, name = self.identity.peer_id, ID(nxt).to_base58()
        link = self.out_links.take(nxt)
        if link is not None:
            if link.alive():
                frame, key = seal_open(link, me, tag)
                link.io.set_timeout(self.config.frame_timeout)
                try:
                    await trio.to_thread.run_sync(link.io.sendall, [frame])
                except RingError as exc:
                    log.info("bulk link to %s failed (%s): opening a new session", name, exc)
                else:
                    return self._channel(self._wrap(link.io), key, tag, name), "direct", link
            self.close(link)
        stream = await self.host.new_stream(ID(nxt), [BULK_PROTOCOL])
        await stream.write(pack({"tag": tag}))
        reply = await read_msg(stream)
        secret, port, token = reply.get("secret"), reply.get("port"), reply.get("token")
        if not (isinstance(secret, bytes) and len(secret) == 32 and isinstance(token, bytes)
                and type(port) is int and 0 <= port < 65536):
            raise RingError("malformed bulk session reply")
        key = derive_key(secret, me, nxt, tag)
        remote = stream.get_remote_address() if hasattr(stream, "get_remote_address") else None
        # Through a relay or a punched NAT the peer's bulk port is unreachable (a NAT router
        # drops the SYN: a 3 s timeout every round), so only plain direct links try it.
        from p2ptrain.net.nat import DIRECT, connection_kinds

        plain = connection_kinds(self.host).get(name, DIRECT) == DIRECT
        if port and remote and self.config.direct and plain:
            try:
                sock = await trio.to_thread.run_sync(dial, remote[0], port, token)
            except OSError as exc:
                log.info("direct bulk dial to %s:%d failed (%s): using the libp2p stream", remote[0], port, exc)
            else:
                await stream.write(pack({"path": "direct"}))
                with trio.move_on_after(1):
                    await stream.close()
                io = SocketIO(sock, self.config.frame_timeout)
                return self._channel(self._wrap(io), key, tag, name), "direct", Link(nxt, io, secret)
        await stream.write(pack({"path": "libp2p"}))
        io = self._wrap(StreamIO(stream, self.config.frame_timeout))
        return self._channel(io, key, tag, name), "libp2p", None

    # -- links -------------------------------------------------------------------------
    def keep(self, out_links: list, in_links: list) -> None:
        """After a committed round: its links are at a frame boundary, idle again."""
        for table, links in ((self.out_links, out_links), (self.in_links, in_links)):
            for link in links:
                link.rounds += 1
                table.put(link)

    @staticmethod
    def close(link: Link) -> None:
        trio.lowlevel.notify_closing(link.sock)
        link.close()

    def _budget(self) -> FrameBudget:
        return FrameBudget(self.config.frame_allowance, self.config.frame_min_rate_mbps * 1e6)

    def _channel(self, io, key: bytes, tag: bytes, peer: str) -> FrameChannel:
        return FrameChannel(io, key, tag, peer, budget=self._budget())

    def _wrap(self, io):
        return RateLimitedIO(io, self.config.send_rate_mbps) if self.config.send_rate_mbps else io
