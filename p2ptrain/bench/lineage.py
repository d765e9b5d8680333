"""What a run's event lines say about its lineages (issue 31): pure logic over the `--json`
events of real `p2ptrain join` processes, shared by `bench scale` and tests/test_one_model.py.

A peer's *state at step s* is the params hash it reported for s: `outer_step_committed`
(whose `step` is the state's step, t + 1 after committing outer step t) or `caught_up` (a
state adopted from others). Peers are named by their `peer` field (their identity), so a peer
restarted with the same key is one peer. No I/O here: callers collect the events.
"""

from __future__ import annotations

import statistics


def states(events: list[dict]) -> dict[str, dict[int, str]]:
    """peer -> {state step: params_sha256}, from commits and catch-ups (the last one wins)."""
    out: dict[str, dict[int, str]] = {}
    for e in events:
        if e.get("event") in ("outer_step_committed", "caught_up") and e.get("params_sha256"):
            out.setdefault(e["peer"], {})[int(e["step"])] = e["params_sha256"]
    return out


def commits(events: list[dict]) -> dict[str, dict[int, dict]]:
    """peer -> {state step: its outer_step_committed event}."""
    out: dict[str, dict[int, dict]] = {}
    for e in events:
        if e.get("event") == "outer_step_committed":
            out.setdefault(e["peer"], {})[int(e["step"])] = e
    return out


def one_lineage_step(st: dict[str, dict[int, str]], peers: list[str], lo: int, hi: int) -> int | None:
    """The first state step in [lo, hi] at which every one of `peers` reported the same
    params hash, or None."""
    for s in range(lo, hi + 1):
        hashes = {st.get(p, {}).get(s) for p in peers}
        if len(hashes) == 1 and None not in hashes:
            return s
    return None


def lineages_at_newest_shared(events: list[dict], at_least: int = 2) -> tuple[int | None, int, int]:
    """(step, distinct params hashes, peers) at the newest state step that at least
    `at_least` peers committed: one hash there means they ended on one model."""
    by_step: dict[int, dict[str, str]] = {}
    for peer, cs in commits(events).items():
        for s, e in cs.items():
            by_step.setdefault(s, {})[peer] = e["params_sha256"]
    shared = [s for s, m in by_step.items() if len(m) >= at_least]
    if not shared:
        return None, 0, 0
    s = max(shared)
    return s, len(set(by_step[s].values())), len(by_step[s])


def commit_fraction(events: list[dict], cut: dict[str, int] | None = None) -> dict[str, tuple[int, int]]:
    """peer -> (outer steps it started training, how many of those it committed).

    A step counts once however often it was retried; joining with zeros is not training.
    `cut`: peer -> an outer step it was stopped in (by the bench, not by a failure): that step
    had no chance to finish and is not counted."""
    started: dict[str, set[int]] = {}
    for e in events:
        if e.get("event") == "outer_step_started" and not e.get("joining"):
            started.setdefault(e["peer"], set()).add(int(e["step"]))
    done = {(p, s - 1) for p, cs in commits(events).items() for s in cs}
    out = {}
    for p, steps in started.items():
        if cut and p in cut:
            steps = steps - {cut[p]}
        out[p] = (len(steps), sum((p, t) in done for t in steps))
    return out


def val_loss_spread(events: list[dict]) -> tuple[float | None, dict[str, tuple[int, float]]]:
    """(max - min over mean of each peer's final val_loss, in per cent; peer -> (step, loss))."""
    final: dict[str, tuple[int, float]] = {}
    for peer, cs in commits(events).items():
        s = max(cs)
        if cs[s].get("val_loss") is not None:
            final[peer] = (s, float(cs[s]["val_loss"]))
    if len(final) < 2:
        return None, final
    vals = [v for _, v in final.values()]
    return round(100 * (max(vals) - min(vals)) / statistics.mean(vals), 4), final


def describe(events: list[dict], names: dict[str, str] | None = None, last: int = 8) -> str:
    """One line per peer that joined: the steps it joined at (one per process), its newest
    state steps with hash prefixes, its commits (how many alone), skips -- what a failed
    lineage check prints so the log says how the run forked."""
    names = names or {}
    st, cs_all = states(events), commits(events)
    joins: dict[str, list[int]] = {}
    for e in events:
        if e.get("event") == "run_joined":
            joins.setdefault(e["peer"], []).append(int(e.get("step", 0)))
    lines = []
    for peer in sorted(set(st) | set(joins), key=lambda p: names.get(p, p)):
        mine = st.get(peer, {})
        skips = [(e["step"], e.get("reason")) for e in events
                 if e.get("event") == "outer_step_skipped" and e.get("peer") == peer]
        cs = cs_all.get(peer, {})
        alone = sum(len(e.get("members") or ()) == 1 for e in cs.values())
        lines.append(f"{names.get(peer, peer[-8:])}: joined at {joins.get(peer, [])}; states "
                     + " ".join(f"{s}:{mine[s][:6]}" for s in sorted(mine)[-last:])
                     + f" | commits {len(cs)} (alone {alone}), skips {len(skips)} {skips[-3:]}")
    return "\n".join(lines)
