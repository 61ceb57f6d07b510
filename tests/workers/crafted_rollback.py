"""A rollback that meets a crafted checkpoint (launched by tests/faults/test_checkpoint_safety.py):
the debug model trains in-process; right after step 4's checkpoint is saved its rank file is
replaced by a pickle that would create SENTINEL if loaded with code allowed (and meta.json's
sha256 is updated to match, as whoever can write the file can), then step 5's loss is made NaN so
train.on_nonfinite=rollback reads the checkpoints back. Usage: crafted_rollback.py OUT_DIR SENTINEL.
Writes OUT_DIR/result.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.faults.common import TINY, craft, fit_until_divergence  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def main(out: str, sentinel: str) -> None:
    info = init_distributed("cpu")
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        *TINY, "train.max_steps=7", "train.eval_every=0", "train.ckpt_every=2", "train.keep_ckpts=5",
        "train.on_nonfinite=rollback", f"train.out_dir={out}"])
    trainer = Trainer(cfg, info)
    forward, calls, save = trainer.forward, {"n": 0}, trainer.save

    def poisoned(x, y):
        logits, loss = forward(x, y)
        calls["n"] += 1
        return logits, (loss * float("nan") if calls["n"] == 5 else loss)

    def save_then_craft():
        path = save()
        if path.name == "step_000004":
            craft(path, "rank_00000.pt", Path(sentinel))
        return path

    trainer.forward, trainer.save = poisoned, save_then_craft
    result = fit_until_divergence(trainer)
    (Path(out) / "result.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main(sys.argv[1], sys.argv[2])
    exit_cleanly()
