"""A rank factory for the multi-process tests: import torch once, then fork a fresh rank per launch.

Every rank a test starts used to pay `import torch` and, at its first `torch.optim.Optimizer`,
`import torch._dynamo` (torch's optimizers are wrapped in `torch._disable_dynamo`, which imports
dynamo on first call): measured on the 2-core development machine, about 40 % of the CPU time of a
two-rank debug-model training test. tests/dist.py starts one of these processes per rank index
and per pytest worker; each launch is then a fork of an interpreter that has imported those two
modules and nothing of the project, and the rank runs its script as `python script.py args` would:
`__main__`, `sys.argv`, `sys.path[0]` = the script's directory, the request's environment and
working directory, its own stdout / stderr files, fresh `random` / numpy seeds, atexit handlers at
the end, exit status as Python's (an uncaught exception: 1; KeyboardInterrupt: killed by SIGINT).

What a fork cannot give: variables read when torch is imported (thread counts, CPU capability,
log levels) come from the zygote's environment, so tests/dist.py forks only when the request agrees
with it on those and otherwise starts a new zygote with the request's values (or a plain process while
ranks of the old one still run); and ranks forked from one zygote share its str hash seed, so each
rank index has its own zygote (ranks of one launch still differ in hash order, as separate
interpreters do, which is what exposes rank-divergent set iteration).

Protocol (one JSON object per line): the zygote writes {"ready": ...} once, then reads launch
requests {"id", "script", "args", "env", "cwd", "stdout", "stderr"} on stdin and answers
{"id", "pid"} for each, and {"exit": pid, "code": returncode} when a child ends. It leaves when
stdin closes.
"""
from __future__ import annotations

import json
import os
import select
import sys


def _write(obj: dict) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


def _child(req: dict) -> None:
    """Become the rank: never returns."""
    code = 1
    try:
        import atexit
        import runpy
        import signal
        import traceback

        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.dup2(f, fd)
            os.close(f)
        os.close(null)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        script = os.path.abspath(req["script"])
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(script), *extra, *BASE_PATH]
        sys.argv[:] = [req["script"], *req["args"]]
        import random
        random.seed()
        if "tempfile" in sys.modules:  # gettempdir() caches; the request's TMPDIR is the one to use
            sys.modules["tempfile"].tempdir = None
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException as e:  # setting the rank up failed: say so on whatever stderr is now
        os.write(2, f"tests/zygote.py: could not start the rank: {e!r}\n".encode())
    finally:
        os._exit(code)


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def main() -> None:
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    if _threads() != 1:  # a fork copies only this thread: refuse rather than fork a half-initialized pool
        _write({"ready": False, "why": f"{_threads()} threads after importing torch (is OMP_NUM_THREADS=1 set?)"})
        return
    _write({"ready": True})
    buf, live = b"", 0
    while True:
        ready, _, _ = select.select([0], [], [], 0.05 if live else 1.0)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(req)
                live += 1
                _write({"id": req["id"], "pid": pid})
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            live -= 1
            _write({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


# the interpreter's own path (site-packages, stdlib) without this script's directory or PYTHONPATH
BASE_PATH = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]

if __name__ == "__main__":
    main()
