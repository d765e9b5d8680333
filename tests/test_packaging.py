"""Issue 33, item 9: the installed package holds what users run, not the lab drivers
(p2ptrain/bench: benchmarks, hivemind baselines, attack tools, 27 % of it before), and those
still run from a checkout, with or without the package installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"dht": "p2ptrain.dht", "kernels": "p2ptrain.kernels", "bootstrap": "p2ptrain.bootstrap"}


def tree_packages() -> set[str]:
    pkgs = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "p2ptrain").rglob("__init__.py")}
    return pkgs | {name for d, name in MAPPED.items() if (ROOT / d / "__init__.py").is_file()}


def test_the_wheel_lists_every_package_but_the_lab():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert listed == tree_packages() - {"p2ptrain.bench"}, (
        f"pyproject.toml's packages: missing {sorted(tree_packages() - listed - {'p2ptrain.bench'})}, "
        f"stale or lab {sorted(listed - tree_packages() | (listed & {'p2ptrain.bench'}))}")


def _setuptools_builds_wheels() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return tuple(int(x) for x in setuptools.__version__.split(".")[:2]) >= (70, 1)


def build_wheel(tmp: Path) -> Path:
    """The wheel pip builds, from a copy of the tree (setuptools' build/ folder keeps files of
    earlier builds and would put them in)."""
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for d in ("p2ptrain", "dht", "kernels", "bootstrap"):
        shutil.copytree(ROOT / d, src / d, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    # this interpreter's setuptools when it can build wheels by itself (bdist_wheel is built in
    # since 70.1), else pip's isolated build (which fetches setuptools, as `pip install .` does)
    isolation = ["--no-build-isolation"] if _setuptools_builds_wheels() else []
    # Without the checkout on the path conftest exports: there its folder kernels/ is a module
    # `kernels`, and setuptools loads every installed distribution's egg_info writers, among
    # them Hugging Face's `kernels` (transformers 5 needs it): "No module named
    # 'kernels._internals'", and no wheel (a fresh install on 2026-12-07).
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
                          "-w", str(tmp / "whl"), str(src)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)))
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp / "whl").glob("p2ptrain-*.whl")
    return wheel


def test_the_installed_package_leaves_the_lab_out_and_a_checkout_runs_it(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("p2ptrain/bench/")]
    for needed in ("p2ptrain/dht/node.py", "p2ptrain/kernels/__init__.py", "p2ptrain/bootstrap/p2ptrain-bootstrap.service",
                   "p2ptrain/dashboard/static/index.html", "p2ptrain/cli/main.py", "p2ptrain/api.py"):
        assert needed in names, needed
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # the installed copy alone: -P keeps the working directory off sys.path, PYTHONPATH is the
    # "site-packages" (not the checkout, which conftest exports for other children)
    env = dict(os.environ, PYTHONPATH=str(site))
    probe = "import p2ptrain, sys; print(p2ptrain.__file__); import p2ptrain.bench"
    outside = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True,
                             cwd=tmp_path, env=env, timeout=120)
    assert outside.stdout.startswith(str(site)) and "No module named 'p2ptrain.bench'" in outside.stderr, outside
    cli = subprocess.run([sys.executable, "-P", "-m", "p2ptrain", "bench", "kernels"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=120)
    assert cli.returncode == 2 and "source checkout" in cli.stderr, cli  # advice, not a traceback
    # in a checkout's root: `p2ptrain bench ...` finds the lab there, and the processes a bench
    # starts (in folders of their own) get the checkout on their path
    probe = "import p2ptrain.bench.readpause as r, os; print(r.__file__); print(os.environ['PYTHONPATH'])"
    inside = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, cwd=ROOT,
                            env=env, timeout=120)
    assert inside.returncode == 0, inside.stderr[-2000:]
    where, path = inside.stdout.split("\n")[:2]
    assert Path(where).resolve() == ROOT / "p2ptrain" / "bench" / "readpause.py"
    assert path.split(os.pathsep)[0] == str(ROOT)
    cli = subprocess.run([sys.executable, "-P", "-m", "p2ptrain", "bench", "readpause", "--help"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert cli.returncode == 0 and "readpause" in cli.stdout, cli.stderr[-2000:]


def test_the_checkout_root_on_the_path_shadows_no_top_level_package(tmp_path):
    """`python -m p2ptrain` in a checkout's root, and the tests' and benches' children, have
    the root on sys.path, where the design card's folder kernels/ was also a top-level module
    `kernels`: Hugging Face's kernel hub, which transformers 5 imports as it loads a model
    (a fresh install on 2026-12-07: every `hf:` model failed, "cannot import name
    'CUDAProperties' from 'kernels'"). Once p2ptrain is imported, those names resolve past the
    checkout (to an installed package of that name, or to none), and p2ptrain.kernels still
    to the checkout's folder."""
    probe = ("import importlib.util as u, p2ptrain.kernels as k; "
             "print(k.__file__); print([getattr(u.find_spec(n), 'origin', None) for n in ('kernels', 'dht', 'bootstrap')])")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for cwd in (ROOT, tmp_path):  # the root as the working directory (`python -m`), and on PYTHONPATH
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=cwd, env=env,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        mine, found = out.stdout.splitlines()[:2]
        assert Path(mine).resolve() == ROOT / "kernels" / "__init__.py"
        assert str(ROOT) not in found, (cwd, found)
