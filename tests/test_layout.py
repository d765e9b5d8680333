"""The tree stays what docs/DESIGN.md says it is: every module in the module map, no stale
entries, and none grown past the size the project holds itself to (issue 14)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("p2ptrain", "dht", "kernels", "bootstrap")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def modules() -> list[Path]:
    return sorted(p for d in PACKAGES for p in (ROOT / d).rglob("*.py"))


def test_design_module_map_matches_the_tree():
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text[text.index("## Module map"):]
    section = section[:section.index("\n## ", 1)]
    mapped = set(re.findall(r"^\| `([^`]+\.py)` \|", section, re.M))
    tree = {str(p.relative_to(ROOT)) for p in modules()
            if p.name != "__init__.py" or p.parent.name == "kernels"}
    assert not tree - mapped, f"modules missing from docs/DESIGN.md's module map: {sorted(tree - mapped)}"
    assert not mapped - tree, f"module map names modules that are gone: {sorted(mapped - tree)}"


def test_no_module_or_function_outgrows_its_bound():
    big, long_fns = [], []
    for p in modules():
        src = p.read_text()
        if src.count("\n") > MAX_MODULE_LINES:
            big.append((str(p.relative_to(ROOT)), src.count("\n")))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_fns.append((f"{p.relative_to(ROOT)}:{node.name}", n))
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"
    assert not long_fns, f"functions over {MAX_FUNCTION_LINES} lines: {long_fns}"


def test_the_checkout_runs_in_place_from_its_root():
    """`python -m p2ptrain` in the checkout's root imports the checkout's p2ptrain/, not the
    installed copy; its subpackages kept in top-level folders must resolve there too (CI's
    `bench readpause` test once died of `No module named 'p2ptrain.dht'` this way)."""
    import subprocess
    import sys

    code = ("import p2ptrain, p2ptrain.dht.record, p2ptrain.kernels, p2ptrain.bootstrap; "
            "print(p2ptrain.__file__); print(p2ptrain.kernels.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-800:]
    pkg, kernels = out.stdout.split()
    assert Path(pkg).resolve() == ROOT / "p2ptrain" / "__init__.py"
    assert Path(kernels).resolve() == ROOT / "kernels" / "__init__.py"
    cli = subprocess.run([sys.executable, "-m", "p2ptrain", "bench", "readpause", "--help"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert cli.returncode == 0 and "readpause" in cli.stdout, cli.stderr[-800:]
