"""Which optimizer and communication mode should I run? Measure the network and the model, predict
every variant's step time, rank them.

    torchrun --nproc_per_node=4 -m bench.advise configs/default.yaml            # every variant
    torchrun --nproc_per_node=4 -m bench.advise configs/gpt2_124m/lion_fp32.yaml --variants lion_fp32,lioncub_1bit
    python -m bench.advise configs/cpu_30m.yaml --variants configs/variants/lion_fp32.yaml my_variant.yaml
    python -m bench.netsim --nproc 4 --rate 100mbit -- python -m bench.advise configs/default.yaml

A thin command over trainer/advise.py, which measures and predicts (its docstring says how) for this
table and for `comm.mode=auto` in training (trainer/automode.py), so both rank alike. Every variant
is measured here; its quality evidence (the study-prose tables, trainer/auto_quality.yaml) says
"not for auto: ... out: why" where comm.mode=auto would leave it out. `--json PATH` writes the table
and the measurements.

Arguments follow every command's convention (util/cli.py): the run's config files compose in order
(as train.py composes them) and overrides go anywhere among the flags. `--variants` compares: each
.yaml file given there is one candidate (the files outside --variants, then it, then the overrides),
a word without .yaml a comma list of configs/variants names, each optionally with optim / comm keys
set as `name@section.key=value@...` (bench.step_breakdown's syntax: `dion@optim.rank_fraction=0.0625`;
such a candidate has no quality evidence of its own); without --variants every configs/variants file
is a candidate. The run's model and data are those of the files outside
--variants (or of the first candidate's file when there are none); candidates differing in them are
refused: the advice compares optimizers and modes on one model.
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
from trainer.advise import (ROOT, Candidate, advise, links_markdown, load_variant, measure_links, table_markdown,
                            variant_names)
from trainer.config import Config, ConfigError, load_config
from trainer.dist import init_distributed
from util.cli import Parser, is_config, variant_runs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = Parser(prog="python -m bench.advise", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                require_config=True, variants=True,
                config_help="the run's config files (composed in order, as train.py composes them) and "
                            "section.key=value overrides, in any order with the flags")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per measurement (after one warm-up)")
    ap.add_argument("--json", default="", help="also write the table and the measurements here")
    ap.add_argument("--links-only", action="store_true", help="measure and print the links only")
    ns = ap.parse_args(argv)
    if ns.steps < 1:
        ap.error(f"--steps {ns.steps}: time at least 1 step per measurement")
    return ns


def candidates_of(args: argparse.Namespace) -> tuple[Config, list[Candidate]]:
    """The run's config and the candidates to compare. A --variants entry ending in .yaml is one candidate:
    the config files outside --variants, then it, then the overrides, composed as train.py composes them
    (its optimizer and mode are the candidate's); other entries are comma lists of configs/variants names.
    Without --variants: every configs/variants file. ConfigError / ValueError on bad input."""
    files = [v for v in args.variants if is_config(v)]
    named = [n for v in args.variants if not is_config(v) for n in v.split(",") if n]
    cfg = load_config(args.configs, args.overrides) if args.configs else None
    candidates = []
    for name, paths in variant_runs(argparse.Namespace(configs=args.configs, variants=files)):
        own = load_config(paths, args.overrides)
        if cfg is None:  # no config outside --variants: the first candidate's file is the run's
            cfg = own
        for section in ("model", "data", "parallel"):
            if own.to_dict()[section] != cfg.to_dict()[section]:
                run = " ".join(args.configs) or files[0]
                raise ConfigError(f"--variants {paths[-1]}: its {section} section differs from the run's ({run}); "
                                  f"advise compares optimizers and modes on one model: give the model and data in "
                                  f"a config file outside --variants")
        d = own.to_dict()
        candidates.append(Candidate(name, {"optim": d["optim"], "comm": d["comm"]}))
    if cfg is None:
        raise ConfigError(f"--variants {' '.join(args.variants)}: names no model; give the run's config file "
                          f"(e.g. configs/default.yaml) or a candidate's .yaml file")
    candidates += [load_variant(n) for n in named]
    if not args.variants:
        candidates = [load_variant(n) for n in variant_names()]
    return cfg, candidates


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("LIONCUB_CACHE", str(ROOT / ".cache"))
    try:
        cfg, candidates = candidates_of(args)
        if cfg.parallel.shard_size > 1:
            raise ConfigError(f"parallel.shard_size={cfg.parallel.shard_size}: bench.advise predicts replicated "
                              f"runs only (per-rank shards and the replicate axis are not modelled yet); run it "
                              f"with parallel.shard_size=1")
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    info = init_distributed(cfg.train.device, timeout_s=cfg.comm.timeout_s)
    try:
        box = [None, None]  # rank 0's dataset dir, or its error: every rank stops on it, none waits
        if info.is_main:
            try:
                box[0] = str(data.resolve_dataset(cfg.data.dataset, cfg.data.cache_dir or None))
            except (data.DataError, OSError, ValueError) as e:
                box[1] = str(e)
        dist.broadcast_object_list(box, src=0)
        if box[1]:
            if info.is_main:
                print(f"error: {box[1]}", file=sys.stderr)
            return 2
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
