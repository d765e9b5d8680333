"""Test doubles that stand in for one part of the real thing (see adversary.py)."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def env(extra: dict | None = None) -> dict:
    """Environment for a child `python -m fakes.hostile_peer`: tests/ importable."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **(extra or {})}
