"""train.py's main on every rank, with rank FAIL_RANK's data loader raising a DataError at its
FAIL_AT-th batch, as a bad shard found mid-run would (launched by tests/faults/test_errors.py).
Usage: rank_fails.py FAIL_RANK FAIL_AT TRAIN_ARGS..."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from data import DataError  # noqa: E402
from data.loader import ShardLoader  # noqa: E402


def main(fail_rank: int, fail_at: int, argv: list[str]) -> int:
    real, calls = ShardLoader.next_batch, {"n": 0}

    def next_batch(self):
        calls["n"] += 1
        if int(os.environ["RANK"]) == fail_rank and calls["n"] == fail_at:
            raise DataError("shard train_000000.bin: token id 99999 at position 7 is past the vocabulary (injected)")
        return real(self)

    ShardLoader.next_batch = next_batch
    return train.main(argv)


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    exit_cleanly(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
