"""Reaching a round's members over libp2p: small control messages (votes, exchanges) and
telling a crashed peer from a live one.

Both answers feed liveness decisions elsewhere: `send_all`'s undelivered members count as
silent at once in a roster confirmation (`Inbox.collect`), and `unreachable` lets an
election stop waiting for an expected peer and a roster merge leave out a peer whose ready
record outlived it (issue 17: a peer killed mid-run). Neither judges a peer whose address we
never learned, and neither decides a round: a wrong "unreachable" only drops a member that
could not have taken part with us anyway.
"""

from __future__ import annotations

import logging

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2ptrain.identity import peer_id_from_str

log = logging.getLogger("p2ptrain.reduce.reach")
SEND_TIMEOUT = 5.0


async def send_all(host, me: bytes, ids: list[bytes], msg: bytes, protocol: TProtocol) -> set[bytes]:
    """Send `msg` to every member but us, each on a stream of its own; returns those we could
    not even open a stream to (certainly not delivered, unlike a failure after it opened)."""
    undelivered: set[bytes] = set()

    async def one(peer: bytes) -> None:
        opened = False
        try:
            with trio.fail_after(SEND_TIMEOUT):
                stream = await host.new_stream(ID(peer), [protocol])
                opened = True
                await stream.write(msg)
                await stream.close()
        except Exception as exc:  # any transport failure: the member did not get it
            log.info("vote to %s not delivered: %r", ID(peer), exc)
            if not opened:
                undelivered.add(peer)

    async with trio.open_nursery() as nursery:
        for peer in ids:
            if peer != me:
                nursery.start_soon(one, peer)
    return undelivered


async def unreachable(host, peers: set[str], timeout: float = 3.0) -> set[str]:
    """Those of `peers` we know addresses for, hold no connection to and cannot dial within
    `timeout`: certainly not there now (a crashed peer; its ready record outlives it)."""
    gone: set[str] = set()
    network, store = host.get_network(), host.get_peerstore()

    def addressed(pid: ID) -> bool:
        try:
            return bool(store.addrs(pid))
        except Exception:  # PeerStoreError: never learned (or expired)
            return False

    async def one(peer: str) -> None:
        pid = ID(peer_id_from_str(peer))
        if network.get_connections(pid) or not addressed(pid):
            return
        try:
            with trio.fail_after(timeout):
                await network.dial_peer(pid)
        except Exception as exc:  # refused, no route, negative cache, timeout: not there
            log.info("%s unreachable: %r", peer, exc)
            gone.add(peer)

    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(one, peer)
    return gone
