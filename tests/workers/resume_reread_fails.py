"""An old rank's file that changes between the resume's check and its second read, seen by one rank only
(launched by tests/trainer/test_checkpoint_layout.py): the checkpoint in OUT_DIR was written by another world
size, so every rank reads the old rank files again, one at a time (trainer/state.py RankStates); on rank 1
that read fails. Every rank must stop with rank 1's message (a CheckpointError naming the file, that it changed
since the check, and which rank saw it), none may go on into training. Usage: resume_reread_fails.py OUT_DIR.
Each rank writes OUT_DIR/reread_<rank>.json: the error's type and text."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from model.checkpoint_files import CheckpointError  # noqa: E402
from trainer import state  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def main(out: str) -> None:
    info = init_distributed("cpu")
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.max_steps=4", "train.eval_every=0",
        "train.eval_steps=1", "train.ckpt_every=2", f"train.out_dir={out}", "optim.warmup_steps=0",
        "log.wandb=disabled", "comm.mode=onebit", "train.resume=auto"])
    if info.rank == 1:
        def changed(path, names):
            names = list(names)
            raise CheckpointError(f"{Path(path) / names[0]} is corrupt (sha256 differs from meta.json)")
        state.load_verified = changed
    said = {"type": None, "text": ""}
    try:
        Trainer(cfg, info).fit()
    except CheckpointError as e:
        said = {"type": type(e).__name__, "text": str(e)}
    Path(out, f"reread_{info.rank}.json").write_text(json.dumps(said))
    shutdown()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main(sys.argv[1])
    exit_cleanly()
