"""All-reduce rounds between libp2p peers: the service that runs them.

A round is (run id, round id, ordered member list). Each member:
  1. gets its bulk channels (`p2ptrain.reduce.mesh`: ring neighbours, or every member for a
     butterfly round) through `p2ptrain.reduce.sessions` (an idle persistent link if there is
     one, else a fresh session over libp2p, raw TCP where reachable, the libp2p stream if not);
  2. runs the data plane (`p2ptrain.reduce.ring.allreduce` then the signed ring votes of
     `p2ptrain.reduce.ringvote`, or `p2ptrain.reduce.butterfly.allreduce`) in a worker thread;
  3. commits or aborts through `p2ptrain.reduce.commit` (signed votes, certificates, abort
     votes over `/p2ptrain/round/...`, blame rules). A failure anywhere becomes an abort
     vote, so the others stop at once instead of waiting for a timeout. A committed round
     hands its links back for the next one unless its votes failed (it recovered the
     certificate); any other ending closes them.
The caller's tensor is never touched: `allreduce` returns a new array or raises RoundFailed.
`exchange` (roster confirmation, contribution headers) uses the same protocol
(`p2ptrain.reduce.exchange` decides who may fill which inbox).

Trainer-facing additions: `RoundFailed.suspects` and `suspects()` (blamers nobody
corroborated), `expect_roster(members)` (members that may vote or send before we start).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from p2ptrain import kernels as K
from p2ptrain.identity import peer_id_from_str, peer_id_to_str, public_from_peer_id_bytes, verify
from p2ptrain.reduce import butterfly, reach, ringvote, roundtrace
from p2ptrain.reduce.blame import BlameLedger
from p2ptrain.reduce.bulk import session_tag
from p2ptrain.reduce.commit import CommitBoard, CommitConfig, Round
from p2ptrain.reduce.control import ControlError, pack as _pack
from p2ptrain.reduce.ctlstreams import CONTROL_PROTOCOL, ControlStreams
from p2ptrain.reduce.exchange import Inbox, InboxConfig
from p2ptrain.reduce.mesh import Mesh, open_butterfly, open_ring
from p2ptrain.reduce.outcome import Plane, RoundFailed, RoundResult, setup_failure
from p2ptrain.reduce.ring import ArenaPool, RingConfig, RingError
from p2ptrain.reduce.ring import allreduce as ring_allreduce
from p2ptrain.reduce.service_config import AllReduceConfig
from p2ptrain.reduce.sessions import BULK_PROTOCOL, BulkSessions, read_msg

log = logging.getLogger("p2ptrain.reduce.service")

# 1.1: ok votes are signed (commit certificates), certificate requests and answers.
VOTE_PROTOCOL = TProtocol("/p2ptrain/round/1.1.0")
__all__ = ["AllReduceConfig", "AllReduceService", "BULK_PROTOCOL", "RoundFailed", "RoundResult", "VOTE_PROTOCOL"]


class AllReduceService:
    """Serves bulk-session and vote requests for this node and runs rounds.

    Start with `await nursery.start(service.run)`; then `await service.allreduce(...)`."""

    def __init__(self, host, identity, config: AllReduceConfig | None = None, listen_ip: str = "127.0.0.1") -> None:
        self.host, self.identity = host, identity
        self.sessions = BulkSessions(host, identity, config or AllReduceConfig(), listen_ip)
        self._arenas = ArenaPool()
        ttl = (config or AllReduceConfig()).early_ttl
        self.board = CommitBoard(identity.peer_id, identity.sign, self._send_all, CommitConfig(early_ttl=ttl),
                                 ledger=BlameLedger())
        self.inbox = Inbox(self.board.known, InboxConfig(early_ttl=ttl))
        self.ctl = ControlStreams(host, self._dispatch)

    @property
    def config(self) -> AllReduceConfig:
        return self.sessions.config

    @config.setter
    def config(self, value: AllReduceConfig) -> None:
        self.sessions.config = value  # read at each round: a bench swaps it between rounds

    @property
    def port(self) -> int:
        return self.sessions.port

    def suspects(self) -> dict[str, int]:
        """Blamers with repeated uncorroborated accusations (peer id -> count); never us."""
        return {p: n for p, n in self.board.ledger.suspects().items() if p != self.identity.peer_id_str}

    def expect_roster(self, members: list[str]) -> None:
        """Members we are about to reduce or exchange with: their early votes and messages are
        kept (`exchange` does this itself for its roster)."""
        self.board.expect([peer_id_from_str(m) for m in members])

    # -- service ---------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await trio.to_thread.run_sync(K.warm)  # before we say we are ready (see there)
        self.host.set_stream_handler(VOTE_PROTOCOL, self._handle_vote)
        self.host.set_stream_handler(CONTROL_PROTOCOL, self.ctl.serve)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.sessions.run)
            task_status.started(self.port)

    async def _handle_vote(self, stream) -> None:
        """A control message on a stream of its own (peers fall back to this when their
        persistent control stream to us fails: `ControlStreams`)."""
        sender = stream.muxed_conn.peer_id.to_bytes()
        try:
            with trio.fail_after(5):
                msg = await read_msg(stream)
            await self._dispatch(sender, msg)
        except Exception as exc:
            log.warning("control message from %s dropped: %s", ID(sender), exc)
        finally:
            with trio.move_on_after(1):
                await stream.close()

    async def _dispatch(self, sender: bytes, msg: dict) -> None:
        if msg.get("kind") == "data":
            tag, data = msg.get("tag"), msg.get("data")
            if not isinstance(tag, bytes) or not isinstance(data, bytes):
                raise ValueError("malformed data message")
            reply = self.inbox.put(sender, tag, data)
            if reply is not None:  # a stranger to an exchange that answers them (`Inbox`)
                await self._send_all([sender], _pack({"tag": tag, "kind": "data", "data": reply}))
        else:
            await self.board.handle(sender, msg)

    # -- rounds ----------------------------------------------------------------------
    async def allreduce(self, vec: np.ndarray, run_id: str, round_id: str, members: list[str],
                        own: list | None = None, check=None, robust=None,
                        out: np.ndarray | None = None, on_own=None, gate=None) -> RoundResult:
        """Average `vec` with `members` (ring order, including us). Raises RoundFailed.

        `own`, `check`, `out` (a result buffer: reusing one saves page faults) and `on_own`
        go to the data plane (`p2ptrain.reduce.ring.allreduce`); `on_own(-1, None)` at the end.
        `gate(result)` (ring rounds, worker thread): a reason not to sign the result, or None
        (`p2ptrain.run.lossgate`); a refusal aborts the round before we vote.
        With `robust` (a `RobustConfig`), the butterfly data plane combines the members' copies
        with that rule instead (`p2ptrain.reduce.butterfly.allreduce`; `own`, `check` as it defines)."""
        ids = [peer_id_from_str(m) for m in members]
        if self.identity.peer_id not in ids or len(set(ids)) != len(ids):
            raise RoundFailed("we are not a member, or a member is listed twice")
        tag = session_tag(run_id, round_id)
        if tag in self.board.rounds:
            raise RoundFailed(f"round {round_id} already running")
        config = self.config  # one config for the whole round
        rnd = self.board.open(tag, ids, ring=robust is None)
        mesh = Mesh()
        t0 = trio.current_time()
        reusable = False  # a committed round's links go on to the next (`Mesh.close`)
        try:
            path = await self._setup(rnd, mesh, run_id, round_id, robust, config)
            t_setup = trio.current_time()
            roundtrace.mark("setup")
            plane = await self._data_plane(rnd, mesh, vec, (own, check, out, on_own, gate), robust, config)
            await self._decide(rnd, plane, robust is not None, config)
            reusable = not plane.gather_error  # not links a failed gather closed
            t_end = trio.current_time()
            roundtrace.mark("end")
            return RoundResult(plane.result, plane.digest, plane.sent, t_end - t0, path,
                               # clamped: t_data is perf_counter time, a test's fake clock is not
                               {"setup": round(t_setup - t0, 4), "data": round(max(0.0, plane.t_data - t_setup), 4),
                                "commit": round(max(0.0, t_end - plane.t_data), 4)}, plane.scores,
                               reused=mesh.reused())
        except trio.TooSlowError:
            await self.board.abort(rnd)
            raise RoundFailed("bulk session setup timed out", suspects=self.suspects()) from None
        except (ControlError, EOFError, OSError, BaseLibp2pError, RingError) as exc:
            # A successor that died or answered garbage during setup fails the round, never the node.
            await self.board.abort(rnd)
            raise RoundFailed(f"bulk session setup failed: {exc!r}"[:300], suspects=self.suspects()) from None
        except RoundFailed as exc:
            if not rnd.decided:
                await self.board.abort(rnd)
            exc.blamed.update(self.board.blamed(rnd))
            exc.suspects = self.suspects()
            raise
        finally:
            if on_own is not None:  # a round that failed before its data plane encoded nothing
                on_own(-1, None)
            await mesh.close(self.sessions, reusable)
            self.board.close(rnd)

    async def _setup(self, rnd: Round, mesh: Mesh, run_id: str, round_id: str, robust, config) -> str:
        if len(rnd.ids) == 1:
            return "none"
        path, gone = "none", []
        try:
            with trio.fail_after(config.setup_timeout):
                async with trio.open_nursery() as nursery:
                    # A member that failed before we are connected (its link was gone, say)
                    # ends our setup too, instead of leaving us waiting for setup_timeout;
                    # so does one found gone (killed after it confirmed the roster).
                    nursery.start_soon(self._cancel_on_abort, rnd, nursery.cancel_scope)
                    nursery.start_soon(self._cancel_on_gone, rnd, nursery.cancel_scope, gone, config.gone_probe)
                    if robust is None:
                        path = await open_ring(self.sessions, mesh, rnd.ids, rnd.rank, rnd.tag)
                    else:
                        path = await open_butterfly(self.sessions, mesh, rnd.ids, rnd.rank, run_id, round_id)
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The sessions are opened in nurseries, so a successor that refused or reset its
            # session arrives wrapped (trio's strict groups): `allreduce` then saw no
            # StreamEOF and the group ended the node (issue 17: a peer killed mid-run).
            raise setup_failure(group) from None
        aborted = self.board.aborted(rnd)
        if aborted:
            raise RoundFailed(f"{aborted[0]} aborted the round")
        if gone:  # `allreduce` votes abort: the others stop waiting too
            raise RoundFailed(f"member {peer_id_to_str(gone[0])} is gone", gone=tuple(map(peer_id_to_str, gone)))
        return path

    async def _data_plane(self, rnd: Round, mesh: Mesh, vec, extras: tuple, robust, config) -> Plane:
        """`extras`: the ring's (own, check, out, on_own); the butterfly takes own and check."""
        cfg = RingConfig(config.mode, sub_chunk_bytes=config.sub_chunk_bytes)
        world = len(rnd.ids)
        budget, overran, gating = config.data_budget(vec.nbytes, world), [], [0.0, None]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._abort_on_vote, rnd, mesh.channels)
            nursery.start_soon(self._close_after, budget, mesh.channels, overran, gating)
            try:
                if robust is None:
                    since = (trio.current_time(), time.perf_counter())
                    plane = await trio.to_thread.run_sync(self._ring_and_votes, vec, rnd, mesh, cfg,
                                                          config.frame_timeout, extras, since, gating)
                else:
                    result, sent, digest, scores = await trio.to_thread.run_sync(
                        butterfly.allreduce, vec, rnd.rank, world, mesh.sends, mesh.recvs, cfg, robust,
                        config.frame_timeout, *extras[:2])
                    plane = Plane(result, sent, digest, scores=scores, t_data=trio.current_time())
            except RingError as exc:
                if overran and exc.blame is None:
                    exc = RingError(f"the data plane overran its budget ({budget:.1f} s): {exc}")
                plane = Plane(error=exc, t_data=trio.current_time())
            nursery.cancel_scope.cancel()
        return plane

    async def _close_after(self, seconds: float, channels: list, overran: list, gating: list) -> None:
        """Past the round's data budget (`AllReduceConfig.data_budget`) our channels close, nobody
        blamed; our own gate's scoring (`gating`: [seconds, perf_counter of one under way]) is not counted."""
        start = trio.current_time()
        while True:
            await trio.sleep_until(start + seconds + gating[0])
            under_way = time.perf_counter() - gating[1] if gating[1] is not None else 0.0
            if trio.current_time() >= start + seconds + gating[0] + under_way:
                break
            await trio.sleep(under_way)
        overran.append(True)
        await _close(channels)

    def _ring_and_votes(self, vec, rnd: Round, mesh: Mesh, cfg, timeout, extras: tuple,
                        since: tuple[float, float], gating: list | None = None) -> Plane:
        """The data plane, then the signed votes on the same channels (worker thread).
        `since`: (trio's clock, perf_counter) when it was called: the data plane's end in
        trio's clock without a hop to the event loop, which held every member's vote back
        by 0.2-0.4 ms (measured with `bench allreduce --trace` while the hop was marked)."""
        world = len(rnd.ids)
        send_ch, recv_ch = mesh.sends.get(0), mesh.recvs.get(0)  # none for a round of one
        own, check, out, on_own, gate = extras
        result, sent, digest = ring_allreduce(vec, rnd.rank, world, send_ch, recv_ch, cfg, timeout, own, check,
                                              out, self._arenas, on_own)
        roundtrace.mark("data")
        plane = Plane(result, sent, digest, t_data=since[0] + time.perf_counter() - since[1])
        gating = gating or [0.0, None]
        gating[1] = time.perf_counter()  # our gate's scoring is outside the round's budget
        refusal = gate(result) if gate is not None else None
        gating[0], gating[1] = gating[0] + time.perf_counter() - gating[1], None
        if refusal:  # we sign nothing: no certificate can exist; our neighbours stop waiting now
            _shut(send_ch, recv_ch)
            return Plane(error=RingError(refusal), t_data=plane.t_data, refused=refusal)
        if world == 1:
            plane.sigs = [self.board.sign_vote(rnd, digest)]
            return plane
        publics = [public_from_peer_id_bytes(p) for p in rnd.ids]
        try:
            plane.sigs = ringvote.gather(send_ch, recv_ch, rnd.rank, world, rnd.tag, bytes.fromhex(digest),
                                         self.identity.sign, lambda i, sig, msg: verify(publics[i], sig, msg))
            roundtrace.mark("votes")
        except RingError as exc:  # we signed: the others may hold a certificate (commit.recover)
            plane.gather_error = str(exc)
            # Our successor waits for votes we cannot pass on: closing fails its gather now, so it
            # recovers and answers our query, not after frame_timeout (a SIGKILL mid-votes: +10 s).
            _shut(send_ch, recv_ch)
        return plane

    async def _decide(self, rnd: Round, plane: Plane, robust: bool, config) -> None:
        """Commit (returns) or raise RoundFailed; see `p2ptrain.reduce.commit`."""
        failure = plane.error
        if failure is not None:  # we signed nothing: no certificate can exist, abort at once
            if failure.blame:
                # Tell everyone who cheated before anything else: they retry without it.
                self.board.ledger.note(self.identity.peer_id_str, failure.blame)
                await self.board.abort(rnd, failure.blame, failure.reason)
                raise RoundFailed(f"bad data from {failure.blame}: {failure.reason}", {failure.blame: failure.reason})
            if plane.refused:  # say why before the others take our silence for a crash
                await self.board.abort(rnd, reason=plane.refused)
                raise RoundFailed(f"we refused the result: {plane.refused}", refused=plane.refused)
            await trio.sleep(0.2)  # an accuser's vote usually arrives right behind the failure
            aborted = self.board.aborted(rnd)
            raise RoundFailed(f"{aborted[0]} aborted the round" if aborted else f"data plane: {failure}")
        if robust:
            ok = await self.board.collect(rnd, plane.digest, config.commit_timeout)
        elif plane.sigs is not None:
            await self.board.commit(rnd, plane.digest, plane.sigs)
            ok = True
        else:
            ok = await self.board.recover(rnd, plane.digest, config.commit_timeout, gone=self._gone)
        if not ok:
            aborted = self.board.aborted(rnd)
            raise RoundFailed(f"{aborted[0]} aborted the round" if aborted
                              else f"no commit certificate ({plane.gather_error or 'votes missing'})")

    async def abort(self, run_id: str, round_id: str, reason: str) -> None:
        """Abort our round `round_id` now if it is undecided: the caller knows it cannot
        commit (a member's header is missing or bad: no frame passes its check). Our data
        plane stops at once, as on an abort vote, not after setup_timeout."""
        rnd = self.board.rounds.get(session_tag(run_id, round_id))
        if rnd is None or rnd.decided:
            return
        rnd.votes[self.identity.peer_id] = {"ok": False, "digest": "", "blame": "", "reason": reason}
        rnd.wake()
        await self.board.abort(rnd, reason=reason)

    async def _cancel_on_abort(self, rnd: Round, scope: trio.CancelScope) -> None:
        await self.board.wait_abort(rnd)
        scope.cancel()

    async def _cancel_on_gone(self, rnd: Round, scope: trio.CancelScope, found: list, probe: float) -> None:
        """Setup waits for members that may have died since they confirmed the roster: the
        first found certainly gone (no connection, no dial) goes into `found`, and setup ends."""
        while True:
            await trio.sleep(probe)
            found.extend(await self._gone(set(rnd.others())))
            if found:
                scope.cancel()
                return

    async def _abort_on_vote(self, rnd: Round, channels: list) -> None:
        """An abort vote from a member closes our channels, so our data plane fails now
        rather than after frame_timeout (after we signed, `_decide` still asks for a certificate)."""
        await self.board.wait_abort(rnd)
        await _close(channels)

    # -- exchanges and sending ---------------------------------------------------------
    async def exchange(self, run_id: str, round_id: str, members: list[str], payload: bytes,
                       timeout: float, unreachable_silent: bool = False,
                       answer_strangers: bool = False, absent=None, cut=None, split=None) -> dict[str, bytes | None]:
        """Send `payload` to every other member and collect theirs (None where it did not
        arrive within `timeout`). Used for roster confirmation and contribution headers.
        `answer_strangers`: a non-member that sends us its payload for this exchange gets ours,
        once (roster confirmation). `unreachable_silent`, `absent`, `cut`, `split`: `Inbox.collect`'s."""
        ids = [peer_id_from_str(m) for m in members]
        me = self.identity.peer_id
        self.board.expect(ids)  # the round that follows has these members
        tag = session_tag(run_id, round_id)
        msg = _pack({"tag": tag, "kind": "data", "data": payload})
        answer = (payload, lambda strangers: self._send_all(strangers, msg)) if answer_strangers else None
        skip = None if absent is None else (lambda waiting: _absent_ids(absent, waiting))
        got = await self.inbox.collect(tag, ids, me, timeout, lambda: self._send_all(ids, msg), unreachable_silent,
                                       gone=self._gone, answer=answer, absent=skip, cut=cut, split=split,
                                       resend=lambda again: self._send_all(again, msg))
        out = {ID(p).to_base58(): got.get(p) for p in ids if p != me}
        out[self.identity.peer_id_str] = payload
        return out

    async def unreachable(self, peers: set[str], timeout: float = 3.0, refused_only: bool = False) -> set[str]:
        """`p2ptrain.reduce.reach.unreachable` from this node."""
        return await reach.unreachable(self.host, peers, timeout, refused_only=refused_only)

    async def _gone(self, ids: set[bytes]) -> set[bytes]:
        gone = await reach.unreachable(self.host, {peer_id_to_str(p) for p in ids}, unknown_gone=True)
        return {p for p in ids if peer_id_to_str(p) in gone}

    async def _send_all(self, ids: list[bytes], msg: bytes) -> set[bytes]:
        return await reach.send_all(self.host, self.identity.peer_id, ids, msg, VOTE_PROTOCOL,
                                    self.ctl if self.config.control_streams else None)


async def _absent_ids(absent, waiting: set[bytes]) -> set[bytes]:  # E13's peer-id strings, as bytes
    out = await absent({peer_id_to_str(p) for p in waiting})
    return {p for p in waiting if peer_id_to_str(p) in out}


def _shut(*channels) -> None:
    for ch in channels:
        if ch is not None:
            ch.close()


async def _close(channels: list) -> None:
    await trio.to_thread.run_sync(_shut, *list(channels))
