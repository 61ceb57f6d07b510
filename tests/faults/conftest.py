"""One tiny trained run (checkpoints at steps 2 and 4) shared by the suite; each test gets a copy."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.faults.common import run1


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("faults") / "run"
    proc = run1(run, "train.max_steps=4", "train.ckpt_every=2", "train.eval_every=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture
def run_copy(trained_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, symlinks=True)
    return run
