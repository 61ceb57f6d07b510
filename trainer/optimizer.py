"""The run's optimizer from its config, in one place: the trainer and comm.mode=auto's measurement of
each candidate (trainer/advise.py) build it alike, so what is measured is what runs.

- `kernels_setting`: comm.kernels, with $LIONCUB_KERNELS deciding what "auto" means (the tests pin
  the eager kernels through it);
- `run_plan`: the run's frozen optimizer plan (optim.registry.resolve) from the config's optim, comm
  and parallel sections at the run's world size;
- `build_run_optimizer`: that plan's optimizer on the run's process groups.
"""
from __future__ import annotations

import os

import comm
from optim.plan import RunPlan
from optim.registry import build_from_plan, resolve

from .config import Config

KERNELS_ENV = "LIONCUB_KERNELS"


def kernels_setting(setting: str) -> str:
    """comm.kernels, with $LIONCUB_KERNELS deciding what "auto" means (e.g. eager in the tests)."""
    env = os.environ.get(KERNELS_ENV, "")
    return env if setting == "auto" and env in ("compiled", "eager", "native") else setting


def run_plan(cfg: Config, *, world_size: int, shard_size: int = 1, shard_dims: dict[int, int] | None = None,
             fine_timing: bool | None = None, overlap: bool | None = None) -> RunPlan:
    """cfg's optimizer plan for `world_size` exchanging ranks (the replicate group) and shards of
    `shard_size` placed as `shard_dims`. fine_timing / overlap: None = the config's. Raises the
    registry's ValueError listing every problem."""
    o, c = cfg.optim, cfg.comm
    return resolve(o.name, comm_mode=c.mode, comm_options=c.options, optim_options=o.options, betas=tuple(o.betas),
                   eps=o.eps, grad_clip=o.grad_clip, momentum_sync=vars(c.momentum_sync), world_size=world_size,
                   shard_size=shard_size, bucket_mb=c.bucket_mb,
                   overlap=c.overlap if overlap is None else overlap, kernels=kernels_setting(c.kernels),
                   fine_timing=c.fine_timing if fine_timing is None else fine_timing, shard_dims=shard_dims)


def build_run_optimizer(cfg: Config, groups: list[dict], order: list, *, group=None, shard_group=None,
                        shard_dims: dict[int, int] | None = None, fine_timing: bool | None = None,
                        overlap: bool | None = None):
    """cfg's optimizer over `groups` (trainer.param_groups) in the model's parameter `order`, on the
    replicate `group` (and `shard_group` with the placements `shard_dims` when sharded).
    fine_timing / overlap: None = the config's. A combination the config's validation does not know
    about raises build_optimizer's ValueError (the trainer makes it a ConfigError; comm.mode=auto a
    candidate's reason)."""
    plan = run_plan(cfg, world_size=comm.world(group)[0],
                    shard_size=comm.world(shard_group)[0] if shard_group is not None else 1, shard_dims=shard_dims,
                    fine_timing=fine_timing, overlap=overlap)
    return build_from_plan(plan, groups, group=group, param_order=order, shard_group=shard_group)


__all__ = ["KERNELS_ENV", "build_run_optimizer", "kernels_setting", "run_plan"]
