"""Resume on another mesh keeps what a same-mesh resume keeps (launched by
tests/faults/test_remesh_resume.py): 2 ranks. A run at parallel.shard_size=2 is stopped at step 2
of 4 (train.stop_after); two copies are resumed with train.max_steps=6, one at shard_size=2 (same
mesh), one at shard_size=1 (another mesh). Each rank writes, per resume, the fields a resume
restores: step, tokens seen, the lr schedule's horizon, the data
loader's state, every RNG state, skipped batches, and the console lines (the "schedule" note)."""
from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

BASE = ["model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.eval_every=0", "train.eval_steps=1",
        "log.wandb=disabled", "optim.warmup_steps=0", "train.log_every=1", "train.ckpt_every=2"]


def digest(x) -> str:
    return hashlib.sha256(repr(x).encode()).hexdigest()[:16]


def fields(tr: Trainer) -> dict:
    return {"step": tr.step, "tokens_seen": tr.tokens_seen, "schedule_steps": tr.schedule_steps,
            "loader": digest(tr.loader.state_dict()), "skip_batches": sorted(tr.skip_batches),
            "rng_torch": digest(torch.get_rng_state().tolist()), "rng_numpy": digest(np.random.get_state()[1].tolist()),
            "rng_python": digest(random.getstate())}


def main(tmp: str) -> None:
    global INFO
    INFO = init_distributed("cpu")
    tmp_dir = Path(tmp)
    first = tmp_dir / "first"
    tr = Trainer(load_config(ROOT / "configs/default.yaml", BASE + [f"train.out_dir={first}", "train.max_steps=4",
                                                                    "train.stop_after=2", "parallel.shard_size=2"]),
                 INFO)
    try:
        tr.fit()
    finally:
        tr.logger.close()
        tr.release()
    torch.distributed.barrier()
    out = {}
    for name, shard in (("same_mesh", 2), ("other_mesh", 1)):
        run = tmp_dir / name
        if INFO.is_main:
            shutil.copytree(first, run)
        torch.distributed.barrier()
        cfg = load_config(ROOT / "configs/default.yaml", BASE + [f"train.out_dir={run}", "train.max_steps=6",
                                                                "train.resume=auto", f"parallel.shard_size={shard}"])
        lines: list[str] = []
        orig = Trainer._say
        Trainer._say = lambda self, msg: lines.append(msg)  # the constructor's console lines
        try:
            tr = Trainer(cfg, INFO)
        finally:
            Trainer._say = orig
        out[name] = {**fields(tr), "lines": lines}
        tr.logger.close()
        tr.release()
        torch.distributed.barrier()
    (tmp_dir / f"fields_{INFO.rank}.json").write_text(json.dumps(out, indent=1))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
