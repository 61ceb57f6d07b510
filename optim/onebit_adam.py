"""1-bit Adam (Tang et al., "1-bit Adam"; DeepSpeed's OnebitAdam; the Adam baseline of Lion Cub
App. G, Fig. 20) on the communication-owning base, registered as `optim.name=onebit_adam`.

Two stages, on every rank:
1. warm-up, steps t <= freeze_step: exact AdamW (torch's kernel, as optim.adamw) on the fp32
   mean-allreduced gradient (booked in the grad_sync phase), global-norm clipping after the mean;
2. compression, t > freeze_step: the variance is frozen and only the momentum crosses the
   network, through the update-sync scheme (`comm.mode=compressed`, scaled_sign by default):
       m_i = b1 * m + (1 - b1) * g_i             local gradient (each rank clips its own)
       m   = exchange(m_i)                      1-bit compressed mean with worker and server error
                                                feedback; the result replaces the momentum on every
                                                rank (DeepSpeed: exp_avg.set_(compressed_allreduce))
       p  *= 1 - lr * wd;  p -= lr * m / d      d = the frozen denominator, no bias correction
   so the momentum, and with it the parameters, stay identical on every rank.

The switch: at the end of step freeze_step, the bias corrections of that step are folded into
the state once, m <- m / (1 - b1^T) and d = sqrt(v) / sqrt(1 - b2^T) + eps (torch's AdamW
denominator at step T, in its order of operations), and never applied again. DeepSpeed simply stops correcting; its
freeze_step is tens of thousands of steps, where 1 - b^T is 1. With our shorter warm-ups the
factor is not 1 (b2 = 0.999, T = 100: sqrt(1 - b2^T) = 0.31), and dropping it would jump the
step size 3x at the switch; folding it keeps step T + 1 what AdamW's would be with v frozen.
An element whose variance is exactly 0 at the switch (no gradient during the whole warm-up, e.g.
the embedding rows of tokens never seen) gets d = inf: it is not moved, and its momentum is
zeroed after every exchange (DeepSpeed's exp_avg_mask, found automatically: 1-bit codes cannot
carry a 0, and m / eps would blow such an element up).

`zero_one_adam` (0/1 Adam) is not provided: its local steps let the parameters of the ranks
drift apart between synchronisations (an accumulated update is exchanged every few steps), which
breaks this base's invariant that every rank holds the same parameters after every step, and it
sends two different vectors (gradients, then accumulated updates) through the same error buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from . import sync
from .adamw import AdamW
from .registry import OptimizerSpec, OptimOptions, register_optimizer


@dataclass
class OneBitAdamOptions(OptimOptions):
    freeze_step: int = 100
    """onebit_adam: steps of exact AdamW (fp32 gradient allreduce) before the variance freezes and
    only 1-bit momenta cross the network. DeepSpeed's default 100000 exceeds most of our runs;
    the presets use ~15% of the run (BinSGDM §5's 1-bit Adam warm-up: 15 of 100 epochs)."""

    def problems(self, world_size: int | None = None) -> list[str]:
        if self.freeze_step < 1:
            return [f"{self.key('freeze_step')}: {self.freeze_step} must be >= 1 (1-bit Adam needs a warm-up "
                    f"to estimate the variance it freezes)"]
        return []

    def run_problems(self, max_steps: int, *, blocks: int | None = None) -> list[str]:
        if self.freeze_step >= max_steps:
            return [f"{self.key('freeze_step')}: {self.freeze_step} >= train.max_steps={max_steps}: the run would "
                    f"end inside the AdamW warm-up and never compress; set {self.key('freeze_step')} below "
                    f"train.max_steps (e.g. {max(1, max_steps * 15 // 100)}, about 15% of the run)"]
        return []


class OneBitAdam(AdamW):
    """1-bit Adam (module docstring). `scheme` must be an update-sync scheme returning a mean
    (comm.mode=compressed); the warm-up's fp32 gradient allreduce is built here."""

    optim_name = "onebit_adam"

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, freeze_step: int = 100,
                 scheme: str | sync.SyncScheme = "compressed", **comm_kwargs) -> None:
        problems = OneBitAdamOptions(freeze_step=freeze_step).problems()
        if problems:
            raise ValueError("; ".join(problems))
        if "plan" not in comm_kwargs:  # built directly: the scheme is one of the plan's keywords
            comm_kwargs["scheme"] = scheme
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **comm_kwargs)
        self.freeze_step = int(freeze_step)
        fp32 = sync.get("fp32")
        self.grad_exchange = fp32.build(fp32.default_options(), sync.ExchangeContext(
            world_size=self.world_size, rank=self.rank, group=self.group, stats=self.stats["grad_sync"],
            segments=self.layout.segments, device=self.layout.device, kernels=self.kernel_set))
        self.m_flat: torch.Tensor | None = None     # after the freeze: the momentum (role order)
        self.denom: torch.Tensor | None = None      # after the freeze: sqrt(v) / sqrt(1 - b2^T) + eps
        self.dead: torch.Tensor | None = None       # elements with denom = inf, when there are any
        self._entries = {id(e.param): e for e in self.layout.entries}

    @property
    def frozen(self) -> bool:
        return self.m_flat is not None

    def momentum_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        if self.frozen:
            e = self._entries[id(p)]
            return self.m_flat[e.offset:e.offset + e.numel].view_as(p)
        return super().momentum_of(p)

    def _exchange_gradients(self, step: int) -> None:
        if step <= self.freeze_step:  # warm-up: exact AdamW needs the mean gradient
            for buf in self.grad_buffers.values():
                self.grad_exchange(buf, step)

    def _update(self, step: int) -> None:
        if step <= self.freeze_step:
            super()._update(step)
            if step == self.freeze_step:
                self._freeze()
            return None
        lay, m = self.layout, self.m_flat
        for gi, ks in lay.per_group.items():
            beta1 = self.param_groups[gi]["betas"][0]
            moms = lay.views(m, ks)
            torch._foreach_mul_(moms, beta1)
            torch._foreach_add_(moms, [p.grad for p in lay.params(ks)], alpha=1.0 - beta1)
        self.exchange(m, step)      # in place: the compressed mean, identical on every rank
        if self.dead is not None:
            m.masked_fill_(self.dead, 0.0)
        for gi, ks in lay.per_group.items():
            g = self.param_groups[gi]
            params, lr, wd = lay.params(ks), float(g["lr"]), float(g["weight_decay"])
            if wd != 0.0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            torch._foreach_addcdiv_(params, lay.views(m, ks), lay.views(self.denom, ks), value=-lr)
        return None

    def _freeze(self) -> None:
        """End of step freeze_step: momentum and frozen denominator from torch's AdamW state with
        that step's bias corrections folded in (module docstring); the inner state is dropped."""
        lay = self.layout
        m = torch.zeros(lay.numel, dtype=torch.float32, device=lay.device)
        d = torch.zeros_like(m)
        for gi, ks in lay.per_group.items():
            g = self.param_groups[gi]
            beta1, beta2 = g["betas"]
            for k, mv, dv in zip(ks, lay.views(m, ks), lay.views(d, ks)):
                st = self.inner.state[lay.entries[k].param]
                t = float(st["step"])
                torch.div(st["exp_avg"], 1.0 - beta1 ** t, out=mv)
                v = st["exp_avg_sq"]
                torch.sqrt(v, out=dv).div_(math.sqrt(1.0 - beta2 ** t)).add_(g["eps"])
                dv.masked_fill_(v == 0, math.inf)
        self.inner.state.clear()
        self.m_flat, self.denom = m, d
        self._set_dead()

    def _set_dead(self) -> None:
        dead = torch.isinf(self.denom)
        self.dead = dead if bool(dead.any()) else None
        if self.dead is not None:
            self.m_flat.masked_fill_(self.dead, 0.0)

    def state_dict(self) -> dict:
        sd = super().state_dict()
        # a dead element's denominator (inf in memory) is stored as 0: checkpoints hold finite values
        # only (the trainer refuses to save anything else), and a live denominator is > 0
        sd["frozen"] = {"exp_avg": self.m_flat, "denom": self.denom if self.dead is None else
                        self.denom.masked_fill(self.dead, 0.0)} if self.frozen else None
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        frozen = state_dict.get("frozen")
        if (frozen is not None) != (self.steps_done >= self.freeze_step):
            raise ValueError(f"OneBitAdam.load_state_dict: the checkpoint is at step {self.steps_done} "
                             f"{'with' if frozen is not None else 'without'} a frozen variance, but "
                             f"optim.freeze_step={self.freeze_step}; resume with the run's freeze_step")
        if frozen is None:
            self.m_flat = self.denom = self.dead = None
            return
        self.m_flat = frozen["exp_avg"].to(device=self.layout.device, dtype=torch.float32).clone()
        self.denom = frozen["denom"].to(device=self.layout.device, dtype=torch.float32).clone()
        self.denom.masked_fill_(self.denom == 0, math.inf)  # state_dict's encoding of a dead element
        if self.m_flat.numel() != self.layout.numel:
            raise ValueError(f"OneBitAdam.load_state_dict: the checkpoint holds {self.m_flat.numel()} momentum "
                             f"elements, this model has {self.layout.numel} trainable ones")
        self._set_dead()


def _compressor_problems(o: sync.SchemeOptions) -> list[str]:
    if getattr(o, "compressor", None) == "binary_stochastic":
        return ["comm.compressor: binary_stochastic codes +-1 with |y| <= 1 (BinSGDM's m/b), not a momentum; "
                "optim.name=onebit_adam needs comm.compressor=scaled_sign (1-bit Adam) or int4"]
    return []


def _build(groups, *, plan, **runtime):
    return OneBitAdam(groups, betas=plan.betas, eps=plan.eps, freeze_step=plan.optim_options.freeze_step, plan=plan,
                      **runtime)


register_optimizer(OptimizerSpec(
    name="onebit_adam", options=OneBitAdamOptions, build=_build,
    accepts=lambda s: s.kind == sync.UPDATE and s.result == sync.MEAN,
    needs="an update-sync mean for its momentum (comm.mode=compressed)",
    state="m, v (fp32); after freeze_step m and the frozen denominator, plus the worker error (fp32) and "
          "the server error (fp32, 1/P of it)",
    help="1-bit Adam: AdamW warm-up with fp32 gradients, then frozen variance and 1-bit momenta with error feedback",
    scheme_problems=_compressor_problems,
    state_words=lambda o, s, matrix: 2.0, shards=True))  # m, v; after freeze_step m and the frozen denominator
