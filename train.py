"""Train a GPT-2++ with the optimizer and communication mode chosen in a YAML config.

    python train.py configs/default.yaml                                   # one process
    torchrun --standalone --nproc_per_node=2 train.py configs/default.yaml  # 2 ranks, gloo on CPU
    torchrun --nproc_per_node=8 train.py configs/gpt2_774m/lioncub_8bit_l1.yaml train.max_steps=5000
    python train.py --help-config                                          # every key, with its help

Overrides follow the config path as section.key=value (values parsed as YAML). The run directory
(train.out_dir) gets config.yaml, metrics.jsonl and ckpt/; see README.md.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("LIONCUB_CACHE", str(ROOT / ".cache"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")


def main(argv: list[str]) -> int:
    from trainer.config import ConfigError, describe, load_config

    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--help-config":
        print(describe())
        return 0
    is_main = os.environ.get("RANK", "0") == "0"
    try:
        cfg = load_config(argv[0], argv[1:])
    except ConfigError as e:
        if is_main:
            print(f"error: {e}", file=sys.stderr)
        return 2

    from data import DataError
    from trainer.dist import init_distributed, shutdown
    from trainer.trainer import RunDirError, run

    try:
        info = init_distributed(cfg.train.device, cfg.comm.timeout_s)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(cfg, info)
        return 0
    except (ConfigError, RunDirError) as e:
        if info.is_main:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except DataError as e:  # raised by the rank that read the data: print there
        print(f"error (rank {info.rank}): {e}", file=sys.stderr)
        return 2
    finally:
        shutdown()


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # The process group is already destroyed and every file closed; skip interpreter teardown,
    # where gloo can abort ("terminate called without an active exception", pytorch#179291)
    # after a successful run and turn exit code 0 into a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
