"""Per-rank memory of a training run and whether it fits: `python -m trainer.memory CONFIG [MORE.yaml ...]
[key=value ...] --world N [--shard-size S] [--device-gib G] [--variants A.yaml B.yaml ...]`.

The command reads the config (trainer.config) and prints model.memory's estimate and report; the
estimate itself (model/memory.py) says what each line counts. Arguments follow every command's
convention (util/cli.py): config files compose in order, overrides and flags in any order;
`--variants A.yaml B.yaml` (or names of configs/variants: `--variants adamw_fp32 lioncub_1bit`) prints one estimate per file (each composed over the config files given
outside --variants, then the overrides) and a table comparing their totals.
"""
from __future__ import annotations

import sys

from model.memory import GIB, estimate, report
from util.cli import Parser, variant_runs

from .config import AUTO_MODE, VARIANTS_DIR, ConfigError, load_config, validate


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="python -m trainer.memory", description=__doc__.split("\n\n")[0], require_config=True,
                variants=True, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--world", type=int, required=True, help="ranks in the run")
    ap.add_argument("--shard-size", type=int, default=None,
                    help="ranks sharding one copy of the model (default: the config's parallel.shard_size)")
    ap.add_argument("--device-gib", type=float, default=80.0, help="memory of one device in GiB (default 80)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="activation width: cuda uses train.dtype (bfloat16 by default), cpu fp32")
    args = ap.parse_args(argv)
    try:
        # a bare name is configs/variants/<name>.yaml, as bench.advise and bench.time_to_loss read it
        runs = variant_runs(args, lambda v: str(VARIANTS_DIR / f"{v}.yaml")) if args.variants else [("", args.configs)]
        rows = []
        for name, files in runs:
            cfg = load_config(files, args.overrides)
            shard = args.shard_size if args.shard_size is not None else cfg.parallel.shard_size
            if cfg.comm.mode == AUTO_MODE:
                raise ConfigError(f"{name or ' '.join(files)}: comm.mode=auto picks its variant when the run starts; "
                                  f"estimate the candidates with --variants configs/variants/*.yaml, or give comm.mode")
            mem = estimate(cfg, args.world, shard, device=args.device)  # its own errors name --world / --shard-size
            cfg.parallel.shard_size = shard  # then the run as train.py checks it at this world size and mesh
            try:
                validate(cfg, world_size=args.world)
            except ConfigError as e:
                if not args.variants:
                    raise
                mem = f"refused: train.py would not run it here: {e}"  # one variant of several: its row says why
            rows.append((name, cfg, shard, mem))
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, cfg, shard, mem in rows:
        if name:
            print(f"== {name}")
        print(f"{cfg.model.preset} | optim.name={cfg.optim.name} comm.mode={cfg.comm.mode} | world {args.world}, "
              f"shard size {shard} (replicas {args.world // shard}) | batch {cfg.data.batch_size} x {cfg.data.seq_len}")
        print(mem if isinstance(mem, str) else report(mem, args.device_gib))
    if args.variants:
        width = max(len(r[0]) for r in rows)
        print(f"\n{'variant':{width}s}  {'model state':>12s}  {'total':>10s}  of {args.device_gib:g} GiB")
        for name, _, _, mem in rows:
            print(f"{name:{width}s}  refused (above)" if isinstance(mem, str) else
                  f"{name:{width}s}  {mem.model_state / GIB:8.2f} GiB  {mem.total / GIB:6.2f} GiB  "
                  f"{'fits' if mem.total <= args.device_gib * GIB else 'does NOT fit'}")
    if all(isinstance(r[3], str) for r in rows):
        print("error: train.py would run none of the variants at this world size and mesh (above)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
