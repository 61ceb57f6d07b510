"""Run a worker script under `torchrun --standalone` (gloo, CPU) and fail loudly on error.

Multi-process tests keep their per-rank logic in tests/workers/*.py; a worker asserts and exits
non-zero on failure, and may write JSON results under an output directory the test reads back.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: str | os.PathLike, *args: str, timeout: float = 240,
             env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Launch `script` (a path, or a name under tests/workers) on `nproc` local ranks."""
    path = Path(script)
    if not path.is_absolute() and not path.exists():
        path = WORKERS / path
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "--master_port", str(free_port()), str(path), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                "TORCH_CPP_LOG_LEVEL": "ERROR", "WANDB_MODE": "disabled"}
    full_env.pop("RANK", None)
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun {path.name} x{nproc} failed (rc={proc.returncode})\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc
