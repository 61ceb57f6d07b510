"""Divergence-guard checks (launched by tests/faults/test_faults.py): the debug model trains in-process on
2 ranks; the model's forward is wrapped so that ONE rank returns a NaN loss (and NaN gradients) at
one step. Usage: nonfinite.py OUT_DIR POLICY BAD_STEP BAD_RANK. Rank 0 writes OUT_DIR/result.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.faults.common import fit_until_divergence  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def main(out: str, policy: str, bad_step: int, bad_rank: int) -> None:
    info = init_distributed("cpu")
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.max_steps=8", "train.log_every=1",
        "train.eval_every=0", "train.eval_steps=1", "train.ckpt_every=2", "train.keep_ckpts=5",
        f"train.on_nonfinite={policy}", f"train.out_dir={out}", "optim.warmup_steps=0"])
    trainer = Trainer(cfg, info)
    forward, calls = trainer.forward, {"n": 0}

    def poisoned(x, y):
        logits, loss = forward(x, y)
        calls["n"] += 1
        if info.rank == bad_rank and calls["n"] == bad_step:  # the bad_step-th forward of this rank
            loss = loss * float("nan")
        return logits, loss

    trainer.forward = poisoned
    result = fit_until_divergence(trainer)
    params = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    result["finite"] = bool(torch.isfinite(params).all())
    result["digest"] = __import__("optim.base", fromlist=["digest"]).digest([params])
    digests = [None] * info.world_size
    torch.distributed.all_gather_object(digests, result["digest"])
    result["identical"] = len(set(digests)) == 1
    if info.rank == 0:
        (Path(out) / "result.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    exit_cleanly()
