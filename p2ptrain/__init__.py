"""p2ptrain: permissionless, coordinator-free DiLoCo training over libp2p.

This top-level module stays import-light on purpose: benchmark baselines (hivemind) run
`python -m p2ptrain.bench...` in their own processes and must not pull in libp2p.
"""

import os
import sys

__version__ = "0.1.0"

# torch and numba's parallel kernels share the OpenMP runtime. With its default "active"
# wait policy, numba's idle worker threads spin after every parallel kernel and made every
# later torch training step in the same process ~27x slower (measured: 10 tiny-model steps
# 1.4 s before one ring kernel call, 37 s after). Passive waiting removes it. This must be set
# before the OpenMP runtime loads, so it lives here, ahead of any torch or numba import; a
# program that imports torch before p2ptrain should set OMP_WAIT_POLICY=passive itself.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

# The design card keeps p2ptrain.dht, .kernels and .bootstrap in top-level folders (pyproject
# maps them at install time). Imported from a source checkout instead (`python -m p2ptrain`
# run in the checkout's root puts this folder ahead of the installed package), those three
# would be missing; the checkout's root joins the search path so they resolve there as well.
# An installed copy has them inside this folder and is left as it is.
_here = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(_here)
_from_checkout = not os.path.isdir(os.path.join(_here, "dht")) and all(
    os.path.isfile(os.path.join(_root, sub, "__init__.py")) for sub in ("dht", "kernels", "bootstrap"))
if _from_checkout:
    __path__.append(_root)  # noqa: F821 - a package module's own search path


def checkout_off_sys_path() -> None:
    """Take a source checkout's root off `sys.path` (an installed copy: nothing to do).

    On sys.path (the working directory of `python -m` in the checkout, the tests' and the
    benches' PYTHONPATH for their children) the root's folders are also top-level modules
    named `dht`, `kernels` and `bootstrap`, beside p2ptrain.dht, .kernels and .bootstrap, which
    resolve through this package's own path above. `kernels` is Hugging Face's kernel hub, which
    transformers 5 imports as it loads a model: ours shadowed it and every `hf:` model failed
    ("cannot import name 'CUDAProperties' from 'kernels'", a fresh install on 2026-12-07)."""
    if _from_checkout:
        root = os.path.realpath(_root)
        sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]


checkout_off_sys_path()

# The lab drivers (p2ptrain/bench: benchmarks, hivemind baselines, attack tools) are left out
# of the installed package (issue 33: a user of the network never runs them). An installed
# copy started in a checkout's root (`p2ptrain bench ...` there) finds them in the checkout;
# only what the installed copy lacks resolves there, the rest stays the installed code.
if not os.path.isdir(os.path.join(_here, "bench")):
    try:
        _checkout = os.path.join(os.getcwd(), "p2ptrain")
    except OSError:  # the working directory was removed
        _checkout = ""
    if _checkout and os.path.isfile(os.path.join(_checkout, "bench", "__init__.py")):
        __path__.append(_checkout)  # noqa: F821


def __getattr__(name: str):
    # `from p2ptrain import DiLoCo` without making `import p2ptrain` load torch and libp2p.
    if name == "DiLoCo":
        from p2ptrain.api import DiLoCo

        return DiLoCo
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")
