"""torchrun for train.py, with the config checked before any rank starts.

    python -m launch.torchrun [torchrun options] train.py CONFIG [MORE.yaml ...] [section.key=value ...]
    python -m launch.torchrun --standalone --nproc_per_node=2 train.py configs/default.yaml train.max_steps=50

It takes torchrun's options (torch.distributed.run) and differs in two ways:
- train.py's config files and overrides are loaded and validated here first (with the world size
  when --nnodes and --nproc_per_node fix it, the ranks per node when --nproc_per_node does, and with
  an elastic --nnodes=MIN:MAX whether a restart on fewer ranks could resume the run): a problem is
  one message on stderr, exit code 2, and no rank is started;
- when a rank fails anyway (an error only the ranks can find: a run directory that exists, data,
  a checkpoint), torchrun would end in its own ChildFailedError traceback and exit code 1. Here the
  rank's own message stands alone and the launcher exits with that rank's exit code (2 for the
  errors the trainer reports, 3 for divergence; 128+N for a rank killed by signal N). For any code
  but 2 one line names the rank that failed first;
- Ctrl-C (SIGINT) or SIGTERM to the launcher: torchrun passes the signal to its ranks (each writes
  its checkpoint at its next step and exits 0, as train.py does alone) and then ends in a
  SignalException traceback with exit code 1. Here one line says what happened and the launcher
  exits 128+N (130 for Ctrl-C), a shell's code for a process stopped by signal N.
Any other script than train.py is launched unchecked, as torchrun would.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys


HELP = {"-h", "--help", "--help-config"}  # train.py's own answers, never checked as a config


def _node_size(args) -> int | None:
    """The ranks per node the command line fixes (--nproc_per_node as a number), or None."""
    try:
        return int(args.nproc_per_node)
    except (TypeError, ValueError):
        return None


def _world_size(args) -> int | None:
    """The world size fixed by the command line, or None (elastic node counts, nproc 'gpu'/'auto')."""
    nproc = _node_size(args)
    if nproc is None:
        return None
    nnodes = str(args.nnodes)
    if args.standalone:
        return nproc
    if ":" in nnodes:
        lo, hi = nnodes.split(":", 1)
        if lo != hi:
            return None
        nnodes = lo
    try:
        return int(nnodes) * nproc
    except ValueError:
        return None


def _world_may_change(args) -> bool:
    """An elastic node count (--nnodes=MIN:MAX, MIN < MAX): a restart may form a smaller world."""
    lo, _, hi = str(args.nnodes).partition(":")
    try:
        return bool(hi) and int(lo) != int(hi) and not args.standalone
    except ValueError:
        return False  # torchrun refuses the value itself


def check_train_args(script_args: list[str], world_size: int | None, node_size: int | None = None,
                     world_may_change: bool = False) -> str:
    """train.py's own argument and config checks, before launch: the error text, or ''. With node_size
    (ranks per node), also that parallel.shard_size fits a node, as the ranks' mesh demands; with
    world_may_change, that a restart on fewer ranks could resume the run (config_validate.elastic_problems)."""
    from trainer.config import ConfigError, load_config_args, validate
    from trainer.config_validate import elastic_problems

    if not script_args or HELP & set(script_args):
        return ""  # train.py answers these itself, wherever they stand (util/cli.py's convention)
    try:
        cfg = load_config_args(script_args)
        if world_size is not None or node_size is not None:
            validate(cfg, world_size=world_size, node_size=node_size)
        if world_may_change:
            return "; ".join(elastic_problems(cfg))
    except (ConfigError, ValueError) as e:  # ValueError: a variant file comm.mode=auto reads
        return str(e)
    return ""


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.path.basename(args.training_script) == "train.py" and not args.module:
        problem = check_train_args(list(args.training_script_args), _world_size(args), _node_size(args),
                                   _world_may_change(args))
        if problem:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            return 2
    # torchrun's per-process lines ("failed (exitcode: 2) local_rank: 0 ...", "Sending process N closing
    # signal SIGTERM") would repeat what the rank said; the failure is summarised below instead
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    os.environ["LIONCUB_LAUNCHER"] = "launch.torchrun"  # the ranks' train.py: no hint about plain torchrun
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        if code != 2:  # 2: the rank printed "error: ..." itself, the one message the user needs
            print(f"launch.torchrun: rank {rank} (host {socket.gethostname()}, pid {failure.pid}) exited with code "
                  f"{failure.exitcode}{' (' + failure.signal_name() + ')' if failure.exitcode < 0 else ''}; its "
                  f"output above says why", file=sys.stderr, flush=True)
        return code or 1
    except SignalException as e:  # the agent has passed the signal to the ranks and waited for them
        sig = signal.Signals(e.sigval)
        print(f"launch.torchrun: {sig.name} received; passed to the ranks, which write a checkpoint at their next "
              f"step and stop (train.resume=auto continues the run; their output above shows the checkpoint)",
              file=sys.stderr, flush=True)
        return 128 + int(sig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
