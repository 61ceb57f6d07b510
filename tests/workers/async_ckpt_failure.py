"""A background checkpoint save that fails on one rank (launched by tests/trainer/test_checkpoint_layout.py):
the debug model trains in-process with train.async_ckpt=true, and rank FAIL_RANK's write of step
4's rank file raises "No space left on device". Usage: async_ckpt_failure.py OUT_DIR FAIL_RANK.
Writes OUT_DIR/result_<rank>.json: the error the run ended with (None if none)."""
from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.faults.common import TINY  # noqa: E402
from trainer import checkpoint  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def main(out: str, fail_rank: int) -> None:
    info = init_distributed("cpu")
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        *TINY, "train.max_steps=6", "train.eval_every=0", "train.ckpt_every=2", "train.keep_ckpts=5",
        "train.async_ckpt=true", f"train.out_dir={out}"])
    real = checkpoint._write

    def write(obj, path):
        if info.rank == fail_rank and path.parent.name == ".tmp_step_000004" and path.name.startswith("rank_"):
            raise checkpoint._disk_error(path, OSError(errno.ENOSPC, "No space left on device"))
        return real(obj, path)

    checkpoint._write = write
    trainer = Trainer(cfg, info)
    error = None
    try:
        trainer.fit()
    except checkpoint.CheckpointError as e:
        error = str(e)
    (Path(out) / f"result_{info.rank}.json").write_text(json.dumps({"error": error, "step": trainer.step}))
    shutdown()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main(sys.argv[1], int(sys.argv[2]))
    exit_cleanly()
