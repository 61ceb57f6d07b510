"""Multi-process tests of update-sync distributed Lion / Lion Cub (torchrun, gloo, tiny model).

One launch per world size runs every check of tests/workers/optim_dist.py: all comm modes keep
ranks bit-identical and the loss falling, world size 1 equals plain Lion, momentum sync,
diagnostics on constructed gradients, masking of never-seen rows, per-rank state round trip.
"""
import pytest

from tests.dist import torchrun


@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_update_sync_lion_all_modes(nproc):
    proc = torchrun(nproc, "optim_dist.py", timeout=300)
    assert proc.stdout.count(f"P={nproc} ") >= 13, proc.stdout[-3000:]
