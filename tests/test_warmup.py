"""Rule W1 (a fresh optimizer warms up: docs/PROTOCOL.md), the trainer's own decision
(`Trainer.warms_up`), on a stand-in holding just the state it reads."""

from __future__ import annotations

import types

import trio

from p2ptrain.train.trainer import Trainer


def trainer(last_roster: set[str], records_say: bool, committed: int = 1):
    async def someone_trains(t: int) -> bool:
        return records_say

    return types.SimpleNamespace(_warmed=False, me="me", last_roster=last_roster, someone_trains=someone_trains,
                                 committed=committed)


def warms(tr, t: int) -> bool:
    return trio.run(Trainer.warms_up, tr, t)


def test_a_joiner_warms_up_after_its_first_commit_before_the_veterans_records_are_out():
    """The lone-run test (tests/test_one_model.py), most full-suite runs: the first joiner
    committed step 31 with the veteran (joining with zeros), then asked at once whether anyone
    trains step 32. The veteran's state and ready records for 32 were not out yet, so it trained
    a fresh AdamW's phase; its norm failed the veteran's probation bound (C1a), and every retry
    of that same delta failed it again: the pair never committed another step, and the two
    later joiners waited on them. The partner we just committed with trains this step."""
    assert warms(trainer({"me", "veteran"}, records_say=False), 32)
    assert not warms(trainer({"me"}, records_say=False), 32)  # alone: we contribute our phase
    assert warms(trainer(set(), records_say=True), 32)  # restarted: the records say
    assert not warms(trainer({"me", "veteran"}, records_say=True), 0)  # the genesis: nothing is fresh
    # a roster J3 restored after a restart is no partner we just committed with: it may be
    # gone for good, and a warm-up alone never commits (scenario `lone_restart`)
    assert not warms(trainer({"me", "veteran"}, records_say=False, committed=0), 32)


def test_the_warm_up_is_decided_once():
    tr = trainer({"me", "veteran"}, records_say=True)
    assert warms(tr, 5) and not warms(tr, 6)
