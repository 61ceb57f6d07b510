"""BinSGDM (a.k.a. Birder; "BinSGDM", Alg. 1 and §4) on the communication-owning base, registered
as `optim.name=binsgdm` on `comm.mode=compressed` with `comm.compressor=binary_stochastic`.

Alg. 1, on every rank i at step t (one beta for m and b, so |m/b| <= 1):
    m_i  = beta * m_i + (1 - beta) * g_i                       line 5 (local gradient)
    bh_i = beta * bh_i + (1 - beta) * |g_i|                    line 6
    b_i  = max(b_i, bh_i) if t > T0 else bh_i                  line 7 (AMSGrad's rule)
    u    = exchange(m_i / b_i)                                 lines 8-12: the worker quantizes
           Q(m_i/b_i + e_i) (eq. 5: +1 with probability (y + 1)/2, else -1), keeps e_i += m_i/b_i - u_i;
           the server averages the u_i, adds its error, quantizes again with Q and keeps its own error
           (comm.ef_compressed_allreduce in the all-to-all form of App. A; §4's hierarchical form
           with comm.ef_node_size)
    p   *= 1 - lr * wd;  p -= lr * u                           u in {-1, +1}, identical on every rank
Where b = 0 (no gradient yet), m = 0 too and m/b is taken as 0. T0 = optim.t0; the paper's
footnote: the max rule "is more about theoretical significance, and we commonly do not implement it
in practice", hence t0 = -1 (never) by default. Alg. 1 has no weight decay; its experiments use a
decoupled one (1e-4), as here. The stochastic quantizer draws from a generator seeded per rank
(the exchange's state, checkpointed with the errors), so a resumed run is bit-exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from . import sync
from .base import CommOptimizer
from .lion import apply_update_
from .registry import OptimizerSpec, OptimOptions, register_optimizer


@dataclass
class BinSGDMOptions(OptimOptions):
    t0: int = -1
    """binsgdm: Alg. 1's T0, the step after which b = max(b_prev, b_hat) (AMSGrad's rule); -1 = never
    (the paper does not use it in practice)."""

    def problems(self, world_size: int | None = None) -> list[str]:
        if self.t0 < -1:
            return [f"{self.key('t0')}: {self.t0} must be >= 0, or -1 for no max rule"]
        return []


class BinSGDM(CommOptimizer):
    """BinSGDM Alg. 1 (module docstring) with per-rank m, b_hat (and b when t0 >= 0) as flat fp32
    vectors in the role-ordered layout. `scheme` must be an update-sync mean (comm.mode=compressed)."""

    optim_name = "binsgdm"

    def __init__(self, params: Iterable, lr: float = 1e-4, beta: float = 0.9, weight_decay: float = 0.0, *,
                 t0: int = -1, scheme: str | sync.SyncScheme = "compressed", **comm_kwargs) -> None:
        problems = BinSGDMOptions(t0=t0).problems()
        if problems:
            raise ValueError("; ".join(problems))
        if "plan" not in comm_kwargs:  # built directly: the scheme is one of the plan's keywords
            comm_kwargs["scheme"] = scheme
        super().__init__(params, dict(lr=lr, beta=beta, weight_decay=weight_decay), **comm_kwargs)
        self.t0 = int(t0)
        lay = self.layout
        self.m = torch.zeros(lay.numel, dtype=torch.float32, device=lay.device)
        self.b_hat = torch.zeros_like(self.m)
        self.b: torch.Tensor | None = None    # the max-rule b, from step t0 + 1 on
        self.u = torch.empty_like(self.m)     # |g|, then m/b, then the exchanged update
        self._entries = {id(e.param): e for e in lay.entries}

    def momentum_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        e = self._entries[id(p)]
        return self.m[e.offset:e.offset + e.numel].view_as(p)

    def _update(self, t: int) -> None:
        lay, u = self.layout, self.u
        max_rule = self.t0 >= 0 and t > self.t0
        if max_rule and (self.b is None or t == self.t0 + 1):
            self.b = self.b_hat.clone()       # b_{t0} = bh_{t0}: the max starts from there
        for gi, ks in lay.per_group.items():
            beta = self.param_groups[gi]["beta"]
            grads = [p.grad for p in lay.params(ks)]
            moms, bhs, us = lay.views(self.m, ks), lay.views(self.b_hat, ks), lay.views(u, ks)
            torch._foreach_mul_(moms, beta)
            torch._foreach_add_(moms, grads, alpha=1.0 - beta)
            torch._foreach_copy_(us, grads)
            torch._foreach_abs_(us)
            torch._foreach_mul_(bhs, beta)
            torch._foreach_add_(bhs, us, alpha=1.0 - beta)
        b = self.b_hat
        if max_rule:
            torch.maximum(self.b, self.b_hat, out=self.b)
            b = self.b
        torch.div(self.m, b, out=u)
        u.nan_to_num_(nan=0.0, posinf=1.0, neginf=-1.0)   # b = 0 means m = 0: u = 0
        self.exchange(u, t)                                # in place: u <- the server's Q, +-1
        for gi, ks in lay.per_group.items():
            g = self.param_groups[gi]
            apply_update_(lay.params(ks), lay.views(u, ks), float(g["lr"]), float(g["weight_decay"]))
        return None

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["binsgdm"] = {"m": self.m, "b_hat": self.b_hat, "b": self.b}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        mine = state_dict.pop("binsgdm", None)
        if mine is None:
            raise ValueError("BinSGDM.load_state_dict: no 'binsgdm' entry; was this saved by a different optimizer?")
        for name in ("m", "b_hat"):
            if mine[name].numel() != self.layout.numel:
                raise ValueError(f"BinSGDM.load_state_dict: the checkpoint's {name} has {mine[name].numel()} "
                                 f"elements, this model has {self.layout.numel} trainable ones")
            getattr(self, name).copy_(mine[name])
        self.b = None if mine["b"] is None else mine["b"].to(self.m.device, torch.float32).clone()
        super().load_state_dict(state_dict)


def _compressor_problems(o: sync.SchemeOptions) -> list[str]:
    if getattr(o, "compressor", None) != "binary_stochastic":
        return [f"comm.compressor: {getattr(o, 'compressor', None)!r}; optim.name=binsgdm quantizes m/b with "
                f"BinSGDM's stochastic binary Q (eq. 5): set comm.compressor=binary_stochastic"]
    return []


def _build(groups, *, plan, **runtime):
    # one factor for m and b keeps |m/b| <= 1 (BinSGDM §2): optim.betas[0]
    return BinSGDM(groups, beta=plan.betas[0], t0=plan.optim_options.t0, plan=plan, **runtime)


register_optimizer(OptimizerSpec(
    name="binsgdm", options=BinSGDMOptions, build=_build,
    accepts=lambda s: s.kind == sync.UPDATE and s.result == sync.MEAN,
    needs="an update-sync mean for m/b (comm.mode=compressed with comm.compressor=binary_stochastic)",
    state="m, b (fp32; per rank; a second b with optim.t0 >= 0), the m/b buffer, the worker error (fp32) and "
          "the server error (fp32, 1/P of it)",
    help="BinSGDM Alg. 1: m/b quantized to 1 bit with worker and server error feedback; beta = optim.betas[0]",
    scheme_problems=_compressor_problems,
    state_words=lambda o, s, matrix: 2.0 + (o.t0 >= 0), shards=True))  # m, b_hat, b (u: the exchanged vector, a buffer)
