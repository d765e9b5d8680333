"""Test doubles that stand in for one part of the real thing. The hostile contributors and
the corrupting blob server are the benches' own (p2ptrain/bench/adversary.py, which also
lists the modes); what only tests need lives here:
  ckpt-pause:STEP:SECONDS  trains honestly, but stalls halfway through writing that step's
          checkpoint (so a test can SIGKILL it mid-write)
  die-at-header:STEP  trains honestly, and dies (os._exit, like a SIGKILL) as it signs its
          contribution header for that step: after its ready record is out and its group
          confirmed it, before the round can commit anywhere
"""

from __future__ import annotations

import os
import time

from p2ptrain.bench.adversary import (  # noqa: F401  (re-exported for the tests)
    CONTRIBUTION_MODES, CorruptBlobServer, HostileContributor, flip_one_byte)
from p2ptrain.ckpt import checkpoint
from p2ptrain.run.round import Contributor


class PausingWriter(checkpoint.AsyncWriter):
    """Writes half of step `pause_step`'s file, says so, then stalls `seconds` (a real torn
    write, as a crash mid-write leaves it)."""

    def __init__(self, directory, keep, on_written=None, on_failed=None, *, events=None, pause_step: int,
                 seconds: float) -> None:
        super().__init__(directory, keep, on_written, on_failed)
        self.events, self.pause_step, self.seconds = events, pause_step, seconds

    def _write(self, step: int, data: bytes) -> None:
        if step != self.pause_step:
            return super()._write(step, data)
        path = self.path(step)
        with open(checkpoint.tmp_path(path), "wb") as f:
            f.write(memoryview(data)[:len(data) // 2])
            f.flush()
        if self.events is not None:
            self.events.emit("checkpoint_write_paused", step=step)
        time.sleep(self.seconds)
        super()._write(step, data)


class DyingContributor(Contributor):
    """Honest until it signs its header for step `step`: then the process ends at once."""

    def __init__(self, step: int) -> None:
        self.step = step

    def sign(self, header, identity) -> bytes:
        if header.step == self.step:
            os._exit(9)
        return super().sign(header, identity)
