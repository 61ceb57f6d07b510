"""What code and which libraries made a run: the git commit (and whether the checkout had changes),
the package version, python / torch / CUDA / NCCL / numpy versions, the host and the command line.

`collect()` reads them once per process (two short git calls); the run log's first line shows
them (`console_line`) and every start of a run adds them to `<out_dir>/provenance.json`
(`record`): {"starts": [{...}, ...]}, one entry per start, so a resumed run shows each piece of
code that wrote it.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lioncub-train"
FILE = "provenance.json"


def _git(*args: str) -> str | None:
    try:
        p = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def git_state() -> dict:
    """{"commit": sha or None, "dirty": bool or None, "changed_files": n}: None where this is no git
    checkout (an installed copy) or git is missing. Dirty counts changes to tracked files only."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "changed_files": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    changed = len(status.splitlines()) if status else 0
    return {"commit": commit, "dirty": bool(changed) if status is not None else None, "changed_files": changed}


def package_version() -> str:
    """The installed lioncub-train version, else the one pyproject.toml of this checkout names."""
    from importlib import metadata

    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        m = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M) \
            if (ROOT / "pyproject.toml").is_file() else None
        return m.group(1) + " (not installed)" if m else "unknown"


@functools.lru_cache(maxsize=1)
def collect() -> dict:
    import numpy
    import torch

    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (RuntimeError, AttributeError):
            nccl = None
    return {
        **git_state(), "package": PACKAGE, "version": package_version(),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": nccl, "numpy": numpy.__version__, "host": platform.node(), "machine": platform.machine(),
        "argv": list(sys.argv), "pid": os.getpid(),
    }


def console_line(p: dict) -> str:
    """`code lioncub-train 0.1.0 git 1a2b3c4d5e6f (+3 changed files) | torch 2.13.0 CUDA 12.8 NCCL 2.27.3 | host`."""
    if p["commit"] is None:
        git = "git unknown (not a git checkout)"
    else:
        git = f"git {p['commit'][:12]}" + (f" (dirty: {p['changed_files']} changed file(s))" if p["dirty"] else
                                            " (clean)" if p["dirty"] is False else "")
    return (f"code {p['package']} {p['version']} {git} | python {p['python']} torch {p['torch']} "
            f"CUDA {p['cuda'] or '-'} NCCL {p['nccl'] or '-'} numpy {p['numpy']} | host {p['host']}")


def record(out_dir: Path, p: dict | None = None, step: int = 0) -> Path:
    """Append this start's provenance to out_dir/provenance.json (written whole, atomically)."""
    path = Path(out_dir) / FILE
    try:
        starts = json.loads(path.read_text())["starts"]
        if not isinstance(starts, list):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        starts = []  # first start, or a torn file from a killed writer: begin again
    starts.append({**(p or collect()), "step": step, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    tmp = path.with_name(FILE + ".tmp")
    tmp.write_text(json.dumps({"starts": starts}, indent=1) + "\n")
    os.replace(tmp, path)
    return path
