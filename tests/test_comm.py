"""comm/ collectives under torchrun (gloo) at P = 1, 2, 3, 4: one launch per world size runs
every check in tests/workers/comm_collectives.py (references from all_gather of raw inputs,
identical results on every rank, lane-overflow rule, CommStats byte formulas)."""
from __future__ import annotations

import pytest

from tests.dist import torchrun


@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_comm_collectives(nproc: int) -> None:
    proc = torchrun(nproc, "comm_collectives.py", timeout=180)
    assert f"comm_collectives P={nproc}:" in proc.stdout and "checks passed" in proc.stdout, proc.stdout
