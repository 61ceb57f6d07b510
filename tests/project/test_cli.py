"""Every command-line entry point answers `--help`: argparse %-formats help strings, so a '%' in a
description (a setting's "79 % matrices") turned `python -m bench.reproduce --help` into a TypeError."""
from __future__ import annotations

import contextlib
import io
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"tests", ".cache", "build", "bench/out", "data/prose", "wandb", "runs"}


def entry_points() -> list[str]:
    """Dotted names of the project's modules that parse a command line when run as __main__."""
    out = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT)
        if any(str(rel).startswith(d + "/") or rel.parts[0].startswith(".") for d in SKIP_DIRS):
            continue
        text = f.read_text()
        if 'if __name__ == "__main__"' in text:
            mod = ".".join(rel.with_suffix("").parts)
            out.append(mod[: -len(".__main__")] if mod.endswith(".__main__") else mod)
    return out


def test_the_project_has_entry_points() -> None:
    found = entry_points()
    assert {"train", "bench.reproduce", "data.prepare", "bench.packing"} <= set(found), found


@pytest.mark.parametrize("module", entry_points())
def test_help_exits_zero(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    source = (ROOT / Path(*module.split("."))).with_suffix(".py")
    if source.exists() and "os._exit(" in source.read_text():  # leaves without returning: its own process
        r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        code, out = r.returncode, r.stdout + r.stderr
    else:  # in-process: torch is imported once for all of them
        monkeypatch.setattr(sys, "argv", [module, "--help"])
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as e:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code, out = e.value.code or 0, buf.getvalue()
    assert code == 0, f"python -m {module} --help exited {code}: {out[-1500:]}"
    assert "usage" in out.lower() or f"python {module}.py" in out, out[:500]


def test_the_lab_s_path_options_are_relative_to_where_the_command_runs(tmp_path, monkeypatch):
    """The lab's commands launch their training runs from the repository root: a relative --out (or --runs,
    --breakdown, --e2e, --work) is made absolute against the directory the command runs in, so the runs they
    launch land where they then read them (bench.quality wrote its runs inside the repository and reported
    them as failed when run from elsewhere)."""
    from bench import comm, step_breakdown, time_to_loss
    from bench.reproduce.__main__ import parser

    monkeypatch.chdir(tmp_path)
    ns = time_to_loss.parse_args(["--variants", "adamw_fp32", "--link", "1gbit", "--out", "o", "--runs", "r",
                                  "--breakdown", "b", "--e2e", "e"])
    assert (ns.out, ns.runs, ns.breakdown, ns.e2e) == tuple(str(tmp_path / x) for x in "orbe")
    assert time_to_loss.parse_args(["--variants", "adamw_fp32", "--link", "1gbit"]).runs == ""   # unset stays unset
    assert step_breakdown.parse_args(["--out", "o"]).out == str(tmp_path / "o")
    assert comm.parse_args(["--out", "o"]).out == str(tmp_path / "o")
    assert step_breakdown.parse_args([]).out == str(tmp_path / "bench/out/step_breakdown")
    a = parser().parse_args(["diloco", "--out", "o", "--work", "w"])
    assert (a.out, a.work) == (tmp_path / "o", tmp_path / "w")
