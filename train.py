"""Train a GPT-2++ with the optimizer and communication mode chosen in a YAML config.

    python train.py configs/default.yaml                                   # one process
    torchrun --standalone --nproc_per_node=2 train.py configs/default.yaml  # 2 ranks, gloo on CPU
    torchrun --nproc_per_node=8 train.py configs/gpt2_774m/lioncub_8bit_l1.yaml train.max_steps=5000
    python train.py --help-config                                          # every key, with its help

Config files compose in order (a size file, then a variant file); section.key=value overrides (values
parsed as YAML) apply over all of them, wherever they stand on the line: every command takes its
arguments this way (util/cli.py). The run directory (train.out_dir) gets config.yaml, metrics.jsonl
and ckpt/; see README.md.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("LIONCUB_CACHE", str(ROOT / ".cache"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")


# Other ranks wait this long before printing an error every rank finds (a config error), so rank 0
# prints it first and the launcher's teardown cannot swallow the only copy (torchrun kills the
# survivors when one rank exits: a rank that exited silently first used to leave no message).
SECOND_REPORT_S = 3.0
LAUNCHER_ENV = "LIONCUB_LAUNCHER"  # set by launch.torchrun for its ranks


def report(e: BaseException, rank: int, shared: bool) -> None:
    """Print an error under torchrun so the user always sees it: an error every rank finds
    (`shared`) from rank 0 at once and from the others after a pause; an error only this rank
    found (data, checkpoint files, divergence) from this rank, naming it."""
    if shared and rank != 0:
        time.sleep(SECOND_REPORT_S)
    where = "" if shared else f" (rank {rank})"
    print(f"error{where}: {e}", file=sys.stderr, flush=True)
    if rank == 0 and os.environ.get("TORCHELASTIC_RUN_ID") and not os.environ.get(LAUNCHER_ENV):
        # plain torchrun follows any failed rank with its own ChildFailedError traceback and exit code 1
        print("(torchrun's ChildFailedError report that follows is the launcher's own; `python -m launch.torchrun` "
              "takes the same options, checks the config before starting the ranks and exits with the rank's code)",
              file=sys.stderr, flush=True)


# what a collective raises when a peer process has exited (gloo, NCCL)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
             "ProcessGroupNCCL's watchdog", "remote process exited")


def peer_failed(e: BaseException) -> bool:
    """`e` is a collective failing because another rank went away (not a fault of this rank)."""
    import torch.distributed as dist

    return isinstance(e, RuntimeError) and (isinstance(e, getattr(dist, "DistNetworkError", ())) or
                                            any(m in str(e) for m in PEER_GONE))


def main(argv: list[str]) -> int:
    from trainer.config import ConfigError, describe, load_config_args

    if not argv or {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0 if argv else 2
    if "--help-config" in argv:
        print(describe())
        return 0
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config_args(argv)
    except ConfigError as e:
        report(e, rank, shared=True)
        return 2

    from data import DataError
    from trainer.checkpoint import CheckpointError
    from trainer.dist import init_distributed, shutdown
    from trainer.trainer import DivergenceError, RunDirError, run

    try:
        info = init_distributed(cfg.train.device, cfg.comm.timeout_s, cfg.comm.init_timeout_s)
    except RuntimeError as e:
        report(e, rank, shared=True)
        return 2
    try:
        run(cfg, info)
        return 0
    except (ConfigError, RunDirError) as e:  # decided alike on every rank
        report(e, info.rank, shared=True)
        return 2
    except (DataError, CheckpointError) as e:  # found by the rank that read the file
        report(e, info.rank, shared=False)
        return 2
    except DivergenceError as e:
        report(e, info.rank, shared=True)
        return 3
    except KeyboardInterrupt:
        print(f"interrupted (rank {info.rank}): a second Ctrl-C; no checkpoint written", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        if not peer_failed(e):
            raise
        # another rank stopped (its own error, printed by that rank) and left this one's collective
        # hanging up: say so in one line instead of the backend's traceback
        print(f"error (rank {info.rank}): stopped because another rank left a collective; that rank's own "
              f"'error (rank N)' message says why", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown()


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except BaseException:  # an unexpected error: show it, then leave without the teardown below
        import traceback

        traceback.print_exc()
        code = 1
    # The process group is already destroyed and every file closed; skip interpreter teardown,
    # where gloo can abort ("terminate called without an active exception", pytorch#179291)
    # after a successful run and turn exit code 0 into a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
