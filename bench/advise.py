"""Which optimizer and communication mode should I run? Measure the network and the model, predict
every variant's step time, rank them.

    torchrun --nproc_per_node=4 -m bench.advise configs/default.yaml            # every variant
    torchrun --nproc_per_node=4 -m bench.advise configs/gpt2_124m/lion_fp32.yaml --variants lion_fp32,lioncub_1bit
    python -m bench.netsim --nproc 4 --rate 100mbit -- python -m bench.advise configs/default.yaml

A thin command over trainer/advise.py, which measures and predicts (its docstring says how) for this
table and for `comm.mode=auto` in training (trainer/automode.py), so both rank alike. Every variant
is measured here; its quality evidence (the study-prose tables, trainer/auto_quality.yaml) says
"not for auto: ... out: why" where comm.mode=auto would leave it out. `--json PATH` writes the table
and the measurements.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

import torch.distributed as dist

import data
from trainer.advise import (ROOT, advise, links_markdown, load_variant, measure_links, table_markdown,
                            variant_names)
from trainer.config import ConfigError, load_config, split_config_args
from trainer.dist import init_distributed


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.advise", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="+", help="the run's YAML config file(s), then section.key=value overrides, "
                                              "as train.py takes them")
    ap.add_argument("--variants", default="", help="comma list of configs/variants names (default: all)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per measurement (after one warm-up)")
    ap.add_argument("--json", default="", help="also write the table and the measurements here")
    ap.add_argument("--links-only", action="store_true", help="measure and print the links only")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("LIONCUB_CACHE", str(ROOT / ".cache"))
    try:
        files, overrides = split_config_args(args.config)
        cfg = load_config(files, overrides)
        if cfg.parallel.shard_size > 1:
            raise ConfigError(f"parallel.shard_size={cfg.parallel.shard_size}: bench.advise predicts replicated "
                              f"runs only (per-rank shards and the replicate axis are not modelled yet); run it "
                              f"with parallel.shard_size=1")
        names = [v for v in args.variants.split(",") if v] or variant_names()
        candidates = [load_variant(n) for n in names]
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    info = init_distributed(cfg.train.device, timeout_s=cfg.comm.timeout_s)
    try:
        data_dir = data.resolve_dataset(cfg.data.dataset, cfg.data.cache_dir or None) if info.is_main else None
        box = [str(data_dir) if data_dir else None]
        dist.broadcast_object_list(box, src=0)
        log = print if info.is_main else (lambda *a, **k: None)
        if args.links_only:
            result = {"world_size": info.world_size, "device": str(info.device), "rows": [],
                      "links": measure_links(info.device)}
        else:
            result = advise(cfg, candidates, info.device, Path(box[0]), steps=args.steps, log=log)
        if info.is_main:
            print()
            print(links_markdown(result))
            if result["rows"]:
                print()
                print(table_markdown(result))
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(result, indent=1, default=str))
                print(f"\nwritten: {args.json}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
