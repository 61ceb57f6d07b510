"""The Makefile's set-up logic (README's `make train` / `make test` on a fresh machine): a project
virtual environment when none is active (PEP 668 systems refuse pip outside one), an active one
kept, one install per pyproject.toml (a stamp), torch pinned to the CPU build, and one clear line
when the venv module is missing. Runs the real Makefile with a stand-in interpreter that logs
what it is asked to do, in a copy of the repository's Makefile and pyproject.toml."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A stand-in python: logs its arguments, answers the Makefile's venv probe from $FAKE_VENV_PREFIX,
# creates a "virtual environment" (a copy of itself as DIR/bin/python) unless $FAKE_VENV_FAIL,
# and has torch importable unless $FAKE_NO_TORCH.
FAKE = """#!/bin/sh
echo "$0 $*" >> "$FAKE_LOG"
case "$*" in
  *base_prefix*) [ -n "$FAKE_VENV_PREFIX" ] && echo "$FAKE_VENV_PREFIX"; exit 0 ;;
  "-m venv "*)
    if [ -n "$FAKE_VENV_FAIL" ]; then mkdir -p "$3/bin"; echo "ensurepip is not available" >&2; exit 1; fi
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0 ;;
  "-c import torch") [ -n "$FAKE_NO_TORCH" ] && exit 1; exit 0 ;;
esac
exit 0
"""


@pytest.fixture()
def repo(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("GNU make is not installed")
    d = tmp_path / "repo"
    d.mkdir()
    shutil.copy(ROOT / "Makefile", d / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", d / "pyproject.toml")
    fake = tmp_path / "python3"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    return d


def _make(repo: Path, *targets: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = repo.parent / "calls.log"
    log.write_text("")
    full = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    full.update({"FAKE_LOG": str(log), **env})
    p = subprocess.run(["make", "--no-print-directory", f"PYTHON={repo.parent / 'python3'}", *targets], cwd=repo,
                       env=full, capture_output=True, text=True, timeout=60)
    return p, [l for l in log.read_text().splitlines() if "base_prefix" not in l]


def _pip(calls: list[str]) -> list[str]:
    return [c for c in calls if " -m pip install" in c]


def test_no_active_venv_creates_the_project_venv_and_installs_once(repo):
    p, calls = _make(repo, "install")
    assert p.returncode == 0, p.stdout + p.stderr
    assert calls[0].endswith("python3 -m venv .venv"), calls
    pips = _pip(calls)
    assert len(pips) == 1 and pips[0].startswith(".venv/bin/python -m pip install"), calls
    assert '-e .[dev,hf,wandb,bench,eval,' in pips[0]
    stamp = repo / ".venv" / ".lioncub-install"
    assert str(repo) in stamp.read_text()

    # second call: nothing installed again
    p, calls = _make(repo, "install")
    assert p.returncode == 0 and _pip(calls) == [] and "already has this checkout installed" in p.stdout, calls

    # pyproject.toml changed: installed again (and FORCE=1 forces it)
    with open(repo / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency\n")
    _, calls = _make(repo, "install")
    assert len(_pip(calls)) == 1, calls
    _, calls = _make(repo, "install")
    assert _pip(calls) == [], calls
    _, calls = _make(repo, "install", "FORCE=1")
    assert len(_pip(calls)) == 1, calls

    # train and test run the venv's interpreter
    p, _ = _make(repo, "-n", "train", "test")
    assert ".venv/bin/python -m launch.torchrun --standalone --nproc_per_node=2 train.py configs/default.yaml" in p.stdout
    assert ".venv/bin/python -m pytest -q -n 2" in p.stdout, p.stdout


def test_an_active_venv_is_used_as_it_is(repo, tmp_path):
    env_dir = tmp_path / "myenv"
    (env_dir / "bin").mkdir(parents=True)
    shutil.copy(tmp_path / "python3", env_dir / "bin" / "python")
    p, calls = _make(repo, "install", VIRTUAL_ENV=str(env_dir))
    assert p.returncode == 0, p.stderr
    assert not (repo / ".venv").exists()
    assert [c.split(" -m pip")[0] for c in _pip(calls)] == [f"{env_dir}/bin/python"], calls
    assert (env_dir / ".lioncub-install").is_file()
    p, _ = _make(repo, "-n", "test", VIRTUAL_ENV=str(env_dir))
    assert f"{env_dir}/bin/python -m pytest" in p.stdout

    # PYTHON that already runs inside a virtual environment (activated or not): used, no .venv
    prefix = tmp_path / "pyvenv"
    prefix.mkdir()
    p, calls = _make(repo, "install", FAKE_VENV_PREFIX=str(prefix))
    assert p.returncode == 0 and not (repo / ".venv").exists(), p.stderr
    assert [c.split(" -m pip")[0] for c in _pip(calls)] == [str(tmp_path / "python3")], calls
    assert (prefix / ".lioncub-install").is_file()


def test_torch_is_pinned_to_the_cpu_build(repo):
    p, calls = _make(repo, "install", FAKE_NO_TORCH="1")
    assert p.returncode == 0, p.stderr
    torch = [c for c in _pip(calls) if "torch" in c.split("-e ")[0]]
    assert len(torch) == 1 and torch[0].endswith("--extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0"), calls
    assert "--no-deps" in torch[0]


def test_a_missing_venv_module_is_one_clear_line(repo):
    p, calls = _make(repo, "install", FAKE_VENV_FAIL="1")
    assert p.returncode != 0
    err = [l for l in p.stderr.splitlines() if l.startswith("make: '")]
    assert len(err) == 1 and "apt-get install python3-venv" in err[0] and "activate a virtual environment" in err[0], p.stderr
    assert not (repo / ".venv").exists() and _pip(calls) == []  # the half-made environment is removed
