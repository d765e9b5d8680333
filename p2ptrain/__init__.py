"""p2ptrain: permissionless, coordinator-free DiLoCo training over libp2p.

This top-level module stays import-light on purpose: benchmark baselines (hivemind) run
`python -m p2ptrain.bench...` in their own processes and must not pull in libp2p.
"""

import os

__version__ = "0.1.0"

# torch and numba's parallel kernels share the OpenMP runtime. With its default "active"
# wait policy, numba's idle worker threads spin after every parallel kernel and made every
# later torch training step in the same process ~27x slower (measured: 10 tiny-model steps
# 1.4 s before one ring kernel call, 37 s after). Passive waiting removes it. This must be set
# before the OpenMP runtime loads, so it lives here, ahead of any torch or numba import; a
# program that imports torch before p2ptrain should set OMP_WAIT_POLICY=passive itself.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")


def __getattr__(name: str):
    # `from p2ptrain import DiLoCo` without making `import p2ptrain` load torch and libp2p.
    if name == "DiLoCo":
        from p2ptrain.api import DiLoCo

        return DiLoCo
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")
