"""The README's commands, run as written (issue 33): its two-machine flow and its library
example, on 127.0.0.1; and what it and `init --help` say about `--data` is what the loader takes."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


def section(title: str) -> str:
    """The README's `## title` section, up to the next `## ` heading."""
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else len(README)]


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_kinds() -> list[str]:
    from p2ptrain.train.data import TEXT_KINDS

    return ["stdlib", "glob:", "bin:", *(f"{k}:" for k in TEXT_KINDS)]


def test_init_help_and_the_readme_list_every_data_kind():
    out = subprocess.run([sys.executable, "-m", "p2ptrain", "init", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    helptext = " ".join(out.stdout.split())
    data_help = helptext[helptext.index("--data SPEC "):]
    ref = section("Reference")
    for kind in data_kinds():
        assert kind in data_help[:600], f"`init --help` does not list --data {kind}"
        assert f"`{kind}" in ref, f"README's reference does not list --data {kind}"


def test_maddr_is_defined_before_it_is_used():
    first = README.index("MADDR")
    assert "bootstrap" in README[first - 400:first + 200] and "first line" in README[first - 400:first + 200]


def test_pyproject_names_only_files_in_the_repository():
    for name in set(re.findall(r"[\w./-]+\.md\b", (ROOT / "pyproject.toml").read_text())):
        assert (ROOT / name).is_file() or list(ROOT.rglob(name)), f"pyproject.toml refers to {name}, not here"


# -- the two-machine flow ---------------------------------------------------------------------
def two_machine_commands() -> list[str]:
    (block,) = fenced(section("A run across two machines"), "bash")
    lines = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("p2ptrain ")]
    assert [ln.split()[1] for ln in lines] == ["bootstrap", "init", "join", "join"], lines
    return lines


def localize(line: str, **values: str) -> list[str]:
    """A README command for this machine: the placeholder host and the wildcard listen address
    become 127.0.0.1 (dial nothing else), the fixed ports free ones, MADDR / RUN_ID their values."""
    line = line.replace("<public ip>", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")
    for name, value in values.items():
        line = line.replace(name, value)
    argv = shlex.split(line, comments=True)
    assert argv[0] == "p2ptrain"
    return argv[1:]


@pytest.mark.integration
def test_the_readme_two_machine_flow_trains_one_model(procs, report):
    boot_line, init_line, join_a, join_b = two_machine_commands()
    # two machines: each its own home (default workdir, keys); the bootstrap and A share one
    homes = {m: procs.log_dir / f"home-{m}" for m in "AB"}
    for h in homes.values():
        h.mkdir()
    env = {m: {"HOME": str(h), "P2PTRAIN_HOME": str(h / ".p2ptrain")} for m, h in homes.items()}
    boot_port = str(free_port())
    boot = procs.start(localize(boot_line, **{"4001": boot_port}), "bootstrap", env=env["A"])
    maddr = boot.first_line(60).strip()
    assert maddr.startswith(f"/ip4/127.0.0.1/tcp/{boot_port}/p2p/"), maddr
    init = subprocess.run([sys.executable, "-m", "p2ptrain", *localize(init_line)], capture_output=True,
                          text=True, cwd=procs.log_dir, env=dict(os.environ, **env["A"]), timeout=300)
    assert init.returncode == 0, init.stderr[-2000:]
    run_id = HEX64.findall(init.stdout)[0]
    extra = ["--json", "--max-outer-steps", "2"]  # leave after 2 committed steps, events on stdout
    peers = [procs.start(localize(line, MADDR=maddr, RUN_ID=run_id, **{"4002": str(free_port())}) + extra,
                         name, env=env[m])
             for line, name, m in ((join_a, "peer-A", "A"), (join_b, "peer-B", "B"))]
    for p in peers:
        p.wait_event(lambda e: e.get("event") == "left", 600)
        assert p.proc.wait(60) == 0, p.stderr_tail()
    last = [[e for e in p.all_events if e.get("event") == "outer_step_committed"][-1] for p in peers]
    assert last[0]["step"] == last[1]["step"] >= 2, last
    assert last[0]["params_sha256"] == last[1]["params_sha256"], last
    report(f"README two-machine flow: both peers at step {last[0]['step']}, params {last[0]['params_sha256'][:16]}")


# -- the library example --------------------------------------------------------------------------
@pytest.mark.integration
def test_the_readme_library_example_runs_as_written(procs, tmp_path, report):
    from conftest import start_bootstrap

    (example,) = fenced(section("The library"), "python")
    script = tmp_path / "train.py"
    script.write_text(example)
    boot, maddr = start_bootstrap(procs)
    runs = []
    for i in range(2):  # two machines: each its own home (default workdir)
        home = tmp_path / f"home{i}"
        home.mkdir()
        runs.append(subprocess.Popen([sys.executable, str(script), maddr, "/ip4/127.0.0.1/tcp/0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=home,
                                     env=dict(os.environ, HOME=str(home))))
    lines = []
    for p in runs:
        try:
            out, err = p.communicate(timeout=400)
        finally:
            p.kill()
        assert p.returncode == 0, err[-2000:]
        lines.append(out.strip().splitlines()[-1])
    got = [re.fullmatch(r"outer step (\d+), loss [\d.]+, params ([0-9a-f]{16})", ln) for ln in lines]
    assert all(got), lines
    assert got[0].group(1) == got[1].group(1) == "5", lines
    assert got[0].group(2) == got[1].group(2), lines
    report(f"README library example: {lines[0]}")
