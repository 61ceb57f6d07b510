"""Named checks of a multi-process worker, each recorded on its own (the rank side of tests/checks.py).

A worker declares its check names in a literal tuple `CHECKS` (tests/checks.py reads it from the
source at collection time, so each name is a pytest item of its own) and runs each one inside
`with checks("name"):` (or `checks.run("name", fn, *args)`; a worker whose checks are steps of one
sequence marks where each starts with `checks.begin("name")` inside `checks.guard(main)`). Every rank writes what it saw to `$LIONCUB_CHECKS_DIR/rank<r>.json` after
each check (replaced atomically, so a crash leaves the checks before it on record): name, passed,
the failure's message and where it was raised, seconds.

A failing check is recorded and, on more than one rank, the rank then leaves with exit code 1: the
other ranks may be inside a collective the failed rank will never join, so going on could hang or
pair the wrong collectives; the launcher stops them. On one rank the next check runs. Without
LIONCUB_CHECKS_DIR (a worker run by hand) results go to stderr only and a failure raises as before.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


class Checks:
    def __init__(self, names: tuple[str, ...]):
        self.names = tuple(names)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"CHECKS repeats a name: {self.names}")
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.out = os.environ.get("LIONCUB_CHECKS_DIR")
        self.results: list[dict] = []
        self._open: _Check | None = None

    def __call__(self, name: str) -> "_Check":
        if name not in self.names:
            raise ValueError(f"check {name!r} is not declared in the worker's CHECKS {self.names}")
        if any(r["name"] == name for r in self.results):
            raise ValueError(f"check {name!r} ran twice")
        return _Check(self, name)

    def run(self, name: str, fn, *args):
        """`fn(*args)` as check `name`; rank 0 prints its time. Returns what `fn` returns (None when it failed)."""
        t, out = time.time(), None
        with self(name):
            out = fn(*args)
        if self.rank == 0:
            print(f"{name}: {time.time() - t:.1f}s", flush=True)
        return out

    def begin(self, name: str) -> None:
        """Check `name` starts here; the one begun before it passed."""
        self.end()
        self._open = self(name)
        self._open.__enter__()

    def end(self) -> None:
        """The check begun last passed."""
        if self._open is not None:
            self._open, check = None, self._open
            check.__exit__(None, None, None)

    def guard(self, fn, *args) -> None:
        """`fn(*args)`, whose exception fails the check begun last (one raised before any check is
        begun propagates: the worker crashes loudly)."""
        try:
            fn(*args)
        except Exception as e:
            if self._open is None:
                raise
            self._open, check = None, self._open
            if not check.__exit__(type(e), e, e.__traceback__):
                raise
            return
        self.end()

    def _record(self, entry: dict) -> None:
        self.results.append(entry)
        if self.out is None:
            status = "ok" if entry["passed"] else f"FAILED: {entry['message']}"
            print(f"[rank {self.rank}/{self.world}] {entry['name']}: {status}", file=sys.stderr, flush=True)
            return
        path = os.path.join(self.out, f"rank{self.rank}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": self.rank, "world": self.world, "checks": self.results}, f)
        os.replace(tmp, path)


class _Check:
    def __init__(self, owner: Checks, name: str):
        self.owner, self.name = owner, name

    def __enter__(self) -> None:
        self.t0 = time.time()

    def __exit__(self, kind, exc, tb) -> bool:
        entry = {"name": self.name, "passed": exc is None, "seconds": round(time.time() - self.t0, 3)}
        if exc is not None:
            frame = traceback.extract_tb(tb)[-1]
            entry["message"] = f"{kind.__name__}: {exc}" if str(exc) else kind.__name__
            entry["where"] = f"{os.path.basename(frame.filename)}:{frame.lineno}: {frame.line}"
        self.owner._record(entry)
        if exc is None or not isinstance(exc, Exception) or self.owner.out is None:
            return False
        traceback.print_exception(kind, exc, tb)
        if self.owner.world > 1:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return True  # one rank: recorded, the next check runs
