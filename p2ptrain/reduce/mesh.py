"""A round's bulk channels: setting them up (ring or butterfly) and what they run on.

`open_ring` gives a ring member its channel to the successor and the one from the
predecessor; `open_butterfly` one to and one from every other member, each direction an
ordinary ring session under its own tag (round, sender), so the session handlers serve it
unchanged and a frame for one pair opens nowhere else. Both go through
`p2ptrain.reduce.sessions.BulkSessions` (an idle persistent link if there is one, else a
fresh session over libp2p).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio
from libp2p.peer.id import ID

from p2ptrain.reduce.bulk import session_tag
from p2ptrain.reduce.sessions import BulkSessions, Inbound


@dataclass
class Mesh:
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

    async def close(self, sessions: BulkSessions, committed: bool) -> None:
        """End of a round: a committed one hands its links to the next round (they stopped at
        a frame boundary on both ends); everything else closes, including inbound sessions
        that completed after a timeout."""
        late = [inb for inb in map(sessions.forget, self.tags) if inb is not None]
        channels = list(self.channels)
        late_channels = [inb.channel for inb in late if inb.channel not in channels]
        if committed:
            sessions.keep(self.out_links, self.in_links)
            kept = set(map(id, self.link_channels))
            channels = [ch for ch in channels if id(ch) not in kept]
        for ch in [*channels, *late_channels]:
            if ch is not None:
                await trio.to_thread.run_sync(ch.close, committed)


async def open_ring(sessions: BulkSessions, mesh: Mesh, ids: list[bytes], rank: int, tag: bytes) -> str:
    """Our channel to the successor and the one from the predecessor, set up together."""
    world = len(ids)
    inb = sessions.expect(ids[(rank - 1) % world], tag)
    mesh.tags.append(tag)
    paths = []

    async def out() -> None:
        ch, p, link = await sessions.open_out(ids[(rank + 1) % world], tag)
        mesh.add_send(0, ch, link)
        paths.append(p)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(out)
        await sessions.wait_in(inb)
        mesh.add_recv(0, inb)
    return paths[0]


async def open_butterfly(sessions: BulkSessions, mesh: Mesh, ids: list[bytes], rank: int, run_id: str,
                         round_id: str) -> str:
    """Sessions to and from every other member."""
    me = ids[rank]
    inbound: dict[int, Inbound] = {}
    for i, peer in enumerate(ids):
        if i != rank:
            sub = session_tag(run_id, f"{round_id}/from/{ID(peer).to_base58()}")
            inbound[i] = sessions.expect(peer, sub)
            mesh.tags.append(sub)
    paths = set()

    async def out(i: int) -> None:
        ch, p, link = await sessions.open_out(ids[i], session_tag(run_id, f"{round_id}/from/{ID(me).to_base58()}"))
        mesh.add_send(i, ch, link)
        paths.add(p)

    async def inn(i: int) -> None:
        await sessions.wait_in(inbound[i])
        mesh.add_recv(i, inbound[i])

    async with trio.open_nursery() as nursery:
        for i in inbound:
            nursery.start_soon(out, i)
            nursery.start_soon(inn, i)
    return paths.pop() if len(paths) == 1 else "mixed"
