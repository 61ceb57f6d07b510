"""AdamW on the communication-owning base: torch's AdamW kernel (fused on CUDA, foreach
otherwise) applied after the base's gradient exchange and clipping."""
from __future__ import annotations

from typing import Iterable

import torch

from .base import CommOptimizer
from .registry import NoOptions, OptimizerSpec, gradient_mean, register_optimizer


class AdamW(CommOptimizer):
    """Decoupled-weight-decay Adam (Loshchilov & Hutter) with gradient sync. The math is torch's
    own kernel, run on an inner torch.optim.AdamW over the same parameters; lr and weight_decay are
    copied from this optimizer's groups before every step, so schedulers act on this object."""

    optim_name = "adamw"

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, **comm_kwargs) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), **comm_kwargs)
        inner_groups = []
        for gi, g in enumerate(self.param_groups):
            ks = self.layout.per_group.get(gi, [])
            inner_groups.append({"params": self.layout.params(ks), "lr": g["lr"], "weight_decay": g["weight_decay"]})
        on_cuda = self.layout.device.type == "cuda"
        self.inner = torch.optim.AdamW([g for g in inner_groups if g["params"]], betas=tuple(betas), eps=eps,
                                       **({"fused": True} if on_cuda else {"foreach": True}))
        self._inner_index = [gi for gi, g in enumerate(inner_groups) if g["params"]]

    def momentum_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        return self.inner.state[p].get("exp_avg") if p in self.inner.state else None

    def _update(self, step: int) -> None:
        for gi, ig in zip(self._inner_index, self.inner.param_groups):
            ig["lr"] = self.param_groups[gi]["lr"]
            ig["weight_decay"] = self.param_groups[gi]["weight_decay"]
        self.inner.step()

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "comm": self._comm_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        if "inner" not in state_dict:
            raise ValueError("AdamW.load_state_dict: no 'inner' entry; was this saved by a different optimizer?")
        self.inner.load_state_dict(state_dict["inner"])
        self._load_comm_state(state_dict.get("comm"))


def _build_adamw(groups, *, plan, **runtime) -> AdamW:
    return AdamW(groups, betas=plan.betas, eps=plan.eps, plan=plan, **runtime)


register_optimizer(OptimizerSpec(
    name="adamw", options=NoOptions, build=_build_adamw, accepts=gradient_mean,
    needs="a gradient-sync scheme", state="m, v (fp32)",
    help="AdamW (torch's kernel) on the mean gradient",
    state_words=lambda o, s, matrix: 2.0, shards=True))
