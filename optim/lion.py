"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms") with foreach kernels.

Per step, for every trainable parameter:
    p *= 1 - lr * wd                       (decoupled weight decay)
    p -= lr * sign(b1 * m + (1 - b1) * g)  (the update direction c, Lion Cub Alg. 1 line 3)
    m  = b2 * m + (1 - b2) * g
lr and weight_decay are read from each param group at every step, so schedulers (and the
trainer's group["lr"] = schedule_lr * group["lr_mult"]) take effect immediately.

The three kernels below are shared with the update-sync optimizer (optim/lioncub.py) so that at
world size 1 it reproduces this class bit for bit wherever c != 0; where c == 0 exactly, a 1-bit
vote's tie break moves the element by +-lr (Lion's sign gives 0) unless mask_zero_updates is on.
Gradient sync and clipping happen in the base (optim/base.py) before `_update`.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .base import CommOptimizer


def lion_direction(exp_avgs: list[torch.Tensor], grads: list[torch.Tensor], beta1: float,
                   out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """c = b1 * m + (1 - b1) * g, into `out` when given (same shapes), else into new tensors."""
    if out is None:
        out = torch._foreach_mul(exp_avgs, beta1)
    else:
        torch._foreach_copy_(out, exp_avgs)
        torch._foreach_mul_(out, beta1)
    torch._foreach_add_(out, grads, alpha=1.0 - beta1)
    return out


def apply_update_(params: list[torch.Tensor], updates: list[torch.Tensor], lr: float, weight_decay: float) -> None:
    """p *= 1 - lr*wd; p -= lr * update (the update is sign(c), or a mean of votes for D-Lion Avg)."""
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)


def momentum_update_(exp_avgs: list[torch.Tensor], grads: list[torch.Tensor], beta2: float) -> None:
    """m = b2 * m + (1 - b2) * g with the local gradient."""
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)


def lion_group_step_(state: dict, group: dict, params: list[torch.Tensor]) -> None:
    """One Lion step of `params` (their gradients already averaged) at the group's lr, betas and
    weight decay; the momentum lives in state[p]["exp_avg"] (made on the first step)."""
    grads = [p.grad for p in params]
    exp_avgs = []
    for p in params:
        if "exp_avg" not in state[p]:
            state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        exp_avgs.append(state[p]["exp_avg"])
    beta1, beta2 = group["betas"]
    updates = lion_direction(exp_avgs, grads, beta1)
    torch._foreach_sign_(updates)
    apply_update_(params, updates, float(group["lr"]), float(group["weight_decay"]))
    momentum_update_(exp_avgs, grads, beta2)


class Lion(CommOptimizer):
    """Lion on one shared state (gradient sync, or one process): every rank averages its gradient
    through the scheme (fp32 / bf16 allreduce), then takes the same step."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, **comm_kwargs) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Lion: lr={lr}; need lr >= 0")
        if not (0.0 <= betas[0] <= 1.0 and 0.0 <= betas[1] <= 1.0):
            raise ValueError(f"Lion: betas={betas}; both must lie in [0, 1] (the papers use (0.9, 0.99))")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lion: weight_decay={weight_decay}; need >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), **comm_kwargs)

    def momentum_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        return self.state[p].get("exp_avg")

    def _update(self, step: int) -> None:
        for gi, ks in self.layout.per_group.items():
            lion_group_step_(self.state, self.param_groups[gi], self.layout.params(ks))
