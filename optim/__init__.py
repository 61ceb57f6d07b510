"""Optimizers that own their communication, and the registries that name them.

    build_optimizer(name, param_groups, *, betas, eps, comm_mode, comm_options, optim_options,
                    momentum_sync, grad_clip, group, param_order) -> CommOptimizer

`optim.registry` maps `optim.name` to an optimizer and says which sync schemes it runs on, and
resolves a run's settings into one frozen, validated `RunPlan` (optim.plan; `resolve`, and
`plan_problems` for the config); `optim.sync` maps `comm.mode` to a sync scheme, whose kind picks
the step's strategy (optim.strategy: gradient sync or update sync). Every optimizer derives from
`optim.base.CommOptimizer`: it composes the flat layout (optim.layout), buckets and overlap
(optim.overlap), byte and time accounting (optim.accounting) and the divergence guard
(optim.guard), runs the scheme's exchange inside `step()`, clips, runs momentum sync and
diagnostics, and returns a `StepReport`.
"""
from __future__ import annotations

from . import sync
from .adamw import AdamW
from .accounting import StepReport
from .base import CommOptimizer
from .layout import FlatLayout
from .lion import Lion
from .lioncub import DistributedLion
from .plan import MomentumSync, RunPlan
from .quantize import lp_quantize
from .registry import (OptimizerSpec, OptimOptions, build_from_plan, build_optimizer, compatibility_problem,
                       get_optimizer, optimizer_names, optimizers, optimizers_table, plan_problems,
                       register_optimizer, resolve, shard_dims)
from .strategy import GradientSync, SyncStrategy, UpdateSync, register_strategy
from . import binsgdm, dion, muon, onebit_adam  # noqa: F401,E402  (registers the other optimizers)
from .binsgdm import BinSGDM  # noqa: E402
from .onebit_adam import OneBitAdam  # noqa: E402

__all__ = ["AdamW", "BinSGDM", "CommOptimizer", "DistributedLion", "FlatLayout", "GradientSync", "Lion", "MomentumSync",
           "OneBitAdam", "OptimOptions", "OptimizerSpec", "RunPlan", "StepReport", "SyncStrategy", "UpdateSync",
           "build_from_plan", "build_optimizer", "compatibility_problem", "get_optimizer", "lp_quantize",
           "optimizer_names", "optimizers", "optimizers_table", "plan_problems", "register_optimizer",
           "register_strategy", "resolve", "shard_dims", "sync"]
