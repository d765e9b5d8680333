"""The invariants the simulator checks after every event (pure logic: no I/O, no trio).

Fed the trainers' own events (`run_joined`, `group_formed`, `outer_step_started`,
`outer_step_committed`, `outer_step_skipped`, `caught_up`) and every decided round's
contributions, with a view of the world (who is honest, alive, joined, reachable). Steps
are the step a round trains (a commit event's `step` is the state it produced: t + 1).

  1. commit-or-abort: no two honest members of one committed roster commit different
     states for its step, no two honest peers that elected the same group commit different
     states for it (rule Q1: never two disjoint parts of one group), and no honest member
     of a committed roster that stays up skips the step its roster committed. (Peers that
     elected *different* groups, e.g. on two sides of a partition, may both commit: that is
     a fork the merge rounds must heal, which invariant 3 checks);
  2. no lone lineage: no honest peer commits alone twice in a row while another live honest
     peer it can reach is in the run and not following it (a follower holds a state of its
     lineage and trains nothing at that step: it adopts what the peer commits). A peer that
     crashed is back in the run at its restart's `run_joined`, not while it boots: until
     then it has announced nothing (rule H2 cannot see it) and it adopts the head as it
     joins (H1);
  3. convergence: at the end (faults over), live honest peers hold states within K steps of
     each other and, while they are no more than one group (N <= G), agree on every step
     from K below the newest that two of them hold, except steps before they first held one
     state after the faults ended (`agree_from`: forks committed across a partition are M1's
     to heal, and it must have healed them within K steps of the faults' end, else that is
     a violation too); in a run of several groups (N > G)
     every two of them hold states that share an ancestor no more than K steps old (the
     merge rounds mix every lineage into every other: gossip averaging, docs/PROTOCOL.md
     M1; a fork that never merges again fails this);
  4. liveness: honest peers commit at least `min_commit_fraction` of the steps they
     started training, retries counted once (checked only in scenarios without faults;
     a world with faults reports the fraction committed once they ended as a figure,
     `sim.world.Report.after_faults`, summed by `bench sim`);
  5. bounded influence: in a committed round with 3 or more trained contributions, none is
     longer than 10x their median (the bound docs/DESIGN.md states for headers).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

NAMES = ("commit_or_abort", "no_lone_lineage", "convergence", "liveness", "bounded_influence")
INFLUENCE_BOUND = 10.0


@dataclass
class WorldView:
    honest: set[str]
    alive: Callable[[str], bool]
    reachable: Callable[[str, str], bool]
    """Both ways, now."""


@dataclass(frozen=True)
class Violation:
    invariant: str
    time: float
    detail: str


@dataclass
class Monitor:
    world: WorldView
    converge_within: int = 3
    min_commit_fraction: float = 0.95
    group_size: int | None = None
    """The run's G: above it, convergence is lineage mixing instead of one state."""
    violations: list[Violation] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.joined: set[str] = set()
        self.booting: set[str] = set()  # crashed, and its restart has not joined yet
        self.groups: dict[tuple[str, int], tuple[str, ...]] = {}
        self.commits: dict[int, dict[str, tuple[str, tuple[str, ...]]]] = {}  # t -> peer -> (hash, roster)
        self.skips: dict[int, set[str]] = {}
        self.skipped_from: dict[tuple[str, int], list] = {}  # (peer, t) -> (group it had elected, its start, when) a skip
        self.committed_from: dict[tuple[str, int], tuple] = {}  # (peer, t) -> (group it had elected, when)
        self.formed_at: dict[tuple[str, int], float] = {}
        self.booted: dict[str, float] = {}  # peer -> when its current incarnation joined
        self.history: dict[str, dict[int, str]] = {}  # peer -> state step -> params hash
        self.parents: dict[str, tuple[str, ...]] = {}  # state -> the bases its round started from
        self.step_of: dict[str, int] = {}
        self.latest: dict[str, int] = {}
        self.lone: dict[str, int] = {}
        self.trained: dict[tuple[str, int], float] = {}  # (peer, step) -> when it started training it
        self.retried: dict[tuple[str, int], float] = {}  # (peer, step) -> when it last started it (a retry)
        self.committed: set[tuple[str, int]] = set()
        self.rounds = 0
        self._seen: set[tuple] = set()
        # honest peers' verdicts against honest peers (issue 32's `honest_wrongly_excluded`):
        # not an invariant (a strike is a suspicion), a figure every world reports
        self.struck = 0  # strikes
        self.excluded: list[tuple[float, str, str, str]] = []  # (when, by, whom, why)

    def _flag(self, inv: str, now: float, detail: str, key: tuple | None = None) -> None:
        if key is not None:
            if key in self._seen:
                return
            self._seen.add(key)
        self.violations.append(Violation(inv, round(now, 3), detail))

    def on_event(self, now: float, peer: str, event: str, f: dict) -> None:
        honest = peer in self.world.honest
        if event == "peer_down":
            self.booting.add(peer)
        elif event == "run_joined":
            self.joined.add(peer)
            self.booting.discard(peer)
            self.booted[peer] = now
            self.latest[peer] = int(f.get("step", 0))
        elif event == "group_formed":
            self.groups[(peer, int(f["step"]))] = tuple(f["members"])
            self.formed_at[(peer, int(f["step"]))] = now
        elif event == "outer_step_started" and honest and not f.get("joining"):
            self.trained.setdefault((peer, int(f["step"])), now)
            self.retried[(peer, int(f["step"]))] = now
        elif event == "outer_step_skipped":
            self.skips.setdefault(int(f["step"]), set()).add(peer)
            self.skipped_from.setdefault((peer, int(f["step"])), []).append(
                (self.groups.get((peer, int(f["step"]))), self.booted.get(peer, 0.0), now))
        elif event in ("caught_up", "checkpoint_fetched"):  # a state adopted (at start: fetched)
            self.history.setdefault(peer, {})[int(f["step"])] = f["params_sha256"]
            self.step_of.setdefault(f["params_sha256"], int(f["step"]))
            self.latest[peer] = int(f["step"])
        elif event in ("member_struck", "contribution_rejected", "peer_excluded") and honest \
                and f.get("remote") in self.world.honest:
            if event == "member_struck":
                self.struck += 1
            else:
                self.excluded.append((now, peer, f["remote"], str(f.get("reason", ""))))
        elif event == "outer_step_committed":
            self._commit(now, peer, int(f["step"]) - 1, f["params_sha256"], tuple(f.get("members") or ()),
                         f.get("loss") is not None)
            self.step_of.setdefault(f["params_sha256"], int(f["step"]))
            if f.get("parents"):
                self.parents.setdefault(f["params_sha256"], tuple(f["parents"]))

    def _commit(self, now: float, peer: str, t: int, h: str, roster: tuple[str, ...], trained: bool) -> None:
        self.history.setdefault(peer, {})[t + 1] = h
        self.latest[peer] = t + 1
        if peer not in self.world.honest:
            return
        if trained:
            self.committed.add((peer, t))
        mine = self.commits.setdefault(t, {})
        mine[peer] = (h, roster)
        group = self.groups.get((peer, t))
        self.committed_from[(peer, t)] = (group, self.formed_at.get((peer, t), now))
        for q, (hq, rq) in mine.items():
            if q == peer or hq == h:
                continue
            if q in roster or peer in rq:
                self._flag("commit_or_abort", now, f"step {t}: {_s(peer)} and {_s(q)} were in one committed "
                           f"roster and committed different states", ("coa", t, *sorted((peer, q))))
            elif group is not None and self.groups.get((q, t)) == group:
                self._flag("commit_or_abort", now, f"step {t}: {_s(peer)} and {_s(q)} elected the same group "
                           f"and committed different states", ("coa", t, *sorted((peer, q))))
        # lone lineage: alone while a live honest peer we can reach is in the run, and not
        # following us (one that holds a state of our lineage and trains nothing this step
        # adopts what we commit: it is on our lineage, rule H2's followers)
        if roster == (peer,):
            self.lone[peer] = self.lone.get(peer, 0) + 1
            ours = set(self.history.get(peer, {}).values())
            others = [q for q in self.joined if q != peer and q in self.world.honest and self.world.alive(q)
                      and q not in self.booting and self.world.reachable(peer, q)
                      and not (self.history.get(q, {}).get(self.latest.get(q, -1)) in ours
                               and (q, t) not in self.trained)]
            if self.lone[peer] >= 2 and others:
                self._flag("no_lone_lineage", now, f"step {t}: {_s(peer)} committed alone "
                           f"{self.lone[peer]} steps in a row while {len(others)} reachable honest peer(s) "
                           f"were in the run", ("lone", peer))
        else:
            self.lone[peer] = 0

    def on_round(self, now: float, members: tuple[str, ...], vecs: dict[str, np.ndarray], committed: bool) -> None:
        if not committed:
            return
        self.rounds += 1
        norms = {m: float(np.linalg.norm(v.astype(np.float64))) for m, v in vecs.items()}
        trained = [n for n in norms.values() if n > 0]
        if len(trained) >= 3:
            med = statistics.median(trained)
            for m, n in norms.items():
                if n > INFLUENCE_BOUND * med * (1 + 1e-6):
                    self._flag("bounded_influence", now, f"{_s(m)} contributed {n / med:.1f}x the median norm")

    def finish(self, now: float, faults: bool, horizon: float = 0.0, settled: bool = True,
               agree_from: int = 0, late: int = 0) -> None:
        """End-of-run checks: partial commits, convergence, liveness (over the steps started
        at least `horizon` seconds before the end: later ones had no time to commit).
        `settled`: K steps' worth of time passed since the last fault ended (else convergence
        is not checked: the invariant promises it within K steps, `self.unsettled`).
        `agree_from`: the step at which the live honest peers first held one state after the
        faults ended (0 without faults: every step is judged); `late`: how many steps after
        the faults' end that took (over K is a violation)."""
        self.horizon = now - horizon
        self.unsettled = not settled
        for t, got in self.commits.items():
            for peer, (_, roster) in got.items():
                group, formed = self.committed_from.get((peer, t), (None, 0.0))
                for q in (self.skips.get(t, set()) & set(roster)) - {peer}:
                    # a skip of an earlier try (another elected group) is not a skip of this
                    # roster: q may be retrying the step with it as the world ends (seed 20330);
                    # nor is one by a later incarnation of q (it crashed after contributing, and
                    # its restart retried the step from disk: seed 40875), nor one that ended
                    # before the committing try's group formed (an earlier try that dealt the
                    # same group: a member of the roster was in its data plane after that;
                    # seed 33338)
                    skipped = [g for g, booted, at in self.skipped_from.get((q, t), [])
                               if booted <= formed <= at]
                    if group is not None and None not in skipped and group not in skipped:
                        continue
                    if q in self.world.honest and self.world.alive(q) and q not in got:
                        self._flag("commit_or_abort", now, f"step {t}: {_s(q)} skipped the step its roster "
                                   f"committed", ("partial", t, q))
        live = sorted(p for p in self.joined if p in self.world.honest and self.world.alive(p) and p in self.latest)
        if len(live) >= 2 and settled:
            top = max(self.latest[p] for p in live)
            behind = [p for p in live if self.latest[p] < top - self.converge_within]
            if behind:
                self._flag("convergence", now, f"{len(behind)} live honest peer(s) more than "
                           f"{self.converge_within} steps behind step {top}")
            if late > self.converge_within:
                self._flag("convergence", now, f"live honest peers first held one state {late} steps after the "
                           f"faults ended (> {self.converge_within})")
            if self.exact(live):
                for s in range(max(0, top - self.converge_within, agree_from), top + 1):
                    held = {self.history.get(p, {}).get(s) for p in live} - {None}
                    if len(held) > 1:
                        self._flag("convergence", now, f"step {s}: live honest peers hold {len(held)} different states")
                        break
            elif not self.mixed(live):
                self._flag("convergence", now, f"{len(live)} live honest peers (more than a group of "
                           f"{self.group_size}) hold lineages that have not met in {self.converge_within} steps")
        if not faults and self.trained and self.commit_fraction() < self.min_commit_fraction:
            self._flag("liveness", now, f"honest peers committed {self.commit_fraction():.2f} of the steps they "
                       f"trained (< {self.min_commit_fraction})")

    def exact(self, live: list[str]) -> bool:
        """Must `live` hold one state (the run's live peers, adversaries too, fit one group),
        or only mixed lineages?"""
        run = [p for p in self.joined if self.world.alive(p)]
        return self.group_size is None or len(run) <= self.group_size

    def ancestors(self, h: str, floor: int) -> set[str]:
        """`h` and the states it descends from at step `floor` or later."""
        seen, todo = {h}, [h]
        while todo:
            for p in self.parents.get(todo.pop(), ()):
                if p not in seen and self.step_of.get(p, -1) >= floor:
                    seen.add(p)
                    todo.append(p)
        return seen

    def mixed(self, live: list[str]) -> bool:
        """Every two of `live` hold states with a common ancestor at most K steps older than
        the newer of the two. (K below the run's newest step instead held two peers of step
        13 to step 11 the moment one group elsewhere committed step 14: simulator seed 82003
        with rule T10, whose two step-13 heads met at step 10; PROTOCOL Part 2.) A peer more
        than K steps behind the newest is flagged on its own (`finish`)."""
        heads = sorted({(self.latest[p], h) for p in live
                        if (h := self.history.get(p, {}).get(self.latest[p])) is not None})
        k = self.converge_within
        memo: dict[tuple[str, int], set[str]] = {}

        def anc(h: str, floor: int) -> set[str]:
            if (h, floor) not in memo:
                memo[h, floor] = self.ancestors(h, floor)
            return memo[h, floor]

        return all(anc(a, max(sa, sb) - k) & anc(b, max(sa, sb) - k)
                   for i, (sa, a) in enumerate(heads) for sb, b in heads[i + 1:])

    def converged(self, live: list[str]) -> bool:
        """One model now: one state (N <= G), or mixed lineages (N > G)."""
        held = {(self.latest[p], self.history.get(p, {}).get(self.latest[p])) for p in live}
        return len(held) == 1 or (not self.exact(live) and len({s for s, _ in held}) == 1 and self.mixed(live))

    def commit_fraction(self, since: float = -math.inf, until: float = math.inf) -> float:
        """Of the steps honest peers started training (at `since` or later, before the
        horizon and `until`), those they committed."""
        started = self.started(since, until=until)
        return sum(k in self.committed for k in started) / len(started) if started else 1.0

    def started(self, since: float = -math.inf, last: bool = False, until: float = math.inf) -> list[tuple[str, int]]:
        """The (peer, step)s honest peers started training at `since` or later, before the
        horizon (and `until`); with `last`, a step also counts when a retry of it started then."""
        end = min(getattr(self, "horizon", math.inf), until)
        return [k for k, when in (self.retried if last else self.trained).items() if since <= when <= end]

    def step_time(self) -> float | None:
        """t_step: the median time from an honest peer's start of one step's training to its
        start of the next step's (None: no peer trained two steps in a row)."""
        gaps = [when - self.trained[(p, t - 1)] for (p, t), when in self.trained.items() if (p, t - 1) in self.trained]
        return statistics.median(gaps) if gaps else None

    def verdicts(self, name=str) -> dict:
        """Strikes (R4) and rejections or exclusions honest peers gave honest peers, each
        exclusion as (when, by, whom, why), peers named by `name`."""
        return {"struck": self.struck,
                "excluded": [(round(w, 3), name(a), name(b), why) for w, a, b, why in self.excluded]}

    def counts(self) -> dict[str, int]:
        out = {name: 0 for name in NAMES}
        for v in self.violations:
            out[v.invariant] += 1
        return out


def _s(peer: str) -> str:
    return peer[-6:]
