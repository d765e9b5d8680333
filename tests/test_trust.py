"""Issue 15's trust holes, one test (or more) each: a single identity must not be able to
stall, fork or hijack a run. Pure-logic tests here; each failed on commit 5f080d3."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from p2ptrain.run import election

H = [hashlib.sha256(bytes([i])).hexdigest() for i in range(8)]


# -- hole 2: a ready record's claimed time must not move the deadline ----------------------
def _ready(peer: str, at: float, joining: bool = False) -> election.Ready:
    return election.Ready(peer, at, (), joining)


def test_one_liar_with_an_early_ready_at_does_not_empty_the_honest_groups():
    honest = [_ready(f"h{i}", 1000.0 + 0.3 * i) for i in range(4)]
    liar = _ready("liar", 1.0)  # "I was ready in 1970": on 5f080d3 the deadline became 6.0
    cands = {r.peer for r in election.candidates([*honest, liar], window=5.0)}
    assert {r.peer for r in honest} <= cands
    # and the groups every honest peer computes still hold every honest peer
    groups = election.groups("run", 3, sorted(cands), 4)
    assert sorted(p for g in groups for p in g if p.startswith("h")) == ["h0", "h1", "h2", "h3"]


def test_a_minority_of_liars_cannot_pull_the_deadline_below_the_earliest_honest_peer():
    for k in (1, 2, 3):
        honest = [_ready(f"h{i}", 1000.0 + i) for i in range(4)]
        liars = [_ready(f"s{j}", 1.0) for j in range(k)]
        assert election.deadline([*honest, *liars], 5.0) >= 1000.0 + 5.0
    # joiners never start the clock, whatever they claim
    assert election.deadline([_ready("j", 1.0, True), _ready("h", 50.0)], 5.0) == 55.0


def test_claimed_ready_time_is_clamped_to_what_the_reader_observed():
    ttl = election.ready_ttl(5.0)
    # claims 1.0, but its signed record expires at 2000 with the run's TTL: written >= 2000 - ttl - skew
    assert election.clamp(1.0, -math.inf, 2000.0, 2000.0 + ttl - 30, ttl, skew=2.0) == 2000.0 - 32.0
    # first seen on a poll at 1500 that followed a poll at 1499 without it: not before 1499
    assert election.clamp(1.0, 1499.0, 1500.0, 1500.0 + ttl, ttl) == 1499.0
    # a claim in the future is capped at first sight
    assert election.clamp(9e9, -math.inf, 1500.0, 1500.0 + ttl, ttl) == 1500.0
    # an honest claim (ready_at + ttl == expiry, seen after) is kept exactly
    assert election.clamp(1000.25, 999.0, 1000.5, 1000.25 + ttl, ttl) == 1000.25


def test_sightings_remember_the_first_poll_and_the_poll_before_it():
    s = election.Sightings()
    assert s.observe(3, ["a"], 10.0) == {"a": (-math.inf, 10.0)}
    got = s.observe(3, ["a", "b"], 10.2)
    assert got == {"a": (-math.inf, 10.0), "b": (10.0, 10.2)}
    s.observe(9, [], 50.0)
    assert (3, "a") not in s.first  # old steps forgotten
