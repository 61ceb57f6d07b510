"""tests/checks.py's harness: a worker's named checks reach pytest one by one, a failure under its
own name and message, a check the worker never reached as a failure that says why."""
from __future__ import annotations

import pytest

from tests.checks import EXIT, Worker, declared_checks


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
        assert "never recorded by rank(s) [0, 1]: it crashed before it; exit code 3" in msg and "--- stderr ---" in msg
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
