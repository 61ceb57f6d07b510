"""The run's optimizer from its config, in one place: the trainer and comm.mode=auto's measurement of
each candidate (trainer/advise.py) build it alike, so what is measured is what runs.

- `kernels_setting`: comm.kernels, with $LIONCUB_KERNELS deciding what "auto" means (the tests pin
  the eager kernels through it);
- `build_run_optimizer`: optim.build_optimizer's keywords from the config's optim and comm sections.
"""
from __future__ import annotations

import os

from optim import build_optimizer

from .config import Config

KERNELS_ENV = "LIONCUB_KERNELS"


def kernels_setting(setting: str) -> str:
    """comm.kernels, with $LIONCUB_KERNELS deciding what "auto" means (e.g. eager in the tests)."""
    env = os.environ.get(KERNELS_ENV, "")
    return env if setting == "auto" and env in ("compiled", "eager", "native") else setting


def build_run_optimizer(cfg: Config, groups: list[dict], order: list, *, group=None, shard_group=None,
                        shard_dims: dict[int, int] | None = None, fine_timing: bool | None = None,
                        overlap: bool | None = None):
    """cfg's optimizer over `groups` (trainer.param_groups) in the model's parameter `order`, on the
    replicate `group` (and `shard_group` with the placements `shard_dims` when sharded).
    fine_timing / overlap: None = the config's. A combination the config's validation does not know
    about raises build_optimizer's ValueError (the trainer makes it a ConfigError; comm.mode=auto a
    candidate's reason)."""
    o, c = cfg.optim, cfg.comm
    return build_optimizer(
        o.name, groups, betas=tuple(o.betas), eps=o.eps, comm_mode=c.mode, comm_options=c.options,
        optim_options=o.options, grad_clip=o.grad_clip, momentum_sync=vars(c.momentum_sync),
        param_order=order, kernels=kernels_setting(c.kernels),
        fine_timing=c.fine_timing if fine_timing is None else fine_timing, bucket_mb=c.bucket_mb,
        overlap=c.overlap if overlap is None else overlap, group=group, shard_group=shard_group,
        shard_dims=shard_dims)


__all__ = ["KERNELS_ENV", "build_run_optimizer", "kernels_setting"]
