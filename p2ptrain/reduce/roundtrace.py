"""Where a round's time goes, member by member: a timeline of one all-reduce round (off
unless `P2PTRAIN_ROUND_TRACE=1`; `p2ptrain bench allreduce --trace` turns it on).

Issue 17 left ~10 ms of a 0.24 s verified round at 1 Gbit/s unexplained (the unverified
round, same link, is ~0.23 s), and every earlier look at it was an ad-hoc patch that did
not survive its session. This is the same look, kept: the data plane marks what it does with
CLOCK_MONOTONIC stamps (one clock for every process on the machine, as the bench's start
barrier), and the bench turns each member's marks into milestones (`milestones`).

Marks: "setup" (channels open), "send" (a frame handed to the kernel: `t0` when its sealing
began, `t` when sendmsg returned; `step`), "recv" (a frame fully received; `step`), "check"
(the first frame let through by the check: held until the headers are in on the verified
path), "data" (the data plane is done), "vote<s>_sent" and "vote<s>_in" (hop s
of the vote gather), "votes" (all commit votes in), "end" (committed), "signed" and
"headers" (verified path: our header signed, everyone's verified). One round at a time per
process: `take` returns the marks since the last `take`.
"""

from __future__ import annotations

import os
import threading
import time

ON = os.environ.get("P2PTRAIN_ROUND_TRACE") == "1"
MAX_MARKS = 4096
"""A round makes ~2 marks per frame; beyond this a trace keeps its first marks only."""

_lock = threading.Lock()
_marks: list[tuple[str, float, dict]] = []


def now() -> float:
    return time.monotonic()


def mark(name: str, t: float | None = None, **kw) -> None:
    if not ON:
        return
    with _lock:
        if len(_marks) < MAX_MARKS:
            _marks.append((name, now() if t is None else t, kw))


def take(origin: float) -> list[list]:
    """The marks since the last take, as [name, ms after `origin`, extras], oldest first."""
    with _lock:
        out = [[n, round((t - origin) * 1000, 3),
                {k: round((v - origin) * 1000, 3) if k == "t0" else v for k, v in kw.items()}]
               for n, t, kw in _marks]
        _marks.clear()
    return out


def milestones(marks: list[list]) -> dict[str, float]:
    """One member's round in ms after the start: when its first frame began sealing and
    reached the kernel, when each step's last frame arrived ("step<s>"), the longest gap
    between two frames arriving ("recv_gap" and after which step it came), and the named
    marks (setup, check, signed, headers, data, votes, end) where present."""
    out: dict[str, float] = {}
    sends = [m for m in marks if m[0] == "send"]
    if sends:
        out["first_seal"] = sends[0][2].get("t0", sends[0][1])
        out["first_send"] = sends[0][1]
        out["last_send"] = sends[-1][1]
    recvs = [m for m in marks if m[0] == "recv"]
    for name, t, kw in recvs:
        out[f"step{kw.get('step')}"] = t
    gaps = [(b[1] - a[1], a[2].get("step")) for a, b in zip(recvs, recvs[1:])]
    if gaps:
        gap, after = max(gaps)
        out["recv_gap"], out["recv_gap_after_step"] = round(gap, 3), after
    for name, t, _ in marks:
        if name not in ("send", "recv") and name not in out:
            out[name] = t
    return out
