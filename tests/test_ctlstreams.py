"""Persistent control streams (`p2ptrain.reduce.ctlstreams`): votes and exchanges ride one
libp2p stream per peer instead of a stream per message. Real libp2p nodes on 127.0.0.1 for
reuse, recovery, hostile input and the fallback; the in-memory host and trio's autojump
clock for the idle rule and a write cancelled part-way."""

from __future__ import annotations

import logging

import pytest
import trio
from libp2p.peer.id import ID

from conftest import service_cluster, trio_test
from fakehost import FakeNet, _InStream
from p2ptrain.identity import Identity
from p2ptrain.reduce.control import pack
from p2ptrain.reduce.ctlstreams import CONTROL_PROTOCOL, ControlStreams, ControlStreamsConfig
from p2ptrain.reduce.service import AllReduceService


async def _exchange(svcs, tag: str) -> list[dict]:
    ids = [s.identity.peer_id_str for s in svcs]
    got: list = [None] * len(svcs)

    async def one(i: int) -> None:
        got[i] = await svcs[i].exchange("run", tag, ids, b"from-%d" % i, 10.0)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for i in range(len(svcs)):
                nursery.start_soon(one, i)
    for g in got:
        assert [g[p] for p in ids] == [b"from-%d" % j for j in range(len(svcs))]
    return got


@trio_test(autojump=False)
async def test_exchanges_reuse_one_control_stream_per_peer():
    async with trio.open_nursery() as nursery:
        _, svcs = await service_cluster(nursery, [AllReduceService] * 4)
        for k in range(6):
            await _exchange(svcs, f"x{k}")
        # One outgoing stream per other member, opened by the first exchange, then reused.
        assert [s.ctl.opened for s in svcs] == [3, 3, 3, 3]
        nursery.cancel_scope.cancel()


@trio_test(autojump=False)
async def test_a_control_stream_reset_by_the_receiver_is_replaced_and_nothing_is_lost():
    async with trio.open_nursery() as nursery:
        _, svcs = await service_cluster(nursery, [AllReduceService] * 2)
        await _exchange(svcs, "before")
        sender = svcs[0].identity.peer_id
        await svcs[1].ctl._in[sender].reset()  # the receiver's end goes away (a restart, say)
        await trio.sleep(0.3)  # the reset reaches the sender's muxer
        await _exchange(svcs, "after")
        assert svcs[0].ctl.opened == 2 and svcs[1].ctl.opened == 1
        nursery.cancel_scope.cancel()


@trio_test(autojump=False)
async def test_a_stream_on_a_connection_the_swarm_dropped_is_replaced_before_a_write():
    """A write on a kept stream can vanish into a connection already gone; the swarm's
    list of live connections is checked first (here it is made to forget ours)."""
    async with trio.open_nursery() as nursery:
        _, svcs = await service_cluster(nursery, [AllReduceService] * 2)
        await _exchange(svcs, "before")
        peer = svcs[1].identity.peer_id
        stale = svcs[0].ctl._out[peer].stream
        network = svcs[0].host.get_network()
        listed = network.get_connections

        def without_ours(peer_id=None):
            return [c for c in listed(peer_id) if c.muxed_conn is not stale.muxed_conn]

        network.get_connections = without_ours
        assert await svcs[0].ctl.send(peer, pack({"tag": b"t" * 8, "kind": "data", "data": b"x"}))
        assert svcs[0].ctl.opened == 2 and svcs[0].ctl._out[peer].stream is not stale
        nursery.cancel_scope.cancel()


@trio_test(autojump=False)
async def test_hostile_control_streams_are_dropped_with_a_reason_and_the_node_goes_on(caplog):
    """An oversize length (refused before a byte of its body is read) and msgpack garbage:
    each ends its stream with a logged reason; the honest exchange after them is whole."""
    caplog.set_level(logging.WARNING, logger="p2ptrain.reduce.ctlstreams")
    async with trio.open_nursery() as nursery:
        nodes, svcs = await service_cluster(nursery, [AllReduceService] * 3)
        evil, victim = nodes[2].host, ID(svcs[0].identity.peer_id)
        for junk in ((1 << 20).to_bytes(4, "big") + b"x" * 64, (5).to_bytes(4, "big") + b"\xc1\xc1\xc1\xc1\xc1"):
            stream = await evil.new_stream(victim, [CONTROL_PROTOCOL])
            await stream.write(junk)
            with trio.fail_after(5):  # the victim resets it: our read ends
                try:
                    while await stream.read(1024):
                        pass
                except Exception:
                    pass
        reasons = [r.getMessage() for r in caplog.records if "control stream from" in r.getMessage()]
        assert any("oversize" in m for m in reasons) and any("malformed" in m for m in reasons), reasons
        await _exchange(svcs, "after-junk")
        nursery.cancel_scope.cancel()


class _Legacy(AllReduceService):
    """A peer that predates control streams: it serves only a stream per message."""

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(super().run)
            self.host.remove_stream_handler(CONTROL_PROTOCOL)
            task_status.started(self.port)


@trio_test(autojump=False)
async def test_a_peer_without_control_streams_still_gets_every_message():
    async with trio.open_nursery() as nursery:
        _, svcs = await service_cluster(nursery, [AllReduceService, _Legacy, AllReduceService])
        for k in range(3):
            await _exchange(svcs, f"x{k}")
        assert svcs[0].ctl.opened == 1 and svcs[2].ctl.opened == 1  # to each other only
        nursery.cancel_scope.cancel()


# -- the in-memory tier: the idle rule and a write cancelled part-way ------------------------
@trio_test()
async def test_an_idle_stream_is_replaced_before_the_receiver_would_stop_reading_it():
    async with trio.open_nursery() as nursery:
        net = FakeNet(nursery)
        a, b = Identity.generate(), Identity.generate()
        got = []

        async def handle(sender, msg):
            got.append(msg["n"])

        cfg = ControlStreamsConfig(idle_reopen=30.0, idle_close=60.0)
        sa, sb = ControlStreams(net.host(a.peer_id), handle, cfg), ControlStreams(net.host(b.peer_id), handle, cfg)
        sb.host.set_stream_handler(CONTROL_PROTOCOL, sb.serve)
        assert await sa.send(b.peer_id, pack({"n": 1})) and await sa.send(b.peer_id, pack({"n": 2}))
        assert sa.opened == 1
        await trio.sleep(31)
        assert await sa.send(b.peer_id, pack({"n": 3})) and sa.opened == 2
        await trio.sleep(1)
        assert sorted(got) == [1, 2, 3]  # the in-memory host does not keep their order
        with pytest.raises(ValueError, match="idle_reopen < idle_close"):
            ControlStreamsConfig(idle_reopen=60.0, idle_close=60.0)


@trio_test()
async def test_outgoing_streams_are_bounded_least_recently_used_first():
    async with trio.open_nursery() as nursery:
        net = FakeNet(nursery)

        async def handle(sender, msg):
            pass

        ids = [Identity.generate().peer_id for _ in range(5)]
        hosts = [net.host(p) for p in ids]
        for h in hosts[1:]:
            h.set_stream_handler(CONTROL_PROTOCOL, ControlStreams(h, handle).serve)
        ctl = ControlStreams(hosts[0], handle, ControlStreamsConfig(max_out=2))
        for k, peer in enumerate(ids[1:]):
            await trio.sleep(1)
            assert await ctl.send(peer, pack({"n": k}))
        assert set(ctl._out) == set(ids[3:]) and set(ctl._locks) == set(ids[3:])


@trio_test()
async def test_a_message_slow_to_handle_does_not_hold_up_the_next_one():
    """Answering a certificate request sends to its asker; a slow send must not delay that
    peer's next message (an abort vote, say), as it did not with a stream per message."""
    second_done = trio.Event()
    order = []

    async def handle(sender, msg):
        if msg["n"] == 1:
            with trio.fail_after(5):
                await second_done.wait()  # would never come if messages ran one after another
        else:
            second_done.set()
        order.append(msg["n"])

    ctl = ControlStreams(None, handle)
    await ctl.serve(_InStream(Identity.generate().peer_id, pack({"n": 1}) + pack({"n": 2})))
    assert order == [2, 1]


class _StuckStream:
    def __init__(self) -> None:
        self.was_reset = False

    async def write(self, data: bytes) -> None:
        await trio.sleep_forever()  # the peer stopped reading: its window is full

    async def reset(self) -> None:
        self.was_reset = True


class _StuckHost:
    def __init__(self) -> None:
        self.streams: list[_StuckStream] = []

    async def new_stream(self, peer, protos):
        self.streams.append(_StuckStream())
        return self.streams[-1]


@trio_test()
async def test_a_write_cancelled_part_way_resets_its_stream_and_the_next_send_opens_another():
    """A half-written message would corrupt the framing of every message after it."""
    host = _StuckHost()
    ctl = ControlStreams(host, None)
    peer = Identity.generate().peer_id
    with trio.move_on_after(5):
        await ctl.send(peer, pack({"n": 1}))
    assert host.streams[0].was_reset and peer not in ctl._out
    with trio.move_on_after(5):
        await ctl.send(peer, pack({"n": 2}))
    assert len(host.streams) == 2


class _Trickle(_InStream):
    """An inbound stream whose sender writes a byte a second."""

    async def read(self, n: int) -> bytes:
        await trio.sleep(1.0)
        return await super().read(min(n, 1))

    async def reset(self) -> None:
        self.was_reset = True


@trio_test()
async def test_a_trickled_message_ends_its_stream_after_message_timeout_unhandled(caplog):
    """Slowloris on control streams (issue 32): a message sent a byte a second never let the
    idle wait expire, as each partial read restarted it (this 70-byte message took 70 s, then
    was handled). Once a message's first byte is in, all of it must be within
    `message_timeout`: the stream is dropped with a logged reason and nothing is handled."""
    caplog.set_level(logging.WARNING, logger="p2ptrain.reduce.ctlstreams")
    async with trio.open_nursery() as nursery:
        net = FakeNet(nursery)
        a, b = Identity.generate(), Identity.generate()
        got = []

        async def handle(sender, msg):
            got.append(msg)

        sb = ControlStreams(net.host(b.peer_id), handle, ControlStreamsConfig(idle_close=600.0, message_timeout=5.0))
        stream = _Trickle(a.peer_id, pack({"kind": "vote", "pad": "x" * 50}))
        t0 = trio.current_time()
        with trio.fail_after(30):
            await sb.serve(stream)
        assert trio.current_time() - t0 <= 1.0 + 5.0 + 0.01  # the first byte's second, then the timeout
        assert got == [] and stream.was_reset
        assert any("slow message" in r.getMessage() for r in caplog.records), caplog.records
        with pytest.raises(ValueError, match="message_timeout"):
            ControlStreamsConfig(message_timeout=0)
