"""Reaching a round's members over libp2p: small control messages (votes, exchanges) and
telling a crashed peer from a live one.

Both answers feed liveness decisions elsewhere. In a roster confirmation, members that
`send_all` could not open a stream to are probed at once and count as silent if gone
(`Inbox.collect`). `unreachable` lets an election stop waiting for an expected peer, and a
roster merge leave out a peer whose ready record outlived it (issue 17: a peer killed
mid-run). An election never judges a peer whose address we never learned; an exchange does
(it cannot reach that member at all). Neither decides a round: a wrong "unreachable" only
drops a member that could not have taken part with us anyway.
"""

from __future__ import annotations

import logging

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2ptrain.identity import peer_id_from_str

log = logging.getLogger("p2ptrain.reduce.reach")
SEND_TIMEOUT = 5.0


OPEN_RETRIES = (0.1, 0.3, 1.0)
"""Pauses before opening a stream again: "no valid connections" is often transient (a
connection being replaced), and a member that misses our message counts us as silent. Not
after a refused dial or a hit in the swarm's negative cache (`hopeless`)."""


async def send_all(host, me: bytes, ids: list[bytes], msg: bytes, protocol: TProtocol,
                   streams=None) -> set[bytes]:
    """Send `msg` to every member but us: on its persistent control stream when `streams`
    (a `ctlstreams.ControlStreams`) can, else on a stream of its own (opening it again a
    few times within SEND_TIMEOUT); returns those we could not even open a stream to
    (certainly not delivered, unlike a failure after it opened)."""
    undelivered: set[bytes] = set()

    async def one(peer: bytes) -> None:
        opened = False
        try:
            with trio.fail_after(SEND_TIMEOUT):
                if streams is not None and await streams.send(peer, msg):
                    return
                for pause in (*OPEN_RETRIES, None):
                    try:
                        stream = await host.new_stream(ID(peer), [protocol])
                        break
                    except Exception as exc:
                        if pause is None or hopeless(exc):
                            raise
                        await trio.sleep(pause)
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


def hopeless(exc: BaseException) -> bool:
    """Whether opening a stream again within `SEND_TIMEOUT` cannot succeed: the dial was
    refused (the process is gone), or the swarm refused to dial because all the peer's
    addresses failed within its negative cache's 60 s (py-libp2p 0.8.1, `Swarm.dial_peer`:
    every retry hits the cache). Retrying those cost every broadcast to a member killed
    mid-round 1.4-3.7 s (an abort vote, a certificate query), which held back the sender's
    abort of the round on 2 cores (`tests/test_allreduce_integration.py`'s SIGKILL test)."""
    return refused(exc) or "(negative cache)" in str(exc)


def refused(exc: BaseException) -> bool:
    """Whether a failed dial failed only because its addresses refused the connection: the
    peer's machine answered and nothing listens on its port any more, so its process is gone.
    A timeout, no route, a relay without the peer's reservation or a negative-cache hit says
    no such thing (a partition, a machine switched off, a NAT). Walks py-libp2p's wrappers
    (causes, contexts, exception groups, MultiError's list) down to the leaves."""
    leaves: list[BaseException] = []
    stack, seen = [exc], set()
    while stack and len(seen) < 256:  # bounded: a hostile cycle of contexts cannot spin us
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        subs = list(getattr(e, "exceptions", ()))
        if e.args and isinstance(e.args[0], (list, tuple)):
            subs += [x for x in e.args[0] if isinstance(x, BaseException)]
        nxt = [x for x in (e.__cause__, e.__context__) if x is not None] + subs
        if nxt:
            stack.extend(nxt)
        else:
            leaves.append(e)
    return bool(leaves) and all(isinstance(e, ConnectionRefusedError) for e in leaves)


async def unreachable(host, peers: set[str], timeout: float = 3.0, unknown_gone: bool = False,
                      refused_only: bool = False) -> set[str]:
    """Those of `peers` we know addresses for, hold no connection to and cannot dial within
    `timeout`: certainly not there now (a crashed peer; its ready record outlives it).
    `unknown_gone`: a peer we hold no connection to and know no address for counts too (an
    exchange member we cannot reach at all; an election only waits for such a peer).
    `refused_only`: only a peer whose dial was `refused` counts, so a live peer behind a
    partition never does (for decisions that may fork us from it: `Trainer` retries)."""
    gone: set[str] = set()
    network, store = host.get_network(), host.get_peerstore()

    def addressed(pid: ID) -> bool:
        try:
            return bool(store.addrs(pid))
        except Exception:  # PeerStoreError: never learned (or expired)
            return False

    async def one(peer: str) -> None:
        pid = ID(peer_id_from_str(peer))
        # py-libp2p 0.8.1 keeps closed connections in the swarm's map (docs/UPSTREAM.md, 8):
        # only an open one says the peer is there; otherwise the dial decides (and gives
        # new_stream a live connection again).
        if any(not getattr(c, "is_closed", False) for c in network.get_connections(pid)):
            return
        if not addressed(pid):
            if unknown_gone:
                gone.add(peer)
            return
        if refused_only and hasattr(network, "unblock_peer"):
            network.unblock_peer(pid)  # a negative-cache hit would answer for the dial
        try:
            with trio.fail_after(timeout):
                await network.dial_peer(pid)
        except Exception as exc:  # refused, no route, negative cache, timeout: not there
            if refused_only and not refused(exc):
                log.info("%s not reached, but not refused either: %r", peer, exc)
                return
            log.info("%s unreachable: %r", peer, exc)
            gone.add(peer)

    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(one, peer)
    return gone
