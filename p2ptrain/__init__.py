"""p2ptrain: permissionless, coordinator-free DiLoCo training over libp2p.

This top-level module stays import-light on purpose: benchmark baselines (hivemind) run
`python -m p2ptrain.bench...` in their own processes and must not pull in libp2p.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `from p2ptrain import DiLoCo` without making `import p2ptrain` load torch and libp2p.
    if name == "DiLoCo":
        from p2ptrain.api import DiLoCo

        return DiLoCo
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")
