"""`AllReduceConfig`: the all-reduce service's settings (`p2ptrain.reduce.service`), with
their validation. Split from the service so the service module holds only its behaviour."""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.reduce.ring import RingConfig


@dataclass
class AllReduceConfig:
    mode: str = "int8"
    """'int8' or 'fp32' on the wire."""
    sub_chunk_bytes: int = 4 << 20
    """fp32 bytes per pipelined frame (4 MiB: a 1 MiB int8 frame, as in the raw-socket
    ceiling; 1 MiB frames measured ~10 % slower from per-frame overhead)."""
    setup_timeout: float = 15.0
    """Seconds to set up both bulk sessions (members may start a little apart)."""
    frame_timeout: float = 20.0
    """Seconds without a frame (or a vote) before the round gives up."""
    frame_allowance: float = 10.0
    """Seconds a begun frame may take beyond its size at `frame_min_rate_mbps` (`bulk.FrameBudget`)."""
    frame_min_rate_mbps: float = 0.125  # MB/s (1 Mbit/s): a begun frame arriving slower blames its sender
    round_allowance: float = 15.0
    """Seconds a round's data plane (frames and votes) may take beyond its bytes at
    `frame_min_rate_mbps` (`data_budget`); past it the round fails, nobody blamed. The frame
    rules bound one frame (its budget once begun, `frame_timeout` of silence before it), so a
    member silent just under `frame_timeout` before each of its frames stretched a round to
    2(W-1) frames x ~19 s (the simulator's `trickle`, issue 32); R4's leave-one-out then
    finds whose absence lets rounds finish."""
    commit_timeout: float = 10.0
    """Seconds to collect every member's vote (robust rounds) or a commit certificate (a member
    missing votes) after our own data plane finished."""
    gone_probe: float = 1.0
    """Seconds between checks, while setup waits, for a member certainly gone (no connection,
    no dial: killed after it confirmed the roster), which fails the round at once."""
    direct: bool = True
    """Try a raw TCP connection for bulk bytes; False forces the libp2p stream."""
    send_rate_mbps: float = 0.0
    """Cap on bulk send rate in MB/s (0 = none), e.g. to leave room on a home uplink."""
    control_streams: bool = True
    """Votes and exchanges on persistent control streams (`ctlstreams`); False: a libp2p
    stream per message, 3.6-5x the CPU (the baseline of `p2ptrain bench exchange`)."""
    early_ttl: float = 60.0
    """Seconds a member's vote or exchange message for a round not started here is kept
    (`run.spec.TimeoutsSpec.early_ttl`). Read when the service starts."""

    def __post_init__(self) -> None:
        RingConfig(self.mode, sub_chunk_bytes=self.sub_chunk_bytes)
        for name in ("setup_timeout", "frame_timeout", "commit_timeout", "gone_probe", "frame_allowance",
                     "frame_min_rate_mbps", "round_allowance"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.send_rate_mbps < 0:
            raise ValueError("send_rate_mbps must be >= 0")
        if not self.early_ttl > 0:
            raise ValueError("early_ttl must be > 0")

    def data_budget(self, nbytes: int, world: int) -> float:
        """Seconds the data plane of a round of `world` members may take for an `nbytes` fp32
        vector: each member moves 2(W-1)/W of it as it goes on the wire (int8: a quarter, plus
        its block scales), at `frame_min_rate_mbps`, plus `round_allowance` (latency, setup
        skew, the votes). The wire's bytes, not fp32's: the budget is also how long a member
        slow within every frame rule holds each attempt of a round it is in (red team
        `trickle`), and fp32's bytes gave int8 rounds 4x what their frames need."""
        from p2ptrain.reduce.schedule import wire_bytes

        wire = wire_bytes(nbytes // 4, RingConfig(self.mode, sub_chunk_bytes=self.sub_chunk_bytes))
        return self.round_allowance + self.at_floor(2 * (world - 1) / max(1, world) * wire)

    def at_floor(self, nbytes: float) -> float:
        """Seconds `nbytes` take at the bulk floor rate (`frame_min_rate_mbps`)."""
        return nbytes / (self.frame_min_rate_mbps * 1e6)
