"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms") with foreach kernels.

Per step, for every trainable parameter:
    p *= 1 - lr * wd                       (decoupled weight decay)
    p -= lr * sign(b1 * m + (1 - b1) * g)  (the update direction c, Lion Cub Alg. 1 line 3)
    m  = b2 * m + (1 - b2) * g
lr and weight_decay are read from each param group at every step, so schedulers (and the
trainer's group["lr"] = schedule_lr * group["lr_mult"]) take effect immediately.

The three foreach kernels below are shared with the update-sync optimizer (optim/lioncub.py) so
that at world size 1 it reproduces this class bit for bit wherever c != 0; where c == 0 exactly, a
1-bit vote's tie break moves the element by +-lr (Lion's sign gives 0) unless mask_zero_updates is
on. Gradient sync and clipping happen in the base (optim/base.py) before `_update`.

The fused passes (`fused_*`, compiled through comm.kernels' dispatch, `comm.kernels` = compiled /
eager / auto) give the foreach kernels' bytes. Exactness: eager CPU (AVX2/AVX-512 kernels) and
CUDA compute `m.add_(g, alpha=a)` as one fused multiply-add, fma(g, a, m). Inductor lowers that to
an fma on CUDA, but its C++ backend has none and rounds a*g first, so on CPU `_fma32` computes the
correctly rounded float32 fma exactly in float64: the product of two floats is exact in float64,
TwoSum gives the rounding error of the sum, and the one case where rounding the float64 sum to
float32 is wrong (the sum is exactly halfway between two floats while the exact value is not) is
detected and fixed. That costs arithmetic: on one CPU core the compiled passes are compute-bound
(see bench.packing), so "auto" keeps the foreach kernels on CPU. Python-float hyperparameters are
rounded to float32 on the host first, as ATen casts a scalar to the tensor's type.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from comm import kernels

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


# ---- fused passes (compiled; the foreach kernels above are their reference) ----------------
_TWO128 = 2.0 ** 128


def _fma32(a: torch.Tensor, b: float, c: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 fma(a, b, c) (b a float32 value): what eager computes for
    c.add_(a, alpha=b). On CUDA inductor lowers add-with-alpha to a hardware fma itself (to match
    eager CUDA); on CPU it has no fma, so it is computed exactly in float64 ops:

    s = a*b + c in float64 (the product is exact); err = the rounding error of that sum (TwoSum).
    float32(s) is the correct rounding of the exact value unless s lies exactly halfway between
    two floats r and o (then o = 2s - r is a float) while err != 0: the exact value is then on
    err's side of s, so the answer is whichever of r, o lies that way. Every product here is
    exact, so a backend that contracts mul+add into fma changes nothing. r = inf at the overflow
    threshold is clamped to 2**128 so the halfway test also covers FLT_MAX vs inf."""
    if a.device.type == "cuda":
        return torch.add(c, a, alpha=b)
    p = a.to(torch.float64) * b
    cd = c.to(torch.float64)
    s = p + cd
    r = s.to(torch.float32)
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    rd = r.to(torch.float64).clamp(-_TWO128, _TWO128)
    other = 2.0 * s - rd
    o32 = other.to(torch.float32)
    # nested where: inductor's C++ backend makes `&` of float64 masks very slow
    return torch.where((other - rd) * err > 0, torch.where(o32.to(torch.float64) == other, o32, r), r)


def _k_direction(m: torch.Tensor, g: torch.Tensor, b1: float, a1: float, out: torch.Tensor) -> None:
    """c = fl(m * b1) then fma(g, 1 - b1, c): lion_direction's rounding."""
    out.copy_(_fma32(g, a1, m * b1))


def _k_momentum(m: torch.Tensor, g: torch.Tensor, b2: float, a2: float) -> None:
    """m = fma(g, 1 - b2, fl(m * b2)): momentum_update_'s rounding."""
    m.copy_(_fma32(g, a2, m * b2))


def _k_direction_momentum(m: torch.Tensor, g: torch.Tensor, b1: float, a1: float, b2: float,
                          a2: float, out: torch.Tensor) -> None:
    """Both of the above from the old m in one pass (m is not read between them in a step)."""
    c = _fma32(g, a1, m * b1)
    m2 = _fma32(g, a2, m * b2)
    out.copy_(c)
    m.copy_(m2)


def _k_apply(p: torch.Tensor, u: torch.Tensor, s: float, alpha: float, u_is_sign: bool) -> None:
    """p = fma(u, -lr, fl(p * (1 - lr*wd))); with u in {-1, 0, 1} the product is exact and a
    plain add rounds identically."""
    p1 = p * s
    uf = u.to(torch.float32)
    p.copy_(p1 + uf * alpha if u_is_sign else _fma32(uf, alpha, p1))


# ---- the Lion passes ---------------------------------------------------------------------------
def _lion_compiled(tensors: Sequence[torch.Tensor], impl: str | None) -> bool:
    if not tensors:
        return False
    dev = tensors[0].device
    # CUDA: Triton contracts a multiply with the add that follows it into one fma where the eager
    # kernels round the product first (fl(m*b1), then fma(g, 1-b1, .)): compiled c, m and p were
    # 1 ulp off eager on an H100 (torch 2.11, Triton 3.6). So the Lion passes stay on the foreach
    # kernels there (the reference, and on CUDA already multi-tensor kernels), for every impl.
    if dev.type == "cuda":
        return False
    # "auto" keeps the foreach kernels on CPU: the exact fma emulation makes the compiled passes
    # slower there (bench.packing); "compiled" still compiles them
    if dev.type == "cpu" and kernels.resolve_impl(impl) == "auto":
        return False
    if not kernels.use_compiled(impl, dev):
        return False
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def fused_lion_direction_(exp_avgs: list[torch.Tensor], grads: list[torch.Tensor], beta1: float,
                    out: list[torch.Tensor], *, impl: str | None = None) -> list[torch.Tensor]:
    """c = b1 * m + (1 - b1) * g into `out` (e.g. views of a flat buffer); == lion_direction(exp_avgs,
    grads, beta1, out=out) bit for bit."""
    if not _lion_compiled(list(exp_avgs) + list(grads) + list(out), impl):
        return lion_direction(exp_avgs, grads, beta1, out=out)
    b1, a1 = kernels.f32(beta1), kernels.f32(1.0 - beta1)
    for m, g, o in zip(exp_avgs, grads, out, strict=True):
        if m.numel() < kernels.SMALL:
            lion_direction([m], [g], beta1, out=[o])
        else:
            kernels.compiled_kernel(_k_direction)((m.device.type,), m.view(-1), g.view(-1), b1, a1, o.view(-1))
    return out


def fused_momentum_update_(exp_avgs: list[torch.Tensor], grads: list[torch.Tensor], beta2: float, *,
                     impl: str | None = None) -> None:
    """m = b2 * m + (1 - b2) * g; == momentum_update_ bit for bit."""
    if not _lion_compiled(list(exp_avgs) + list(grads), impl):
        return momentum_update_(exp_avgs, grads, beta2)
    b2, a2 = kernels.f32(beta2), kernels.f32(1.0 - beta2)
    for m, g in zip(exp_avgs, grads, strict=True):
        if m.numel() < kernels.SMALL:
            momentum_update_([m], [g], beta2)
        else:
            kernels.compiled_kernel(_k_momentum)((m.device.type,), m.view(-1), g.view(-1), b2, a2)


def fused_lion_direction_momentum_(exp_avgs: list[torch.Tensor], grads: list[torch.Tensor], beta1: float,
                             beta2: float, out: list[torch.Tensor], *,
                             impl: str | None = None) -> list[torch.Tensor]:
    """fused_lion_direction_ then fused_momentum_update_ in one pass over m and g: c (into out) from the old
    m, then m updated. Exact as a reordering because nothing between the two passes of a Lion Cub
    step reads m (Alg. 1: the vote needs c only)."""
    if not _lion_compiled(list(exp_avgs) + list(grads) + list(out), impl):
        lion_direction(exp_avgs, grads, beta1, out=out)
        momentum_update_(exp_avgs, grads, beta2)
        return out
    b1, a1, b2, a2 = kernels.f32(beta1), kernels.f32(1.0 - beta1), kernels.f32(beta2), kernels.f32(1.0 - beta2)
    for m, g, o in zip(exp_avgs, grads, out, strict=True):
        if m.numel() < kernels.SMALL:
            lion_direction([m], [g], beta1, out=[o])
            momentum_update_([m], [g], beta2)
        else:
            kernels.compiled_kernel(_k_direction_momentum)((m.device.type,), m.view(-1), g.view(-1), b1, a1, b2, a2,
                                                           o.view(-1))
    return out


def waves(sizes: Sequence[int], cap: int) -> list[list[tuple[int, int, int]]]:
    """Cut tensors of `sizes` elements (in order) into waves of at most `cap` elements: each wave a
    list of (tensor index, lo, hi) pieces. A tensor that fits a wave is never split; a larger one
    is cut at multiples of `cap` from its own start (a multiple of every vector width when cap is),
    so each element keeps its place relative to its tensor's vectorized loop."""
    out: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    room = cap
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if n > room and cur:  # does not fit what is left: close this wave
            out.append(cur)
            cur, room = [], cap
        for lo in range(0, n, cap):
            hi = min(n, lo + cap)
            cur.append((i, lo, hi))
            room -= hi - lo
            if room == 0:
                out.append(cur)
                cur, room = [], cap
    if cur:
        out.append(cur)
    return out


def lion_direction_momentum_over_grad_(exp_avgs: list[torch.Tensor], grads: list[torch.Tensor], beta1: float,
                                       beta2: float, scratch: torch.Tensor, *, impl: str | None = None) -> None:
    """c = b1 * m + (1 - b1) * g written OVER g, and m = b2 * m + (1 - b2) * g, with c held only in
    `scratch` (any size) wave by wave: the step needs no c buffer of the model's size (Lion Cub
    Alg. 1: g is read by c and by m's update only, both from the old m). Bit for bit
    fused_lion_direction_momentum_ with out = a separate c, then c copied into g."""
    flat_m = [m.view(-1) for m in exp_avgs]
    flat_g = [g.view(-1) for g in grads]
    for wave in waves([m.numel() for m in flat_m], scratch.numel()):
        ms = [flat_m[i][lo:hi] for i, lo, hi in wave]
        gs = [flat_g[i][lo:hi] for i, lo, hi in wave]
        outs, off = [], 0
        for _, lo, hi in wave:
            outs.append(scratch[off:off + hi - lo])
            off += hi - lo
        fused_lion_direction_momentum_(ms, gs, beta1, beta2, outs, impl=impl)
        torch._foreach_copy_(gs, outs)


def fused_apply_update_(params: list[torch.Tensor], updates: list[torch.Tensor], lr: float, weight_decay: float,
                  *, u_is_sign: bool = False, impl: str | None = None) -> None:
    """p = p * (1 - lr*wd) - lr * u; == apply_update_ bit for bit. u_is_sign: the
    caller promises u in {-1, 0, +1} (a vote's sign; any dtype), which makes lr*u exact and
    the pass cheaper; a mean of votes (D-Lion Avg) must leave it False."""
    if not _lion_compiled(list(params), impl) or any(not u.is_contiguous() for u in updates):
        return apply_update_(params, updates, lr, weight_decay)
    s, alpha = kernels.f32(1.0 - lr * weight_decay), kernels.f32(-lr)
    for p, u in zip(params, updates, strict=True):
        if p.numel() < kernels.SMALL or not (u.dtype == torch.float32 or (u_is_sign and u.dtype == torch.int8)):
            apply_update_([p], [u], lr, weight_decay)
        else:
            kernels.compiled_kernel(_k_apply, u_is_sign)((p.device.type, kernels.dtype_key(u)), p.view(-1), u.view(-1),
                                                         s, alpha)


def warmup_fused_passes(device: torch.device | str = "cpu", *, impl: str | None = None, check: bool = True) -> float:
    """Compile the fused Lion passes for `device` (and with check=True verify them against the
    foreach kernels) before the first timed step; 0 where they run the foreach kernels (CUDA, CPU
    under "auto", eager). A mismatch follows comm.kernels.report_mismatch."""
    device = torch.device(device)
    if device.type == "cuda" or kernels.resolve_impl(impl) == "auto" or not kernels.use_compiled(impl, device):
        return 0.0
    t0 = time.perf_counter()
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    n = 4 * kernels.SMALL + 13
    m = torch.randn(n, generator=gen, device=device)
    g = torch.randn(n, generator=gen, device=device)
    m[:7] = 0.0
    bad: list[str] = []

    def same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if check and not torch.equal(a, b):
            bad.append(name)

    o1, o2, m1, m2 = torch.empty_like(m), torch.empty_like(m), m.clone(), m.clone()
    fused_lion_direction_momentum_([m1], [g], 0.9, 0.99, [o1], impl="compiled")
    lion_direction([m2], [g], 0.9, out=[o2])
    momentum_update_([m2], [g], 0.99)
    same("lion_direction_momentum_", torch.stack([o1, m1]), torch.stack([o2, m2]))
    fused_lion_direction_([m1], [g], 0.9, [o1], impl="compiled")
    lion_direction([m2], [g], 0.9, out=[o2])
    fused_momentum_update_([m1], [g], 0.99, impl="compiled")
    momentum_update_([m2], [g], 0.99)
    same("lion_direction_/momentum_update_", torch.stack([o1, m1]), torch.stack([o2, m2]))
    for u, sgn in ((torch.sign(g), True), (g, False), (torch.sign(g).to(torch.int8), True)):
        p1, p2 = m.clone(), m.clone()
        fused_apply_update_([p1], [u], 1e-3, 0.1, u_is_sign=sgn, impl="compiled")
        apply_update_([p2], [u], 1e-3, 0.1)
        same(f"apply_update_[{u.dtype},sign={sgn}]", p1, p2)
    kernels.report_mismatch(bad, device, impl)
    return time.perf_counter() - t0


class Lion(CommOptimizer):
    """Lion on one shared state (gradient sync, or one process): every rank averages its gradient
    through the scheme (fp32 / bf16 allreduce), then takes the same step."""

    optim_name = "lion"

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, **comm_kwargs) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), **comm_kwargs)
        if self.scheme.per_rank_state:  # which schemes fit "lion" is its registry entry's to say (the base asks it)
            raise ValueError(f"Lion steps one shared state and needs a gradient-sync comm.mode, not {self.scheme.name}; "
                             f"build_optimizer('lion', ...) builds DistributedLion for update sync")

    def momentum_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        return self.state[p].get("exp_avg")

    def _update(self, step: int) -> None:
        for gi, ks in self.layout.per_group.items():
            lion_group_step_(self.state, self.param_groups[gi], self.layout.params(ks))
