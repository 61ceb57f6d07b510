"""tests/checks.py's harness: a worker's named checks reach pytest one by one, a failure under its
own name and message, a check the worker never reached as a failure that says why."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.checks import EXIT, Worker, _prune, declared_checks
from tests.dist import ROOT


def _fails(worker: Worker, nproc: int, name: str) -> str:
    with pytest.raises(AssertionError) as e:
        worker.check(nproc, name)
    return str(e.value)


def test_a_failing_check_fails_its_own_item_on_several_ranks() -> None:
    w = Worker("checks_probe.py", "second", "fail", "1")
    assert [p.id for p in w.cases([2])] == ["P2-first", "P2-second", "P2-third", "P2-exit"]
    w.check(2, "first")
    msg = _fails(w, 2, "second")
    assert "check second failed" in msg and "rank 1: AssertionError: deliberate failure of second" in msg
    assert "rank 0" not in msg.split("failed", 1)[1]
    assert "checks_probe.py:" in msg  # where it was raised
    # rank 1 stopped at its failure: the next check is a failure that names the one before, not a skip
    msg = _fails(w, 2, "third")
    assert "never recorded by rank(s) [1]" in msg and "after the failure of second (rank 1)" in msg
    assert "exit code 1" in _fails(w, 2, EXIT)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_failing_step_of_a_sequence_fails_its_item_and_stops_the_rest(nproc: int) -> None:
    w = Worker("checks_probe.py", "second", "fail", env={"CHECKS_PROBE": "sequence"})
    w.check(nproc, "first")
    assert "deliberate failure of second" in _fails(w, nproc, "second")
    assert "after the failure of second (rank 0)" in _fails(w, nproc, "third")
    _fails(w, nproc, EXIT)


def test_one_rank_goes_on_after_a_failure() -> None:
    w = Worker("checks_probe.py", "first", "fail")
    assert "deliberate failure of first" in _fails(w, 1, "first")
    w.check(1, "second")
    w.check(1, "third")
    w.check(1, EXIT)


def test_a_crash_fails_every_check_it_cut_off_with_the_output() -> None:
    w = Worker("checks_probe.py", "second", "crash")
    w.check(2, "first")
    for name in ("second", "third"):
        msg = _fails(w, 2, name)
        assert "never recorded by rank(s) [0, 1]: it ended (crashed or timed out) before it; exit code 3" in msg and "--- stderr ---" in msg
    assert "exit code 3" in _fails(w, 2, EXIT)


def test_all_passing_passes_every_item_and_the_worker_runs_once() -> None:
    w = Worker("checks_probe.py", "-", "fail")
    for name in (*declared_checks("checks_probe.py"), EXIT):
        w.check(2, name)
    first = w.run(2)
    w.check(2, "first")
    assert w.run(2) is first


def test_when_and_undeclared_names() -> None:
    w = Worker("checks_probe.py", "-", "fail", when={"third": lambda P: P > 1})
    assert [p.id for p in w.cases([1])] == ["P1-first", "P1-second", "P1-exit"]
    # the worker ran `third` at P=1 although it does not apply there: `exit` says so
    assert "differ from ['first', 'second']" in _fails(w, 1, EXIT)
    with pytest.raises(ValueError, match="does not declare"):
        Worker("checks_probe.py", when={"fourth": lambda P: True})
    with pytest.raises(ValueError, match="no check 'third' at P=1"):
        w.check(1, "third")


def test_pytest_reports_each_check_under_its_own_item(tmp_path) -> None:
    """The items a test file declares through Worker.cases pass and fail one by one in pytest's own report."""
    (tmp_path / "test_probe.py").write_text(textwrap.dedent("""
        import pytest
        from tests.checks import Worker

        PROBE = Worker("checks_probe.py", "second", "fail", "1")

        @pytest.mark.parametrize("nproc,check", PROBE.cases([2]))
        def test_probe(nproc, check):
            PROBE.check(nproc, check)
    """))
    # plain processes: the probe imports no torch, so a zygote would cost more than it saves
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_probe.py"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), "LIONCUB_TEST_FORK": "0", "COLUMNS": "400"},
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 1 and "3 failed, 1 passed" in out, out[-3000:]
    assert "PASSED test_probe.py::test_probe[P2-first]" in out, out[-3000:]
    assert "FAILED test_probe.py::test_probe[P2-second] - AssertionError: checks_probe.py P=2: check second failed" \
        in out, out[-3000:]
    assert "rank 1: AssertionError: deliberate failure of second" in out
    assert "FAILED test_probe.py::test_probe[P2-third] - AssertionError: checks_probe.py P=2: check third was never " \
        "recorded by rank(s) [1]" in out, out[-3000:]
    assert "FAILED test_probe.py::test_probe[P2-exit]" in out


def test_a_workers_folder_keeps_only_the_paths_tests_read(tmp_path) -> None:
    for name in ("runs/straight/ckpt/step_000004/model.pt", "runs/straight_params.pt", "runs/resumed/ckpt/x.pt",
                 "runs/other.pt", "rank0.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    _prune(tmp_path, (Path("runs/straight"), Path("runs/straight_params.pt")))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "runs", "runs/straight", "runs/straight/ckpt", "runs/straight/ckpt/step_000004",
        "runs/straight/ckpt/step_000004/model.pt", "runs/straight_params.pt"]
    _prune(tmp_path, ())
    assert not tmp_path.exists()
