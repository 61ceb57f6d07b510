"""Per-rank memory of a training run and whether it fits: `python -m trainer.memory CONFIG
[key=value ...] --world N [--shard-size S] [--device-gib G]`.

The command reads the config (trainer.config) and prints model.memory's estimate and report; the
estimate itself (model/memory.py) says what each line counts.
"""
from __future__ import annotations

import argparse
import sys

from model.memory import estimate, report

from .config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a YAML config (configs/...)")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    ap.add_argument("--world", type=int, required=True, help="ranks in the run")
    ap.add_argument("--shard-size", type=int, default=None,
                    help="ranks sharding one copy of the model (default: the config's parallel.shard_size)")
    ap.add_argument("--device-gib", type=float, default=80.0, help="memory of one device in GiB (default 80)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="activation width: cuda uses train.dtype (bfloat16 by default), cpu fp32")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        shard = args.shard_size if args.shard_size is not None else getattr(cfg, "parallel").shard_size
        mem = estimate(cfg, args.world, shard, device=args.device)
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{cfg.model.preset} | optim.name={cfg.optim.name} comm.mode={cfg.comm.mode} | world {args.world}, "
          f"shard size {shard} (replicas {args.world // shard}) | batch {cfg.data.batch_size} x {cfg.data.seq_len}")
    print(report(mem, args.device_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
