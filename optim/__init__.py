"""Optimizers: the registry the trainer builds from, Lion, AdamW and update-sync distributed Lion.

    build_optimizer(name, param_groups, *, betas, eps, comm_mode, comm_options, group=None)

name: "adamw" | "lion" (OPTIMIZERS). comm_mode "fp32" | "bf16" is gradient sync (the trainer
mean-allreduces gradients, the optimizer is plain; `.sync_kind == "gradient"`); "ps" | "onebit" |
"pbit" | "hierarchical" is update sync, only with "lion" (optim/lioncub.py; `.sync_kind ==
"update"`). Every returned optimizer carries `diagnose_next_step`, `diag_stats`,
`last_diagnostics` and `last_histograms` (empty for gradient sync, where momenta are identical
across ranks by construction).
"""
from __future__ import annotations

from typing import Callable

import torch

import comm
from .lion import Lion
from .lioncub import UPDATE_SYNC_MODES, DistributedLion
from .quantize import levels_for, lp_quantize

GRADIENT_SYNC_MODES = ("fp32", "bf16")
COMM_MODES = GRADIENT_SYNC_MODES + UPDATE_SYNC_MODES
COMM_OPTION_KEYS = ("bits", "quantizer", "p", "levels", "clip", "rounding", "tie_break", "ps_aggregate",
                    "ps_topology", "node_size", "mask_zero_updates", "momentum_sync")


class AdamW(torch.optim.AdamW):
    """torch's AdamW (fused on CUDA, foreach otherwise) with the trainer-facing attributes."""

    sync_kind = "gradient"

    def __init__(self, param_groups: list[dict], betas: tuple[float, float], eps: float) -> None:
        params = [p for g in param_groups for p in g["params"]]
        on_cuda = bool(params) and all(p.is_cuda for p in params)
        fast = {"fused": True} if on_cuda else {"foreach": True}
        super().__init__(param_groups, betas=tuple(betas), eps=eps, **fast)
        self.diagnose_next_step = False
        self.last_diagnostics: dict[str, float] = {}
        self.last_histograms: dict[str, torch.Tensor] = {}

    def step(self, closure=None):
        self.diagnose_next_step = False
        return super().step(closure)


def _build_adamw(param_groups, *, betas, eps, comm_mode, comm_options, group):
    return AdamW(param_groups, betas, eps)


def _build_lion(param_groups, *, betas, eps, comm_mode, comm_options, group):
    if comm_mode in GRADIENT_SYNC_MODES:
        if comm_options.get("momentum_sync"):
            raise ValueError(f"comm.momentum_sync={comm_options['momentum_sync']!r} only applies to update-sync "
                             f"modes {UPDATE_SYNC_MODES}; with comm.mode={comm_mode} momenta are already identical. "
                             "Set comm.momentum_sync to null.")
        return Lion(param_groups, betas=betas)
    # options left null in the config take the optimizer's defaults (levels null = auto)
    options = {k: v for k, v in comm_options.items() if v is not None}
    return DistributedLion(param_groups, betas=betas, comm_mode=comm_mode, group=group, **options)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"adamw": _build_adamw, "lion": _build_lion}


def build_optimizer(name: str, param_groups: list[dict], *, betas: tuple[float, float], eps: float,
                    comm_mode: str, comm_options: dict, group=None) -> torch.optim.Optimizer:
    """Build optimizer `name` for `param_groups` (dicts with params, names, role, lr, weight_decay,
    lr_mult) under `comm_mode`; raises ValueError naming the bad value and the valid ones."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is unknown; valid names: {sorted(OPTIMIZERS)}")
    if comm_mode not in COMM_MODES:
        raise ValueError(f"comm.mode={comm_mode!r} is unknown; valid modes: {list(COMM_MODES)}")
    if comm_mode in UPDATE_SYNC_MODES and name != "lion":
        raise ValueError(f"comm.mode={comm_mode} is update sync (distributed Lion / Lion Cub) and needs "
                         f"optim.name=lion, got optim.name={name!r}; use comm.mode=fp32 or bf16 for {name}")
    options = dict(comm_options or {})
    unknown = sorted(set(options) - set(COMM_OPTION_KEYS))
    if unknown:
        raise ValueError(f"unknown comm options {unknown}; valid keys: {list(COMM_OPTION_KEYS)}")
    for g in param_groups:
        for key in ("params", "lr", "weight_decay"):
            if key not in g:
                raise ValueError(f"param group {g.get('role', '?')!r} lacks {key!r}; every group needs "
                                 "params, names, role, lr, weight_decay, lr_mult")
    opt = OPTIMIZERS[name](param_groups, betas=tuple(betas), eps=eps, comm_mode=comm_mode,
                           comm_options=options, group=group)
    if not hasattr(opt, "diag_stats"):
        opt.diag_stats = comm.CommStats()
    return opt


__all__ = ["AdamW", "COMM_MODES", "DistributedLion", "Lion", "OPTIMIZERS", "build_optimizer", "levels_for",
           "lp_quantize"]
