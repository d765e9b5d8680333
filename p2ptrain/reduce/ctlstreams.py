"""Control messages (votes, certificates, exchanges) on persistent libp2p streams.

A libp2p stream per message (yamux SYN, multistream-select both ways, the message, FIN,
window updates) cost ~2.3 ms of CPU per message in py-libp2p here: ~28 ms for the 12
messages of a 4-member exchange, spent on the trio thread while the data plane wants the
cores. Contribution headers, exchanged beside the data plane, arrived 25-65 ms into a round
(issue 17). On streams that stay open, the same exchange takes ~4.5 ms (`p2ptrain bench
exchange`). The DHT does the same for its RPCs (`p2ptrain.dht.libp2p_rpc`).

Sender: one outgoing stream per peer, opened on first use and written under a per-peer lock,
a message per write (`control.pack`: 4-byte length + msgpack). A write that fails or is
cancelled part-way resets the stream (a half-written message would corrupt the framing)
and `send` reports False, so the caller falls back to a stream of its own for that message
(`reach.send_all`), as does a peer that does not speak this protocol.

Receiver (`serve`): reads messages in order, the length checked before the body
(`sessions.read_msg`), and hands each to `handle(sender, msg)` in a task of its own, at most
`handlers` at once (a message it rejects is logged and dropped). It stops on EOF, a reset,
a message that does not decode (logged: the framing can no longer be trusted),
`idle_close` seconds without a message, or a message not whole `message_timeout` seconds
after its first byte (logged: a sender trickling it a byte at a time would otherwise hold
its reader for `idle_close` a byte, as a partial read restarted the wait). One inbound
stream per peer: a newer one replaces the older (its sender reopened, so the old one is
dead to it), so a peer holds at most one reader and `handlers` message tasks here.

A sender never writes to a stream idle for `idle_reopen` seconds or more, and that is less
than `idle_close`: a receiver that stopped reading for idleness would drop a message with
neither side noticing. Delivery is otherwise what it was with a stream per message: a
message written just before its connection dies is lost, and callers bound their waits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2ptrain.dht.libp2p_rpc import reset_quietly
from p2ptrain.reduce.control import ControlError
from p2ptrain.reduce.sessions import read_msg

log = logging.getLogger("p2ptrain.reduce.ctlstreams")

CONTROL_PROTOCOL = TProtocol("/p2ptrain/ctl/1.0.0")
Handle = Callable[[bytes, dict], Awaitable[None]]


@dataclass
class ControlStreamsConfig:
    idle_reopen: float = 120.0
    """Seconds after its last message an outgoing stream is replaced instead of written."""
    idle_close: float = 600.0
    """Seconds without a message after which an inbound stream stops being read."""
    max_out: int = 256
    """Outgoing streams kept at most; past it the least recently used one is closed (a long
    run meets many peers, most of them gone)."""
    handlers: int = 8
    """Messages of one inbound stream handled at once (as with a stream per message, one
    slow to handle does not hold up the next); past it the reader waits."""
    message_timeout: float = 5.0
    """Seconds a message may take once its first byte is in (at most 4 KiB: whole in one
    round trip from an honest sender), however it trickles."""

    def __post_init__(self) -> None:
        if not 0 < self.idle_reopen < self.idle_close:
            raise ValueError("need 0 < idle_reopen < idle_close: a sender must reopen before a receiver stops reading")
        if not self.message_timeout > 0:
            raise ValueError("message_timeout must be > 0")
        if self.max_out < 1 or self.handlers < 1:
            raise ValueError("max_out and handlers must be >= 1")


@dataclass
class _Out:
    stream: object
    last: float


class ControlStreams:
    def __init__(self, host, handle: Handle, config: ControlStreamsConfig | None = None) -> None:
        self.host = host
        self.handle = handle
        self.config = config or ControlStreamsConfig()
        self._out: dict[bytes, _Out] = {}
        self._locks: dict[bytes, trio.Lock] = {}
        self._in: dict[bytes, object] = {}
        self.opened = 0
        """Outgoing streams opened so far (tests and benches count reuse with it)."""

    # -- sending ---------------------------------------------------------------------
    async def send(self, peer: bytes, msg: bytes) -> bool:
        """Write `msg` (one packed control message) to `peer` on its persistent stream,
        opening one if needed. False when that failed: the caller sends it another way."""
        lock = self._locks.setdefault(peer, trio.Lock())
        async with lock:
            now = trio.current_time()
            out = self._out.get(peer)
            if out is not None and (now - out.last >= self.config.idle_reopen or not self._listed(peer, out.stream)):
                await self._drop(peer)
                out = None
            if out is not None and await self._write(peer, out, msg):
                return True
            try:
                stream = await self.host.new_stream(ID(peer), [CONTROL_PROTOCOL])
            except Exception as exc:  # no connection, or a peer without this protocol
                log.debug("control stream to %s not opened: %r", ID(peer), exc)
                return False
            self.opened += 1
            out = self._out[peer] = _Out(stream, now)
            ok = await self._write(peer, out, msg)
        await self._evict()
        return ok

    async def _evict(self) -> None:
        """Close the least recently used streams past `max_out` (none that is being written)."""
        idle = sorted((o.last, p) for p, o in self._out.items() if not self._locks[p].locked())
        for _, peer in idle[:max(0, len(self._out) - self.config.max_out)]:
            await self._drop(peer)
        for peer in [p for p, lock in self._locks.items() if p not in self._out and not lock.locked()]:
            del self._locks[peer]  # peers we failed to reach, or evicted

    def _listed(self, peer: bytes, stream) -> bool:
        """Whether the swarm still lists the connection `stream` rides. A stream per message
        proved its connection alive with its negotiation round trip; a write on a kept
        stream can succeed into a connection already gone (its peer restarted, say), so a
        stream on a connection the swarm dropped is replaced before we write."""
        try:
            conns = self.host.get_network().get_connections(ID(peer))
        except Exception:  # a host that cannot tell (the in-memory one): keep the stream
            return True
        return any(getattr(c, "muxed_conn", None) is stream.muxed_conn for c in conns)

    async def _write(self, peer: bytes, out: _Out, msg: bytes) -> bool:
        done = False
        try:
            await out.stream.write(msg)
            done = True
            out.last = trio.current_time()
            return True
        except Exception as exc:  # the stream died: reopen once, else the caller falls back
            log.debug("control stream to %s failed: %r", ID(peer), exc)
            return False
        finally:
            if not done:  # failed or cancelled mid-write: its framing is unknown
                if self._out.get(peer) is out:
                    del self._out[peer]
                with trio.CancelScope(shield=True):
                    await reset_quietly(out.stream)

    async def _drop(self, peer: bytes) -> None:
        out = self._out.pop(peer, None)
        if out is not None:
            with trio.move_on_after(1):
                try:
                    await out.stream.close()
                except Exception:
                    await reset_quietly(out.stream)

    async def close(self) -> None:
        for peer in list(self._out):
            await self._drop(peer)

    # -- receiving -------------------------------------------------------------------
    async def serve(self, stream) -> None:
        """The stream handler of CONTROL_PROTOCOL (one task per inbound stream)."""
        sender = stream.muxed_conn.peer_id.to_bytes()
        old = self._in.get(sender)
        self._in[sender] = stream
        if old is not None:
            await reset_quietly(old)
        try:
            async with trio.open_nursery() as nursery:
                slots = trio.Semaphore(self.config.handlers)
                while True:
                    with trio.move_on_after(self.config.idle_close) as idle:
                        try:
                            head = await stream.read(4)  # waiting for a message to begin is idleness
                        except Exception:  # EOF or a reset: the sender is done with it
                            return
                    if idle.cancelled_caught or not head:
                        return
                    try:
                        with trio.fail_after(self.config.message_timeout):
                            msg = await read_msg(stream, head)
                    except ControlError as exc:
                        log.warning("control stream from %s dropped: %s", ID(sender), exc)
                        return
                    except trio.TooSlowError:
                        log.warning("control stream from %s dropped: slow message (not whole %.1fs after "
                                    "its first byte)", ID(sender), self.config.message_timeout)
                        return
                    except Exception:  # EOF or a reset: the sender is done with it
                        return
                    await slots.acquire()  # a flood waits here, not in ever more tasks
                    nursery.start_soon(self._handle_one, sender, msg, slots)
        finally:
            if self._in.get(sender) is stream:
                del self._in[sender]
            await reset_quietly(stream)

    async def _handle_one(self, sender: bytes, msg: dict, slots: trio.Semaphore) -> None:
        """One message, beside the next ones: answering a certificate request sends to its
        asker, and a slow send must not hold up that peer's later messages (an abort vote)."""
        try:
            await self.handle(sender, msg)
        except Exception as exc:  # one bad message; the framing still holds
            log.warning("control message from %s dropped: %s", ID(sender), exc)
        finally:
            slots.release()

