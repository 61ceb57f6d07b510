"""Run a worker script on P local ranks (gloo, CPU) and fail loudly on error.

Multi-process tests keep their per-rank logic in tests/workers/*.py; a worker asserts and exits
non-zero on failure, and may write JSON results under an output directory the test reads back.

By default the ranks are started directly with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...; env:// rendezvous, rank 0 hosts the store): the same process group
as under `torchrun --standalone`, without the launcher process, whose own start (importing torch,
the c10d rendezvous) cost ~2 s of a 2-core machine per launch. As torchrun does, the other ranks
are stopped once one fails. Tests of torchrun's own behaviour pass launcher="torchrun".
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: str | os.PathLike, *args: str, timeout: float = 240,
             env: dict | None = None, check: bool = True, launcher: str = "direct") -> subprocess.CompletedProcess:
    """Launch `script` (a path, or a name under tests/workers) on `nproc` local ranks."""
    path = Path(script)
    if not path.is_absolute() and not path.exists():
        path = WORKERS / path
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                "TORCH_CPP_LOG_LEVEL": "ERROR", "WANDB_MODE": "disabled"}
    full_env.pop("RANK", None)
    full_env.update(env or {})
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "--master_port", str(free_port()), str(path), *map(str, args)]
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    elif launcher == "direct":
        proc = _direct(nproc, path, [str(a) for a in args], full_env, timeout)
    else:
        raise ValueError(f"launcher={launcher!r}: 'direct' or 'torchrun'")
    if check and proc.returncode != 0:
        raise AssertionError(f"{launcher} {path.name} x{nproc} failed (rc={proc.returncode})\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def _direct(nproc: int, path: Path, args: list[str], env: dict, timeout: float,
            grace: float = 5.0) -> subprocess.CompletedProcess:
    """nproc ranks of `path` with torchrun's environment variables; stdout / stderr of every rank
    (rank order) in the result; the first failing rank's exit code. When a rank fails, the others
    get `grace` seconds (a rank that found the error may still be printing it), then SIGTERM and,
    5 s later, SIGKILL."""
    cmd = [sys.executable, str(path), *args]
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="ranks_") as tmp:
        procs, files = [], []
        for r in range(nproc):
            out, err = open(Path(tmp) / f"{r}.out", "w+"), open(Path(tmp) / f"{r}.err", "w+")
            files.append((out, err))
            rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port}
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=rank_env, stdout=out, stderr=err, text=True))
        deadline, failed_at, code = time.monotonic() + timeout, None, 0
        try:
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                bad = [c for c in codes if c not in (None, 0)]
                if bad and failed_at is None:
                    failed_at, code = time.monotonic(), bad[0]
                if failed_at is not None and time.monotonic() > failed_at + grace:
                    _stop([p for p in procs if p.poll() is None])
                    break
                if time.monotonic() > deadline:
                    _stop(procs)
                    raise subprocess.TimeoutExpired(cmd, timeout, output=_read(files, 0), stderr=_read(files, 1))
                time.sleep(0.05)
            if not code:
                code = next((p.returncode for p in procs if p.returncode), 0)
            return subprocess.CompletedProcess(cmd, code, _read(files, 0), _read(files, 1))
        finally:
            _stop([p for p in procs if p.poll() is None])
            for out, err in files:
                out.close()
                err.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    end = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _read(files: list[tuple], which: int) -> str:
    text = []
    for pair in files:
        f = pair[which]
        f.flush()
        f.seek(0)
        text.append(f.read())
    return "".join(text)
