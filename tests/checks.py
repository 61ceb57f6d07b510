"""Each named check of a multi-process worker as a pytest item of its own (the pytest side of
tests/workers/_checks.py).

    COLLECTIVES = Worker("comm_collectives.py", timeout=180)

    @pytest.mark.parametrize("nproc,check", COLLECTIVES.cases([1, 2, 3, 4]))
    def test_comm_collectives(nproc, check):
        COLLECTIVES.check(nproc, check)

`cases` reads the worker's literal `CHECKS` tuple from its source (no import: a worker starts a
process group when imported) and gives one case per (world size, check), plus `exit` per world
size. The first item of a world size launches the worker once (tests/dist.py's torchrun) and keeps
the ranks' records; every item of that world size reads them. An item fails with its check's own
message and place when any rank recorded the check as failed, and with the worker's exit code and
output tail when no rank recorded a failure but a rank never recorded the check (the worker crashed
or stopped before it). `exit` fails unless every rank exited 0 having run exactly the checks that
apply at that world size. `when={"name": predicate(P)}` declares the checks that apply only at some
world sizes; the worker must skip the same ones (the `exit` item checks it).
"""
from __future__ import annotations

import ast
import atexit
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from tests.dist import WORKERS, torchrun

EXIT = "exit"


def declared_checks(script: str | Path) -> tuple[str, ...]:
    """The literal `CHECKS = (...)` of a worker's source."""
    path = Path(script) if Path(script).is_absolute() else WORKERS / script
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CHECKS" for t in node.targets):
            names = ast.literal_eval(node.value)
            if not names or not all(isinstance(n, str) and n.isidentifier() for n in names) or EXIT in names:
                raise ValueError(f"{path.name}: CHECKS must be a non-empty tuple of identifiers other than {EXIT!r}")
            return tuple(names)
    raise ValueError(f"{path.name} declares no literal CHECKS tuple (tests/workers/_checks.py)")


def _prune(root: Path, keep: tuple[Path, ...], d: Path | None = None) -> None:
    """Remove everything under `root` but the `keep` paths (relative to it) and the folders above them
    (all of `root` when nothing is kept)."""
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
        return
    for p in list((d or root).iterdir()):
        rel = p.relative_to(root)
        if rel in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            if any(rel in k.parents for k in keep):
                _prune(root, keep, p)
            else:
                shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


class Worker:
    def __init__(self, script: str | Path, *args: str, timeout: float = 240, env: dict | None = None,
                 when: dict[str, Callable[[int], bool]] | None = None, keep: tuple[str, ...] = ()):
        """`keep`: paths under the worker's folder "{tmp}" that tests read after the run (run()["tmp"]);
        everything else there is removed once the records are read."""
        self.script, self.args, self.timeout, self.env = script, args, timeout, env or {}
        self.keep = tuple(Path(k) for k in keep)
        self.names = declared_checks(script)
        self.when = when or {}
        unknown = set(self.when) - set(self.names)
        if unknown:
            raise ValueError(f"when= names checks the worker does not declare: {sorted(unknown)}")
        self._runs: dict[int, dict] = {}

    def applies(self, name: str, nproc: int) -> bool:
        return name not in self.when or self.when[name](nproc)

    def cases(self, nprocs: list[int]) -> list:
        import pytest
        return [pytest.param(n, c, id=f"P{n}-{c}") for n in nprocs
                for c in (*[c for c in self.names if self.applies(c, n)], EXIT)]

    def run(self, nproc: int) -> dict:
        """The worker's launch at `nproc` ranks (launched on first use): its CompletedProcess, each
        rank's records by check name, and `tmp`, the folder "{tmp}" in the arguments named, which holds
        only the `keep` paths once the records are read."""
        if nproc not in self._runs:
            tmp = Path(tempfile.mkdtemp(prefix=f"checks_{Path(self.script).stem}_{nproc}_"))
            atexit.register(shutil.rmtree, tmp, True)   # a run cut off before the end below
            args = [a.replace("{tmp}", str(tmp)) for a in self.args]
            try:
                proc = torchrun(nproc, self.script, *args, timeout=self.timeout, check=False,
                                env={**self.env, "LIONCUB_CHECKS_DIR": str(tmp)})
            except subprocess.TimeoutExpired as e:
                proc = subprocess.CompletedProcess(e.cmd, f"timeout after {self.timeout:.0f} s",
                                                   e.output or "", e.stderr or "")
            ranks = {}
            for r in range(nproc):
                f = tmp / f"rank{r}.json"
                ranks[r] = {c["name"]: c for c in json.loads(f.read_text())["checks"]} if f.exists() else {}
            # the records are read: the workers' checkpoints and files go now, not at the test process's
            # exit (a 4-rank checkpoint worker leaves hundreds of MB; CI disks can be short)
            _prune(tmp, self.keep)
            self._runs[nproc] = {"proc": proc, "ranks": ranks, "tmp": tmp}
        return self._runs[nproc]

    def _tail(self, proc: subprocess.CompletedProcess) -> str:
        return f"--- stdout ---\n{(proc.stdout or '')[-3000:]}\n--- stderr ---\n{(proc.stderr or '')[-5000:]}"

    def check(self, nproc: int, name: str) -> None:
        """Fail with the check's own message (or the reason it has none) unless every rank passed it."""
        if name != EXIT and not (name in self.names and self.applies(name, nproc)):
            raise ValueError(f"{self.script} has no check {name!r} at P={nproc} (CHECKS: {self.names})")
        run = self.run(nproc)
        proc, ranks = run["proc"], run["ranks"]
        who = f"{Path(self.script).name} P={nproc}"
        if name == EXIT:
            expected = [c for c in self.names if self.applies(c, nproc)]
            wrong = {r: sorted(rec) for r, rec in ranks.items() if sorted(rec) != sorted(expected)}
            assert proc.returncode == 0 and not wrong, (
                f"{who}: exit code {proc.returncode}; ranks whose recorded checks differ from {expected}: "
                f"{wrong}\n{self._tail(proc)}")
            return
        failed = {r: rec[name] for r, rec in ranks.items() if name in rec and not rec[name]["passed"]}
        if failed:
            lines = [f"rank {r}: {c['message']}\n    at {c.get('where', '?')}" for r, c in failed.items()]
            raise AssertionError(f"{who}: check {name} failed\n" + "\n".join(lines))
        missing = [r for r, rec in ranks.items() if name not in rec]
        if missing:
            before = sorted({f"{c} (rank {r})" for r, rec in ranks.items() for c, e in rec.items() if not e["passed"]})
            why = f"it stopped after the failure of {', '.join(before)}" if before else "it ended (crashed or timed out) before it"
            raise AssertionError(f"{who}: check {name} was never recorded by rank(s) {missing}: {why}; "
                                 f"exit code {proc.returncode}\n{self._tail(proc)}")
