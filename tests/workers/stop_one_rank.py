"""A signal seen by one rank only (launched by tests/faults/test_signals.py): rank STOP_RANK's stop
flag is set during its STOP_AT-th forward, as its signal handler would; with train.log_every
large, every rank must stop after that same step, checkpoint once and agree on parameters.
Usage: stop_one_rank.py OUT_DIR STOP_RANK STOP_AT. Rank 0 writes OUT_DIR/result.json."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from optim.base import digest  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def main(out: str, stop_rank: int, stop_at: int) -> None:
    info = init_distributed("cpu")
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.max_steps=50", "train.log_every=40",
        "train.eval_every=0", "train.eval_steps=1", "train.ckpt_every=0", f"train.out_dir={out}",
        "optim.warmup_steps=0", "log.wandb=disabled"])
    trainer = Trainer(cfg, info)
    forward, calls = trainer.forward, {"n": 0}

    def forward_then_signal(x, y):
        calls["n"] += 1
        if info.rank == stop_rank and calls["n"] == stop_at:
            trainer._on_signal(signal.SIGTERM, None)
        return forward(x, y)

    trainer.forward = forward_then_signal
    try:
        result = trainer.fit()
    finally:
        trainer.logger.close()
        trainer.release()
    digests = [None] * info.world_size
    torch.distributed.all_gather_object(digests, digest(p for _, p in sorted(trainer.model.named_parameters())))
    result["identical"] = len(set(digests)) == 1
    steps = [None] * info.world_size
    torch.distributed.all_gather_object(steps, trainer.step)
    result["steps"] = steps
    if info.rank == 0:
        (Path(out) / "result.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    exit_cleanly()
