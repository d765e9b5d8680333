"""Transfers of a whole state get time by their bytes (`p2ptrain.run.roundparts.transfer_budget`):
a newcomer's first fetch, a catch-up, a merge's fetches. Each had a fixed limit (120 s, 120 s,
30 s) that a tiny model meets and a real one cannot: a 1B-parameter state (~4 GB) in 120 s
needs 270 Mbit/s, so a newcomer on a slower link never joined."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2ptrain import peer
from p2ptrain.net.node import NodeError
from p2ptrain.run import runner
from p2ptrain.run.roundparts import transfer_budget
from p2ptrain.train import lineage
from test_peer import spec_for

BIG = 400 << 20  # a 100M-parameter fp32 state


def test_the_budget_is_the_bytes_at_the_floor_rate_and_never_under_the_old_limit():
    cfg = peer.service_config(spec_for("int8"))
    assert transfer_budget(cfg, 4096, 120.0) == 120.0  # tiny models (tests, the simulator): as before
    assert transfer_budget(cfg, BIG, 120.0) == pytest.approx(cfg.round_allowance + BIG / 125_000)


@pytest.mark.parametrize("serving", [True, False])
def test_a_newcomers_first_fetch_may_take_what_the_states_bytes_take(monkeypatch, serving):
    """A download of 2,000 s (400 MB at 1.6 Mbit/s) completes; before, the fetch gave up at
    120 s. Where nobody advertises a state it still gives up after 120 s (a wrong run id)."""
    spec = spec_for("int8").with_genesis("0" * 64, BIG)

    async def fetch(node, run_id, spec, events, resume=None):
        if not serving:
            return None
        await trio.sleep(2000.0)
        return 7, b"state"

    monkeypatch.setattr(runner, "fetch_checkpoint", fetch)

    async def main():
        t0 = trio.current_time()
        if serving:
            assert await runner.fetch_state(None, "run", spec, None) == b"state"
        else:
            with pytest.raises(NodeError):
                await runner.fetch_state(None, "run", spec, None)
        return trio.current_time() - t0

    took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert took == pytest.approx(2000.0 if serving else 121.0, abs=1.0), took


def test_a_catch_up_defaults_to_the_trainers_fetch_budget(monkeypatch):
    seen = {}

    async def adopt(*args, timeout, patience, **kwargs):
        seen.update(timeout=timeout, patience=patience)

    monkeypatch.setattr(lineage, "adopt", adopt)

    class Peer(lineage.Lineage):
        node = run_id = spec = events = state_scorer = None

        class ledger:
            rejected_ckpts: set = set()

            class standing:
                trusted = staticmethod(frozenset)

        class local:
            step = 0

    p = Peer()
    p.fetch_timeout = 3300.0
    trio.run(p.catch_up, 5)
    assert seen == {"timeout": 3300.0, "patience": 120.0}  # a download may run 3300 s; nothing advertised: 120 s
    trio.run(lambda: p.catch_up(5, timeout=60.0))
    assert seen == {"timeout": 60.0, "patience": 60.0}
