import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the tests run comm's value checks that cost a host sync (off by default on the hot path), and
# the eager kernels unless a test asks for compiled ones (compiling per test process would cost
# minutes; tests/optim/test_kernels.py and the compiled end-to-end test exercise them)
os.environ.setdefault("LIONCUB_DEBUG", "1")
os.environ.setdefault("LIONCUB_KERNELS", "eager")


def pytest_collection_modifyitems(session, config, items):
    """Files with slow (multi-process, end-to-end) tests first, each file's tests in their order: with
    `make test`'s two workers taking whole files in this order (--dist loadfile), the long files start
    early and the short ones fill the end, instead of one worker finishing a long file alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    order = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (item.path not in slow_files, order[item]))
