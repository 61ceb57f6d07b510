"""A rollback while a background save is in flight (launched by tests/trainer/test_checkpoint_layout.py):
the debug model trains in-process on 2 ranks with train.async_ckpt=true; every checkpoint file is
written slowly (SLOW_S per file), and rank 1's loss is NaN at step 5, right after step 4's save
began, with train.on_nonfinite=rollback. The rollback must wait for step 4's save and use it.
Usage: async_ckpt_rollback.py OUT_DIR. Rank 0 writes OUT_DIR/result.json."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.faults.common import fit_until_divergence  # noqa: E402
from trainer import checkpoint  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

SLOW_S = 1.5


def main(out: str) -> None:
    info = init_distributed("cpu")
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.max_steps=6", "train.log_every=1",
        "train.eval_every=0", "train.eval_steps=1", "train.ckpt_every=2", "train.keep_ckpts=5",
        "train.async_ckpt=true", "train.on_nonfinite=rollback", f"train.out_dir={out}", "optim.warmup_steps=0",
        "log.wandb=disabled"])
    real = checkpoint._write

    def slow_write(obj, path):
        time.sleep(SLOW_S)
        return real(obj, path)

    checkpoint._write = slow_write
    trainer = Trainer(cfg, info)
    forward, calls = trainer.forward, {"n": 0}

    def poisoned(x, y):
        logits, loss = forward(x, y)
        calls["n"] += 1
        return logits, (loss * float("nan") if info.rank == 1 and calls["n"] == 5 else loss)

    trainer.forward = poisoned
    lines = []
    console = trainer.logger.console
    trainer.logger.console = lambda msg, *a, **k: (lines.append(str(msg)), console(msg, *a, **k))[1]
    result = fit_until_divergence(trainer)
    result["rollback"] = [m for m in lines if "rolled back" in m]
    if info.rank == 0:
        (Path(out) / "result.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main(sys.argv[1])
    exit_cleanly()
