"""Multi-process tests of update-sync distributed Lion / Lion Cub (torchrun, gloo, tiny model).

One launch per world size runs tests/workers/optim_dist.py, one item per check: all comm modes keep
ranks bit-identical and the loss falling, world size 1 equals plain Lion, momentum sync,
diagnostics on constructed gradients, masking of never-seen rows, per-rank state round trip.
"""
import pytest

from tests.checks import Worker

OPTIM_DIST = Worker("optim_dist.py", timeout=300)


@pytest.mark.parametrize("nproc,check", OPTIM_DIST.cases([1, 2, 3, 4]))
def test_update_sync_lion_all_modes(nproc, check):
    OPTIM_DIST.check(nproc, check)
