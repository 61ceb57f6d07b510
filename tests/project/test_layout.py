"""tests/ is arranged by the package under test: no test file at the top, every folder of tests a
package (so two folders may hold files of the same name), and every worker that declares CHECKS
declares them as tests/checks.py can read them at collection."""
from __future__ import annotations

from pathlib import Path

from tests.checks import declared_checks
from tests.dist import WORKERS

TESTS = Path(__file__).resolve().parents[1]


def test_test_files_live_in_package_folders() -> None:
    top = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not top, f"test files at the top of tests/: {top}; put each in the folder of the package it tests"
    for f in TESTS.rglob("test_*.py"):
        assert (f.parent / "__init__.py").exists(), f"{f.parent} holds tests but no __init__.py"


def test_workers_declare_readable_checks() -> None:
    declaring = [w for w in sorted(WORKERS.glob("*.py")) if "\nCHECKS = (" in w.read_text()]
    assert len(declaring) >= 12, [w.name for w in declaring]
    for w in declaring:
        assert declared_checks(w.name), w.name
