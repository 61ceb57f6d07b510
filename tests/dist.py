"""Run a worker script on P local ranks (gloo, CPU) and fail loudly on error.

Multi-process tests keep their per-rank logic in tests/workers/*.py; a worker asserts and exits
non-zero on failure, and may write JSON results under an output directory the test reads back.

By default the ranks are started directly with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...; env:// rendezvous, rank 0 hosts the store): the same process group
as under `torchrun --standalone`, without the launcher process, whose own start (importing torch,
the c10d rendezvous) cost ~2 s of a 2-core machine per launch. As torchrun does, the other ranks
are stopped once one fails. Tests of torchrun's own behaviour pass launcher="torchrun".

Each rank is forked from a zygote (tests/zygote.py: one Python process per rank index that has
imported torch and torch._dynamo) instead of starting a new interpreter, which saves those imports
in every rank of every launch. The zygotes hold the launches' ordinary environment (the test process's
with the variables `torchrun` sets): a launch whose `env` argument changes a variable read when torch
is imported (`FORK_SENSITIVE`) gets plain processes and leaves the zygotes for the ordinary launches
around it (a zygote costs more to start than such a launch's ranks); when the ordinary environment
itself changes in such a variable (a test sets it in os.environ), the zygote is replaced by one
started with the new values (or, while ranks of the old one still run, the rank is started as a plain
process). Every rank is a plain process when LIONCUB_TEST_FORK=0 (tests/harness/test_dist_launcher.py
checks the two agree).
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
ZYGOTE = Path(__file__).resolve().parent / "zygote.py"
# environment variables that take effect when torch (or the interpreter) starts: a forked rank inherits
# the zygote's values, so a launch that sets them differently gets a zygote started with its values
FORK_SENSITIVE = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_", "ATEN_", "TORCH", "PYTORCH", "CUDA", "PYTHON",
                  "LD_", "MALLOC", "TMP", "TEMP")


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
    ordinary = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                "TORCH_CPP_LOG_LEVEL": "ERROR", "WANDB_MODE": "disabled"}
    ordinary.pop("RANK", None)
    full_env = {**ordinary, **(env or {})}
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "--master_port", str(free_port()), str(path), *map(str, args)]
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    elif launcher == "direct":
        proc = _direct(nproc, path, [str(a) for a in args], full_env, timeout,
                       fork=_sensitive(full_env) == _sensitive(ordinary))
    else:
        raise ValueError(f"launcher={launcher!r}: 'direct' or 'torchrun'")
    if check and proc.returncode != 0:
        raise AssertionError(f"{launcher} {path.name} x{nproc} failed (rc={proc.returncode})\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def _direct(nproc: int, path: Path, args: list[str], env: dict, timeout: float,
            grace: float = 5.0, fork: bool = True) -> subprocess.CompletedProcess:
    """nproc ranks of `path` with torchrun's environment variables; stdout / stderr of every rank
    (rank order) in the result; the first failing rank's exit code. When a rank fails, the others
    get `grace` seconds (a rank that found the error may still be printing it), then SIGTERM and,
    5 s later, SIGKILL. fork=False: plain processes, whatever the zygotes hold."""
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
            procs.append(_start(r, path, args, rank_env, out, err, fork))
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


def _start(rank: int, path: Path, args: list[str], env: dict, out, err, fork: bool = True):
    """Rank `rank` of a launch: forked from its zygote when `fork` and one agrees with `env`, else a new
    process."""
    zygote = _zygote(rank, env) if fork else None
    if zygote is not None:
        return zygote.spawn(path, args, env, out.name, err.name)
    return subprocess.Popen([sys.executable, str(path), *args], cwd=ROOT, env=env, stdout=out, stderr=err, text=True)


# set by torch.compile in the pytest process itself and read only when compiling
FORK_INSENSITIVE = ("TORCHINDUCTOR_CACHE_DIR",)


def _sensitive(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(FORK_SENSITIVE) and k not in FORK_INSENSITIVE}


_ZYGOTES: dict[int, "_Zygote | None"] = {}  # per rank index; None: it could not start, use plain processes


def _zygote(rank: int, env: dict) -> "_Zygote | None":
    if os.environ.get("LIONCUB_TEST_FORK", "1") == "0" or not hasattr(os, "fork"):
        return None
    z = _ZYGOTES.get(rank)
    if rank in _ZYGOTES and z is None:
        return None
    if z is not None and _sensitive(env) != _sensitive(z.env):
        # the launches' environment changed (a test set a variable torch reads at import): a new zygote for
        # the new values, unless ranks of the old one still run (their exit codes come through it)
        if z.outstanding():
            return None
        z.close()
        z = None
    if z is None or not z.alive():
        z = _ZYGOTES[rank] = _Zygote.start(env)
    return z


class _Zygote:
    """The client side of tests/zygote.py: launch requests out, pids and exit codes back."""

    def __init__(self, proc: subprocess.Popen, env: dict):
        self.proc, self.env = proc, env
        self.ids = itertools.count()
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self.started = self.reported = 0
        self.cv = threading.Condition()
        self.ready: bool | None = None
        threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def start(cls, env: dict) -> "_Zygote | None":
        base = {k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                           "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")}
        proc = subprocess.Popen([sys.executable, str(ZYGOTE)], cwd=ROOT, env=base, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        z = cls(proc, base)
        with z.cv:
            z.cv.wait_for(lambda: z.ready is not None, timeout=300)
        if not z.ready:  # it could not start, or refused (it says why on its first line): plain processes instead
            proc.kill()
            return None
        return z

    def alive(self) -> bool:
        return self.proc.poll() is None

    def outstanding(self) -> bool:
        """Whether a rank it forked has not reported its exit yet (or an exit is not yet collected)."""
        with self.cv:
            return self.started != self.reported

    def close(self) -> None:
        self.proc.stdin.close()  # the zygote leaves at end of input
        self.proc.wait(timeout=30)

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cv:
                if "ready" in msg:
                    self.ready = msg["ready"]
                elif "pid" in msg:
                    self.pids[msg["id"]] = msg["pid"]
                    self.started += 1
                else:
                    self.codes[msg["exit"]] = msg["code"]
                    self.reported += 1
                self.cv.notify_all()
        with self.cv:
            if self.ready is None:
                self.ready = False
            self.cv.notify_all()

    def spawn(self, path: Path, args: list[str], env: dict, stdout: str, stderr: str) -> "_ForkedRank":
        rid = next(self.ids)
        req = {"id": rid, "script": str(path), "args": args, "env": env, "cwd": str(ROOT), "stdout": stdout,
               "stderr": stderr}
        with self.cv:  # one request at a time on the pipe (tests may launch from several threads)
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            if not self.cv.wait_for(lambda: rid in self.pids or not self.alive(), timeout=60) or rid not in self.pids:
                raise RuntimeError("the test zygote (tests/zygote.py) did not start a rank; LIONCUB_TEST_FORK=0 "
                                   "starts plain processes")
            return _ForkedRank(self, self.pids.pop(rid))


class _ForkedRank:
    """The part of subprocess.Popen's interface `_direct` and `_stop` use, for a rank the zygote forked."""

    def __init__(self, zygote: _Zygote, pid: int):
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            with self.zygote.cv:
                self.returncode = self.zygote.codes.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        z = self.zygote
        with z.cv:
            if not z.cv.wait_for(lambda: self.pid in z.codes or self.returncode is not None or not z.alive(),
                                 timeout=timeout):
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
        if self.poll() is None:  # the zygote died: nobody can report this rank's exit any more
            raise RuntimeError(f"the test zygote died; rank pid {self.pid}'s exit status is lost")
        return self.returncode

    def _signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped, so the pid is still this rank's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
