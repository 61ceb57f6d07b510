"""Update-sync distributed Lion: Distributed Lion (Liu et al.) and Lion Cub (Ishikawa et al.).

Every rank keeps its own momentum m_i and never sends gradients (Distributed Lion §2.2, Alg. 1;
Lion Cub App. F.1, Alg. 1). One step, on every rank i:
    c_i   = b1 * m_i + (1 - b1) * g_i             local update direction ("c_local")
    agg   = exchange(c_i)                         one collective on ONE flat buffer (Lion Cub App. D.2)
    theta = theta * (1 - lr*wd) - lr * agg         agg = sign(...) in {-1, 0, +1}, or mean of votes (Avg)
    m_i   = b2 * m_i + (1 - b2) * g_i              local gradient
    optional: m_i <- mean_j m_j for selected layers on a schedule (Lion Cub §5; optim/base.py)
`agg` is identical on every rank, so parameters stay bit-identical across ranks. How c crosses the
network is the sync scheme's business (optim/sync: onebit, pbit, ps, hierarchical, or any
registered scheme whose result is a sign); this module is only the Lion math around it.
"""
from __future__ import annotations

from typing import Iterable

import torch

from . import sync
from .base import CommOptimizer
from .diagnostics import vote_diagnostics
from .lion import (Lion, fused_apply_update_, fused_lion_direction_, fused_momentum_update_,
                   lion_direction_momentum_over_grad_, warmup_fused_passes)
from .registry import NoOptions, OptimizerSpec, gradient_mean, register_optimizer

SCRATCH_MIN = 1 << 21  # elements (8 MiB of fp32): the least scratch c is made in, wave by wave
SCRATCH_PARTS = 8      # ... or 1/8 of the model (0.5 B per parameter), whichever is larger: few waves on a GPU


def c_buffer_elements(numel: int, separate: bool) -> int:
    """Elements of the buffer Distributed Lion holds c in, for `numel` trainable elements: all of
    them when c is `separate` (comm.overlap), else the wave scratch of c over the gradient (a
    multiple of 64, so pieces of a tensor are cut at vector-width multiples)."""
    if separate:
        return numel
    cap = max(SCRATCH_MIN, -(-numel // SCRATCH_PARTS))
    return min(numel, -(-cap // 64) * 64)


class DistributedLion(CommOptimizer):
    """Distributed Lion / Lion Cub with per-rank momentum over an update-sync scheme.

    Param groups may carry "role" (embedding/head/attn/mlp/norm; used by momentum sync and the
    per-layer diagnostics), "names" and "layers"; lr and weight_decay are read from the group every
    step. Steps are counted from 1 (the t of the tie break)."""

    optim_name = "lion"

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, scheme: str | sync.SyncScheme = "onebit", **comm_kwargs) -> None:
        if "plan" not in comm_kwargs:  # built directly: the scheme is one of the plan's keywords
            comm_kwargs["scheme"] = scheme
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), **comm_kwargs)
        # which update-sync schemes fit is the registry's entry "lion"; this class is its per-rank half
        if not self.strategy.exchanges_own_vector:
            raise ValueError(f"DistributedLion keeps a momentum per rank and needs an update-sync comm.mode, not "
                             f"{self.scheme.name}; build_optimizer('lion', ...) builds Lion for gradient sync")
        # c over the gradient: c is made wave by wave in a small scratch and written over g, and m is
        # updated in the same pass (both from the old m; nothing else reads g in the step), so the step
        # holds no c of the model's size (Lion itself makes its update direction per step). Not with
        # comm.overlap: there c is made per bucket during backward, before the divergence guard has
        # seen the whole gradient, and m must not move on a step the guard then skips.
        dtypes = {e.param.dtype for e in self.layout.entries}
        self.c_in_grad = not (self.overlap and self._buckets is not None) and len(dtypes) == 1
        if self.c_in_grad:
            self._order_grads([e.param for e in self.layout.entries])  # the grad buffer in c's layout
            self._scratch_numel = c_buffer_elements(self.layout.numel, separate=False)
            self._scratch: torch.Tensor | None = None
            # an empty tensor at the end of the bucket-ordered layout lies in no bucket: its momentum is
            # made here, where the buckets' c pass would have made it
            self._empty = [e.param for e in self.layout.entries if e.numel == 0]
        self._c: torch.Tensor | None = None
        self.keep_c = self.layout.device.type != "cuda"

    def _warmup_own_kernels(self) -> float:
        return warmup_fused_passes(self.layout.device, impl=self.kernels)

    @property
    def scratch(self) -> torch.Tensor:
        """The wave buffer of c over the gradient (kept: a small fraction of the model)."""
        if self._scratch is None:
            self._scratch = torch.empty(self._scratch_numel, dtype=self.layout.dtype, device=self.layout.device)
        return self._scratch

    def _c_over_grad_(self, ks: list[int]) -> None:
        """c over the gradient of entries ks (one param group's, in layout order), m updated."""
        lay = self.layout
        gi = lay.entries[ks[0]].group
        b1, b2 = self.param_groups[gi]["betas"]
        params = lay.params(ks)
        lion_direction_momentum_over_grad_([self._momentum(p) for p in params], [p.grad for p in params], b1, b2,
                                           self.scratch, impl=self.kernels)

    @property
    def c_flat(self) -> torch.Tensor:
        """The flat buffer of c for this step. On CUDA it lives only from the step's first use of
        it (its c pass, or the first bucket with overlap) to the end of `_update`: the caching
        allocator hands back the same block every step, and outside the step the memory serves
        the activations, so peak memory does not carry a persistent c on top of the backward
        pass's peak (Lion itself makes its update direction per step). On CPU (keep_c) it is
        kept: a fresh 4 bytes per parameter every step would be page-faulted in every step."""
        if self._c is None:
            self._c = self.layout.new_flat()
        return self._c

    def momentum_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        return self.state[p].get("exp_avg")


    def _momentum(self, p: torch.nn.Parameter) -> torch.Tensor:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["exp_avg"]

    def _bucket_vector(self, b) -> torch.Tensor:
        """c of bucket b (its entries are contiguous in the bucket-ordered layout)."""
        lay = self.layout
        if self.c_in_grad:
            mine = [k for k in range(len(lay.entries)) if b.lo <= lay.entries[k].offset < b.hi]
            for ks in _runs_by_group(lay, mine):
                self._c_over_grad_(ks)
            return self._grad_flat()[b.lo:b.hi]
        for k in range(len(lay.entries)):
            e = lay.entries[k]
            if b.lo <= e.offset < b.hi:
                fused_lion_direction_([self._momentum(e.param)], [e.param.grad],
                                        self.param_groups[e.group]["betas"][0], lay.views(self.c_flat, [k]),
                                        impl=self.kernels)
        return self.c_flat[b.lo:b.hi]

    def _grad_flat(self) -> torch.Tensor:
        (buf,) = self.grads.buffers.values()
        return buf

    def _update(self, t: int) -> dict:
        if self.c_in_grad:
            return self._update_over_grad(t)
        lay, c = self.layout, self.c_flat
        grads_by_group, moms_by_group = {}, {}
        for gi, ks in lay.per_group.items():
            params = lay.params(ks)
            grads_by_group[gi], moms_by_group[gi] = [p.grad for p in params], [self._momentum(p) for p in params]
            if self._buckets is None:
                fused_lion_direction_(moms_by_group[gi], grads_by_group[gi], self.param_groups[gi]["betas"][0],
                                        lay.views(c, ks), impl=self.kernels)

        update = self._exchange_c(c, t)
        self._apply(update)
        for gi in lay.per_group:
            fused_momentum_update_(moms_by_group[gi], grads_by_group[gi], self.param_groups[gi]["betas"][1],
                                   impl=self.kernels)
        if not self.keep_c:
            self._c = None  # freed once the caller drops the returned c (diagnostics read it)
        return {"c": c, "update": update}

    def _update_over_grad(self, t: int) -> dict:
        """_update with c over the gradient: c and m's update in one pass (bucket by bucket when
        buckets), the exchange, then the parameters."""
        lay, c = self.layout, self._grad_flat()
        if self._buckets is None:
            for ks in lay.per_group.values():
                self._c_over_grad_(ks)
        else:
            for p in self._empty:
                self._momentum(p)
        update = self._exchange_c(c, t)
        self._apply(update)
        return {"c": c, "update": update}

    def _exchange_c(self, c: torch.Tensor, t: int) -> torch.Tensor:
        """The aggregate of c: int8 signs (a mean of votes for the parameter server's avg); with
        buckets one exchange per bucket (launched during backward with overlap)."""
        if self._buckets is None:
            return self.exchange(c, t)
        parts = self._bucket_results if self._bucket_results is not None else self._buckets.finish(t)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _apply(self, update: torch.Tensor) -> None:
        """theta = theta * (1 - lr*wd) - lr * update, per param group."""
        lay, sign = self.layout, not update.is_floating_point()
        for gi, ks in lay.per_group.items():
            g = self.param_groups[gi]
            fused_apply_update_(lay.params(ks), lay.views(update, ks), float(g["lr"]), float(g["weight_decay"]),
                                u_is_sign=sign, impl=self.kernels)

    def _diagnostics(self, out: dict | None):
        return vote_diagnostics(out["c"], out["update"], self.layout, world_size=self.world_size, group=self.group,
                                stats=self.stats["diag"], shard_group=self.shard_group)


def _runs_by_group(lay, ks: list[int]) -> list[list[int]]:
    """ks (layout order) grouped by param group, each group's entries in layout order."""
    by: dict[int, list[int]] = {}
    for k in ks:
        by.setdefault(lay.entries[k].group, []).append(k)
    return list(by.values())


def _build_lion(groups, *, plan, **runtime) -> CommOptimizer:
    """Lion where the strategy exchanges the gradient (gradient sync: one momentum), Distributed
    Lion / Lion Cub where the optimizer hands the exchange its own vector (update sync). The entry
    lives here, beside the update-sync class, because it builds both: optim/lion.py stays the
    single-momentum Lion and its passes, which this module imports."""
    cls = DistributedLion if plan.strategy.exchanges_own_vector else Lion
    return cls(groups, betas=plan.betas, plan=plan, **runtime)


register_optimizer(OptimizerSpec(
    name="lion", options=NoOptions, build=_build_lion,
    accepts=lambda s: gradient_mean(s) or (s.kind == sync.UPDATE and s.result == sync.SIGN),
    needs="a gradient-sync scheme (global Lion) or an update-sync sign aggregate (Distributed Lion / Lion Cub)",
    state="m (fp32; per rank with update sync)",
    help="Lion; with an update-sync scheme, Distributed Lion / Lion Cub (per-rank momentum)",
    state_words=lambda o, s, matrix: 1.0, shards=True,
    update_buffer=c_buffer_elements))  # c over the gradient: a wave scratch
