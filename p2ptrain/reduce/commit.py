"""Commit-or-abort for all-reduce rounds: signed votes, certificates, abort and blame.

Transport-free (trio only, no libp2p): `AllReduceService` feeds it the control messages
that arrive on `/p2ptrain/round/...` through `handle(sender, msg)` and gives it a `send`
coroutine; tests wire several boards together in one process.

A member that finished its data plane signs (tag, its rank, world, result digest)
(`ringvote.vote_message`). The W signatures over one digest are the round's certificate: a
member commits exactly when it holds one. Ring rounds gather the signatures on the ring
itself (`ringvote.gather`); butterfly rounds send them here (`collect`).

Why certificates: with only "I hold every vote", a member that withholds its last vote from
some members (or a well-timed abort) splits the round, those that had every vote committing
while the rest abort. A member that is missing votes therefore never aborts at once: it
asks every member for the certificate (`recover`). A member that committed answers with it
(and keeps it for late askers); one that aborted, or is itself recovering, answers "none";
one still running answers when it decides. The asker commits on a valid certificate and
aborts only when every other member said "none" or has been certainly gone (no connection,
no dial) for `gone_grace` seconds, or at the timeout. A member that finds the certificate
after it answered "none" passes it on to those it told. So no honest member aborts while
another commits unless the certificate takes longer than `gone_grace` to come from a member
that died right after it committed, or longer than `timeout` over a slow network.

Membership: a vote counts only from a member of the round it names. Before a round opens
here, votes are kept only from members of a roster this node announced (`expect`: the
roster of an exchange it ran), a few per sender. Blame in abort votes passes `blame.may_blame`.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from p2ptrain.events import clean
from p2ptrain.identity import peer_id_from_str, peer_id_to_str, public_from_peer_id_bytes, verify
from p2ptrain.reduce.blame import BlameLedger, may_blame
from p2ptrain.reduce.control import pack
from p2ptrain.reduce.ringvote import SIGNATURE, vote_message

log = logging.getLogger("p2ptrain.reduce.commit")

Send = Callable[[list[bytes], bytes], Awaitable[None]]
Gone = Callable[[set[bytes]], Awaitable[set[bytes]]]


@dataclass
class CommitConfig:
    rosters: int = 8
    """Announced rosters whose members may vote before their round opens here."""
    early_per_sender: int = 4
    """Votes kept per sender for rounds not opened yet (bounded grace)."""
    early_ttl: float = 60.0
    """Seconds such a vote is kept. Round ids repeat when a step is trained again after
    everyone skipped it (`TimeoutsSpec.early_ttl`): a vote of the first try, still waiting
    here, would abort the retry's round the moment it opens."""
    certs: int = 64
    """Certificates of closed rounds kept for members that ask late."""
    gone_grace: float = 2.0
    """Seconds a member must stay certainly gone before a recovering member counts it as
    holding no certificate (`recover`): what one it sent before it died needs to arrive."""
    gone_probe: float = 0.5
    """Seconds between checks of which silent members are gone, while recovering."""

    def __post_init__(self) -> None:
        if min(self.rosters, self.early_per_sender, self.certs) < 1:
            raise ValueError("rosters, early_per_sender and certs must be >= 1")
        if not self.early_ttl > 0:
            raise ValueError("early_ttl must be > 0")
        if not (self.gone_grace >= 0 and self.gone_probe > 0):
            raise ValueError("gone_grace must be >= 0 and gone_probe > 0")


@dataclass
class Round:
    tag: bytes
    ids: list[bytes]
    rank: int
    ring: bool
    votes: dict[bytes, dict] = field(default_factory=dict)  # member -> {ok, digest, sig, blame, reason}
    event: trio.Event = field(default_factory=trio.Event)
    cert: tuple[str, bytes] | None = None  # (digest, W signatures by rank)
    decided: str = ""  # "", "commit" or "abort"
    recovering: bool = False
    nocert: set = field(default_factory=set)
    askers: set = field(default_factory=set)
    told_none: set = field(default_factory=set)  # askers we answered "none" while recovering

    def wake(self) -> None:
        self.event.set()
        self.event = trio.Event()

    def others(self) -> list[bytes]:
        return [p for i, p in enumerate(self.ids) if i != self.rank]


def cert_valid(rnd: Round, digest: str, sigs: bytes) -> bool:
    w = len(rnd.ids)
    if len(sigs) != w * SIGNATURE or len(digest) != 64:
        return False
    d = bytes.fromhex(digest)
    return all(verify(public_from_peer_id_bytes(p), sigs[i * SIGNATURE:(i + 1) * SIGNATURE],
                      vote_message(rnd.tag, i, w, d)) for i, p in enumerate(rnd.ids))


class CommitBoard:
    def __init__(self, me: bytes, sign: Callable[[bytes], bytes], send: Send,
                 config: CommitConfig | None = None, ledger: BlameLedger | None = None) -> None:
        self.me, self.sign, self.send = me, sign, send
        self.config = config or CommitConfig()
        self.ledger = ledger or BlameLedger()
        self.rounds: dict[bytes, Round] = {}
        self._rosters: deque[frozenset] = deque(maxlen=self.config.rosters)
        self._early: dict[bytes, deque] = {}  # sender -> (tag, vote, when), oldest first
        self._certs: dict[bytes, tuple[str, bytes]] = {}

    # -- rounds ------------------------------------------------------------------------
    def expect(self, ids: list[bytes]) -> None:
        """A roster this node is about to reduce with: its members may vote early."""
        ros = frozenset(ids)
        if ros not in self._rosters:
            self._rosters.append(ros)

    def known(self, sender: bytes) -> bool:
        return any(sender in r for r in self._rosters)

    def open(self, tag: bytes, ids: list[bytes], ring: bool) -> Round:
        rnd = Round(tag, ids, ids.index(self.me), ring)
        stale = trio.current_time() - self.config.early_ttl
        for sender in ids:
            q = self._early.get(sender)
            for item in list(q or ()):
                if item[0] == tag:
                    q.remove(item)
                    if item[2] >= stale:
                        self._store(rnd, sender, item[1])
        self.rounds[tag] = rnd
        self.expect(ids)
        return rnd

    def close(self, rnd: Round) -> None:
        self.rounds.pop(rnd.tag, None)
        if rnd.decided == "commit" and rnd.cert is not None:
            self._certs[rnd.tag] = rnd.cert
            while len(self._certs) > self.config.certs:
                self._certs.pop(next(iter(self._certs)))

    # -- incoming ----------------------------------------------------------------------
    async def handle(self, sender: bytes, msg: dict) -> None:
        """One control message from `sender` (authenticated by the connection). Raises
        ValueError on a malformed one; drops (with a log line) what breaks the rules."""
        tag, kind = msg.get("tag"), msg.get("kind", "vote")
        if not isinstance(tag, bytes):
            raise ValueError("malformed message")
        rnd = self.rounds.get(tag)
        if kind == "vote":
            vote = _parse_vote(msg)
            if rnd is not None:
                self._store(rnd, sender, vote)
            elif self.known(sender):
                q = self._early.setdefault(sender, deque(maxlen=self.config.early_per_sender))
                q.append((tag, vote, trio.current_time()))
            else:
                log.info("vote from %s dropped: no round or roster of ours names it", peer_id_to_str(sender))
        elif kind == "certq":
            await self._answer(sender, tag, rnd)
        elif kind in ("cert", "none"):
            if rnd is None or sender not in rnd.ids:
                return
            if kind == "none":
                rnd.nocert.add(sender)
            elif rnd.cert is None and isinstance(msg.get("digest"), str) and isinstance(msg.get("sigs"), bytes) \
                    and cert_valid(rnd, msg["digest"], msg["sigs"]):
                rnd.cert = (msg["digest"], msg["sigs"])
            rnd.wake()
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def _store(self, rnd: Round, sender: bytes, vote: dict) -> None:
        if sender not in rnd.ids or sender == self.me:
            log.info("vote from %s dropped: not a member of the round", peer_id_to_str(sender))
            return
        if vote["ok"]:
            try:
                good = verify(public_from_peer_id_bytes(sender), vote["sig"],
                              vote_message(rnd.tag, rnd.ids.index(sender), len(rnd.ids), bytes.fromhex(vote["digest"])))
            except ValueError:
                good = False
            if not good:
                log.info("vote from %s dropped: bad signature", peer_id_to_str(sender))
                return
        rnd.votes.setdefault(sender, vote)  # the first vote stands: a member cannot take it back
        if not rnd.votes[sender]["ok"]:
            # A member that aborted answers "none" to every certificate query (`_answer`), and
            # one that aborts while our query waits on it drops it (`abort`): its abort vote is
            # that answer. Without this a survivor recovering when its neighbour's data plane
            # failed waited out the whole commit timeout (a SIGKILL mid-round, 11 s on 2 cores).
            rnd.nocert.add(sender)
        rnd.wake()

    async def _answer(self, sender: bytes, tag: bytes, rnd: Round | None) -> None:
        cert = self._certs.get(tag) or (rnd.cert if rnd is not None and rnd.decided == "commit" else None)
        if cert is not None:
            await self.send([sender], pack({"kind": "cert", "tag": tag, "digest": cert[0], "sigs": cert[1]}))
        elif rnd is None or rnd.decided == "abort" or rnd.recovering:
            if rnd is not None and rnd.recovering and not rnd.decided:
                rnd.told_none.add(sender)  # should we find the certificate after all: `recover`
            await self.send([sender], pack({"kind": "none", "tag": tag}))
        elif sender in rnd.ids:
            rnd.askers.add(sender)  # still running: answered when we decide

    # -- deciding ----------------------------------------------------------------------
    def sign_vote(self, rnd: Round, digest: str) -> bytes:
        return self.sign(vote_message(rnd.tag, rnd.rank, len(rnd.ids), bytes.fromhex(digest)))

    async def commit(self, rnd: Round, digest: str, sigs: list[bytes]) -> None:
        rnd.cert, rnd.decided = (digest, b"".join(sigs)), "commit"
        askers, rnd.askers = list(rnd.askers), set()
        if askers:
            await self.send(askers, pack({"kind": "cert", "tag": rnd.tag, "digest": digest, "sigs": rnd.cert[1]}))

    async def abort(self, rnd: Round, blame: str = "", reason: str = "") -> None:
        """Decide abort and tell every member (they stop at once instead of timing out)."""
        rnd.decided = "abort"
        rnd.askers = set()
        await self.send(rnd.others(), pack({"kind": "vote", "tag": rnd.tag, "ok": False, "digest": "",
                                            "blame": blame, "reason": reason}))

    async def collect(self, rnd: Round, digest: str, timeout: float) -> bool:
        """Butterfly rounds: send our signed vote, gather everyone's. True = committed; False
        = the caller aborts (`abort`); either way every honest member decides the same."""
        me = self.sign_vote(rnd, digest)
        await self.send(rnd.others(), pack({"kind": "vote", "tag": rnd.tag, "ok": True, "digest": digest,
                                            "sig": me, "blame": "", "reason": ""}))
        with trio.move_on_after(timeout):
            while True:
                votes = [rnd.votes.get(p) for p in rnd.others()]
                if any(v is not None and (not v["ok"] or v["digest"] != digest) for v in votes):
                    break
                if all(v is not None for v in votes):
                    sigs = [me if i == rnd.rank else rnd.votes[p]["sig"] for i, p in enumerate(rnd.ids)]
                    await self.commit(rnd, digest, sigs)
                    return True
                await rnd.event.wait()
        return await self.recover(rnd, digest, timeout)

    async def recover(self, rnd: Round, digest: str, timeout: float, gone: Gone | None = None) -> bool:
        """We signed `digest` but lack some votes: commit if any member holds the certificate.

        With `gone(members)` (those certainly gone: no connection, no dial), a member that
        has been gone for `gone_grace` seconds counts as having answered "none" (issue 17: every
        survivor of a member killed during the votes waited out `timeout`). A certificate it
        sent before it died arrives within that grace, and whoever gets one passes it on to
        every member it had told "none", so nobody aborts what another commits."""
        rnd.recovering = True
        askers, rnd.askers = list(rnd.askers), set()
        if askers:  # they wait on us; we hold no certificate
            rnd.told_none.update(askers)
            await self.send(askers, pack({"kind": "none", "tag": rnd.tag}))
        await self.send(rnd.others(), pack({"kind": "certq", "tag": rnd.tag}))
        since: dict[bytes, float] = {}  # member -> when we first found it gone
        settled: set[bytes] = set()
        probe_at = trio.current_time() + self.config.gone_probe
        with trio.move_on_after(timeout):
            while rnd.cert is None and not set(rnd.others()) <= rnd.nocert | settled:
                with trio.move_on_at(probe_at if gone is not None else math.inf):
                    await rnd.event.wait()
                # On the probe's clock, not at every answer that wakes us: each probe may dial.
                if gone is not None and rnd.cert is None and trio.current_time() >= probe_at:
                    silent = set(rnd.others()) - rnd.nocert
                    now_gone = set(await gone(silent)) & silent if silent else set()
                    now = trio.current_time()
                    probe_at = now + self.config.gone_probe
                    since = {p: since.get(p, now) for p in now_gone}  # one that came back starts over
                    settled = {p for p, t in since.items() if now - t >= self.config.gone_grace}
        if rnd.cert is not None and rnd.cert[0] == digest:
            rnd.decided = "commit"
            told, rnd.told_none = list(rnd.told_none), set()
            if told:
                await self.send(told, pack({"kind": "cert", "tag": rnd.tag, "digest": rnd.cert[0],
                                            "sigs": rnd.cert[1]}))
            return True
        return False

    # -- reading a round ---------------------------------------------------------------
    def aborted(self, rnd: Round) -> list[str]:
        return [peer_id_to_str(p) for p, v in rnd.votes.items() if not v["ok"]]

    async def wait_abort(self, rnd: Round) -> None:
        while not any(not v["ok"] for v in rnd.votes.values()):
            await rnd.event.wait()

    def blamed(self, rnd: Round) -> dict[str, str]:
        """Accusations in this round's abort votes that pass the rules (see `blame`)."""
        out = {}
        for p, v in rnd.votes.items():
            if v["ok"] or not v["blame"]:
                continue
            blamer = peer_id_to_str(p)
            try:
                target = peer_id_from_str(v["blame"])
            except ValueError:
                continue
            if not may_blame(rnd.ids, p, target, rnd.ring):
                log.info("blame of %s by %s ignored: it received nothing from it", v["blame"], blamer)
                continue
            if not v.get("noted"):
                self.ledger.note(blamer, v["blame"])
                v["noted"] = True
            if self.ledger.is_suspect(blamer):
                continue
            out[v["blame"]] = v["reason"]
        return out


def _parse_vote(msg: dict) -> dict:
    ok, digest = msg.get("ok"), msg.get("digest")
    blame, reason, sig = msg.get("blame") or "", msg.get("reason") or "", msg.get("sig") or b""
    if not isinstance(ok, bool) or not isinstance(digest, str) or not isinstance(blame, str) \
            or not isinstance(reason, str) or not isinstance(sig, bytes) \
            or (ok and (len(digest) != 64 or len(sig) != SIGNATURE)):
        raise ValueError("malformed vote")
    # The reason is the voter's own words: it reaches our events and logs, as one line.
    return {"ok": ok, "digest": digest, "sig": sig, "blame": blame[:100], "reason": clean(reason, 200)}
