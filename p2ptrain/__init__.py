"""p2ptrain: permissionless, coordinator-free DiLoCo training over libp2p.

This top-level module stays import-light on purpose: benchmark baselines (hivemind) run
`python -m p2ptrain.bench...` in their own processes and must not pull in libp2p.
"""

__version__ = "0.1.0"
