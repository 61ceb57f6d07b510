"""Checks a launcher script runs before it starts any rank of train.py (launch/slurm/train.sbatch).

    python -m launch.preflight [--world N] [--node-size L] [--world-may-change] [--fresh HINT]
                               CONFIG [MORE.yaml ...] [section.key=value ...]

- the config (files and overrides) loads and validates, with the world size N and the ranks per node L
  when given (a shard group, parallel.shard_size, must fit a node);
- with --world-may-change (a restart may continue on fewer ranks: train.sbatch's MIN_NODES below the
  job's nodes): the comm.mode's state can move to another world size (trainer.config_validate
  elastic_problems);
- with --fresh: the run directory train.out_dir does not exist or is empty, as train.py's
  train.resume=never demands; otherwise the error names it and HINT (how to continue it).
Exit code 0 and nothing printed when all is well; else one message on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def fresh_problem(out_dir: str | Path, hint: str) -> str:
    """Why a new run cannot start in out_dir ('' if it can): the rule of train.resume=never."""
    from trainer.runlock import LOCK

    d = Path(out_dir)
    if d.exists() and (not d.is_dir() or any(p.name != LOCK for p in d.iterdir())):
        return (f"run directory {d} already exists and is not empty; {hint}, pass train.resume=overwrite to "
                f"replace it, or choose another train.out_dir")
    return ""


def main(argv: list[str] | None = None) -> int:
    from launch.torchrun import HELP, check_train_args
    from trainer.config import load_config, split_config_args

    ap = argparse.ArgumentParser(prog="python -m launch.preflight", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=None, help="the world size the ranks will have")
    ap.add_argument("--node-size", type=int, default=None, help="the ranks per node (torchrun's --nproc_per_node)")
    ap.add_argument("--world-may-change", action="store_true",
                    help="a restart may continue on another world size (fewer nodes)")
    ap.add_argument("--fresh", metavar="HINT", default=None,
                    help="refuse an existing non-empty train.out_dir; HINT says how to continue it instead")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="CONFIG [MORE.yaml ...] [section.key=value ...]")
    ns = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if HELP & set(ns.args):
        return 0  # train.py answers these itself
    problem = (check_train_args(ns.args, ns.world, ns.node_size, ns.world_may_change) if ns.args
               else "expected CONFIG [overrides]")
    if not problem and ns.fresh is not None:
        problem = fresh_problem(load_config(*split_config_args(ns.args)).train.out_dir, ns.fresh)
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
