"""Train every preset in configs/variants/ for a few steps on the tiny model in ONE process group
and write {variant: parameter sha256} (rank 0) to the JSON path given as argv[1].

Used twice: once on the code before a refactor to record tests/golden/digests.json, and by
tests/trainer/test_golden.py on the current code, which must reproduce every digest bit for bit.
"""
from __future__ import annotations

import json
import sys
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer, run  # noqa: E402

Trainer.save = lambda self: None  # the digests are of parameters in memory: no checkpoint files (~1 s a run)

# tiny model, untied so that the head-sync presets are legal; a few steps with clipping and decay
OVERRIDES = ["model.preset=tiny", "model.tie_embeddings=false", "data.batch_size=2", "data.seq_len=32",
             "train.max_steps=6", "train.eval_every=0", "train.eval_steps=1", "train.log_every=3",
             "optim.lr=1e-3", "optim.warmup_steps=2", "log.wandb=disabled", "comm.momentum_sync.every=0"]
# the sync presets keep their schedule, every 3 steps so it happens within the run
SYNC = {"lioncub_4bit_synchead": ["comm.momentum_sync.every=3"],
        "lioncub_syncall": ["comm.momentum_sync.every=3"]}


def main(out_path: str, variants: list[str], extra: list[str]) -> None:
    info = init_distributed("cpu")
    digests = {}
    tmp = str(Path(out_path).with_suffix("")) + "_runs"  # shared by the ranks (same machine)
    if True:
        for name in variants:
            base = name.split("@")[0]
            overrides = OVERRIDES + SYNC.get(base, []) + extra + name.split("@")[1:]
            cfg = load_config(ROOT / "configs" / "variants" / f"{base}.yaml",
                              overrides + [f"train.out_dir={tmp}/{name}"])
            run(cfg, info)
            if info.is_main:
                recs = [json.loads(x) for x in (Path(tmp) / name / "metrics.jsonl").read_text().splitlines()]
                shas = [r for r in recs if "param_sha256" in r][-1]["param_sha256"]
                assert len(set(shas)) == 1, (name, shas)
                digests[name] = shas[0]
    if info.is_main:
        Path(out_path).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
        shutil.rmtree(tmp, ignore_errors=True)
    shutdown()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main(sys.argv[1], sys.argv[2].split(","), sys.argv[3:])
    exit_cleanly()
