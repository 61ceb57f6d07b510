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
