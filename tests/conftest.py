import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the tests run comm's value checks that cost a host sync (off by default on the hot path), and
# the eager kernels unless a test asks for compiled ones (compiling per test process would cost
# minutes; tests/comm/test_kernels.py and the compiled end-to-end test exercise them)
os.environ.setdefault("LIONCUB_DEBUG", "1")
os.environ.setdefault("LIONCUB_KERNELS", "eager")


@pytest.fixture(scope="session")
def native_cache(tmp_path_factory):
    """A cache directory of comm.native's module shared by the tests that need one of their own
    (tests/optim/test_native.py, tests/faults/test_native_cache.py): built cold at most once per
    test process; a test that damages or removes the module leaves it rebuilt."""
    return tmp_path_factory.mktemp("native_cache")
