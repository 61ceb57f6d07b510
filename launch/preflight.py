"""Checks a launcher script runs before it starts any rank of train.py (launch/slurm/train.sbatch).

    python -m launch.preflight [--world N] [--fresh HINT] CONFIG [MORE.yaml ...] [section.key=value ...]

- the config (files and overrides) loads and validates, with the world size N when given;
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
    from launch.torchrun import check_train_args
    from trainer.config import load_config, split_config_args

    ap = argparse.ArgumentParser(prog="python -m launch.preflight", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=None, help="the world size the ranks will have")
    ap.add_argument("--fresh", metavar="HINT", default=None,
                    help="refuse an existing non-empty train.out_dir; HINT says how to continue it instead")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="CONFIG [MORE.yaml ...] [section.key=value ...]")
    ns = ap.parse_args(sys.argv[1:] if argv is None else argv)
    problem = check_train_args(ns.args, ns.world) if ns.args else "expected CONFIG [overrides]"
    if not problem and ns.fresh is not None:
        files, overrides = split_config_args(ns.args)
        problem = fresh_problem(load_config(files, overrides).train.out_dir, ns.fresh)
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
