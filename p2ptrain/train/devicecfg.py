"""What a user asks of a peer's device: `DeviceConfig` and `join`'s --device/--precision flags.

Kept apart from `p2ptrain.train.device` (which needs torch) so that building the CLI's
parser, and `--help`, never import torch (issue 33). Whether this machine can honour the
request is `device.config_from_args`'s question, asked when the command runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEVICE_HELP = "auto, cpu, cuda or cuda:N"
PRECISIONS = ("auto", "fp32", "bf16")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d{1,3})$")


@dataclass
class DeviceConfig:
    device: str = "auto"
    """Where the model trains: auto (the first GPU if there is one), cpu, cuda or cuda:N."""
    precision: str = "auto"
    """Inner-step precision: auto (bf16 autocast on a GPU with bf16), fp32 or bf16."""

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ValueError(f"device must be {DEVICE_HELP}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


def add_device_args(p) -> None:
    """`join --device` and `--precision`."""
    p.add_argument("--device", default="auto", metavar="DEV", help=f"where the model trains: {DEVICE_HELP} "
                   "(auto: the first GPU if torch sees one)")
    p.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="inner steps: auto (bf16 autocast on a GPU with bf16, else fp32), fp32 or bf16")
