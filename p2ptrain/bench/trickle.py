"""Members that slow the bulk data plane down (the red team's `slowloris` and `trickle`;
`p2ptrain.bench.adversary` runs them as `join` processes). Each trains and contributes
honestly; only the pace of the bulk frames it sends (data and votes) is hostile, and it never
votes to abort (its own send timeout would otherwise end the round for everyone)."""

from __future__ import annotations

import dataclasses

from p2ptrain.reduce.service import AllReduceService


class TrickleIO:
    """A bulk IO whose every frame leaves one byte every `every` seconds (slowloris)."""

    def __init__(self, io, every: float) -> None:
        self.io, self.every = io, every
        if hasattr(io, "recv_some"):
            self.recv_some = io.recv_some

    def sendall(self, parts) -> None:
        import time

        data = b"".join(bytes(p) for p in parts)
        for i in range(len(data)):
            self.io.sendall([data[i:i + 1]])  # raises once the receiver closed: the thread ends
            time.sleep(self.every)

    def __getattr__(self, name):
        return getattr(self.io, name)


class TricklingService(AllReduceService):
    """Sends its bulk frames (data and votes) one byte every `every` s, and never votes to
    abort (its own send timeout would otherwise end the round for everyone)."""

    io = TrickleIO

    def __init__(self, *args, every: float = 0.1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        wrap, self.every = self.sessions._wrap, every
        self.sessions._wrap = lambda io: self.io(wrap(io), self.every)
        # it waits as long as its trickle takes: its own frame deadline would end its round
        self.others_frame_timeout = self.config.frame_timeout  # the honest members' (same run)
        self.config = dataclasses.replace(self.config, frame_timeout=max(self.config.frame_timeout, 600.0))

        async def no_abort(*args, **kwargs) -> None:
            pass

        self.board.abort = no_abort


class PausingIO(TrickleIO):
    """A bulk IO that is silent for `every` seconds before each frame, then sends it whole:
    the slowest trickle the frame rules let through (the simulator's `trickle`)."""

    def sendall(self, parts) -> None:
        import time

        time.sleep(self.every)
        self.io.sendall(parts)


class PausingService(TricklingService):
    """`TricklingService` whose frames each come whole after `every` s of silence, just under
    the others' frame timeout: no frame is late, every round is (`AllReduceConfig.data_budget`)."""

    io = PausingIO

    def __init__(self, *args, every: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.every = 0.9 * self.others_frame_timeout if every is None else every
