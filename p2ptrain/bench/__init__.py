"""Lab drivers: benchmarks, hivemind baselines and attack tools (issue 33: not installed).

They live in the repository only and run from a checkout: `python -m p2ptrain bench ...` in
its root, or `p2ptrain bench ...` there with the package installed (p2ptrain/__init__.py then
finds this folder through the working directory). The processes a bench starts run in
folders of their own, where neither would find this package again, so every child gets the
checkout on its PYTHONPATH: children run the same checkout's code as the bench itself.
"""

import os

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
