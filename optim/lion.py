"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms"): foreach kernels, and one fused pass.

Per step, for every trainable parameter:
    p *= 1 - lr * wd                       (decoupled weight decay)
    p -= lr * sign(b1 * m + (1 - b1) * g)  (the update direction c, Lion Cub Alg. 1 line 3)
    m  = b2 * m + (1 - b2) * g
lr and weight_decay are read from each param group at every step, so schedulers (and the
trainer's group["lr"] = schedule_lr * group["lr_mult"]) take effect immediately.

The three foreach kernels below are the reference. They are shared with the update-sync optimizer
(optim/lioncub.py) so that at world size 1 it reproduces this class bit for bit wherever c != 0;
where c == 0 exactly, a 1-bit vote's tie break moves the element by +-lr (Lion's sign gives 0)
unless mask_zero_updates is on. Gradient sync and clipping happen in the base (optim/base.py)
before `_update`.

The fused step (`FusedLionStep`: comm.kernels=auto on CUDA, =compiled anywhere) does the whole
update in one compiled pass per tensor that reads p, g and m once and writes p and m (20 bytes
an element where the seven foreach passes move 60), all tensors of a step in one compiled graph.
Under auto on CUDA its kernels replay from a CUDA graph (optim.lion_cuda.GraphedLionStep: the same
kernels and bytes, a fraction of the host time); =compiled keeps the plain pass.
It rounds as the foreach kernels do: ATen computes `m.add_(g, alpha=a)` as one fused multiply-add
fma(g, a, m) (its vectorized CPU kernels and its CUDA kernels), so the pass spells that fma out
(inductor's fma op) and keeps every product that eager rounds (fl(m * b1), fl(p * (1 - lr*wd)))
a separate, rounded multiply: on CUDA it compiles without Triton's fp fusion, which would contract
that multiply into the next add. Where inductor's Triton fma flushes subnormals to zero (libdevice's
fma under Triton's default flush-to-zero reflection), the warm-up's check finds it and the step
computes its fmas exactly in float64 ops instead (`_fma64`). Every rank runs the same kernel on the same values, so replicas
stay bit-identical whatever the kernel's rounding; tests/optim/test_lion_fused.py checks the bytes
against the foreach kernels on CPU and, on a GPU, on CUDA.

The Lion Cub passes (`fused_*`, compiled through comm.kernels' dispatch) use the same fma. On CPU
"auto" keeps them on the foreach kernels (inductor's imports cost a process 60-150 MiB); on CUDA
they stay on the foreach kernels for every impl until a GPU run has checked them (see
`_lion_compiled`). Python-float hyperparameters are rounded to float32 on the host first, as ATen
casts a scalar to the tensor's type.
"""
from __future__ import annotations

import time
import types
import warnings
from collections.abc import Iterable, Sequence

import torch

from comm import kernels

from .base import CommOptimizer
from .lion_cuda import GraphCaptureError, GraphedLionStep


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
def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once (inductor's fma op: std::fma / fmadd in C++, tl.fma in Triton). Only
    traced: prims.fma's eager fallback rounds the product first."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers prims.fma)

    return torch.ops.prims.fma(a, b, c)


_TWO128 = 2.0 ** 128


def _fma64(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 a * b + c computed in float64 ops, for a backend whose fma op
    flushes subnormals (libdevice's fma under Triton's default flush-to-zero reflection; plain
    float32 and float64 arithmetic keep them). s = a*b + c in float64 (the product is exact);
    err = the rounding error of that sum (TwoSum). float32(s) is the correct rounding unless s lies
    exactly halfway between two floats r and o = 2s - r while err != 0: the exact value then lies
    on err's side of s. r = inf at the overflow threshold is clamped to 2**128 so the halfway test
    also covers FLT_MAX vs inf. Every product is exact, so contracting a multiply into an add
    changes nothing."""
    p = a.to(torch.float64) * b.to(torch.float64)
    cd = c.to(torch.float64)
    s = p + cd
    r = s.to(torch.float32)
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    rd = r.to(torch.float64).clamp(-_TWO128, _TWO128)
    other = 2.0 * s - rd
    o32 = other.to(torch.float32)
    return torch.where((other - rd) * err > 0, torch.where(o32.to(torch.float64) == other, o32, r), r)


def _fma32(a: torch.Tensor, b: float, c: torch.Tensor) -> torch.Tensor:
    """fma(a, b, c) for a float32 scalar b: what eager computes for c.add_(a, alpha=b) (one fused
    multiply-add in ATen's vectorized CPU kernels and in CUDA's)."""
    return _fma(a, torch.ones_like(a) * b, c)  # not full_like: that specialises the graph on b


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
    # kernels round the product first (fl(m*b1), then fma(g, 1-b1, .)), so compiled c, m and p can
    # differ from eager by an ulp (docs/results/code_notes.md). So the Lion passes stay on the foreach
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


# ---- Lion's whole step as one pass per tensor ----------------------------------------------------
def _k_lion_step(params: list[torch.Tensor], grads: list[torch.Tensor], moms: list[torch.Tensor],
                 hyper: torch.Tensor) -> None:
    """Traced body of the fused step. hyper[k] = (s, -lr, b1, 1 - b1, b2, 1 - b2) of param group k as
    float32 (s = 1 - lr*wd), tensor i in group _STEP_ROWS[i]: c = fma(g, 1-b1, fl(m*b1)); p = fma(sign
    c, -lr, fl(p*s)); m = fma(g, 1-b2, fl(m*b2)) from the old m: lion_group_step_'s roundings (with
    wd = 0, s = 1 and p*1 = p). `_STEP_FMA` is the fma; both are globals that FusedLionStep gives each
    instance (one row per group, not per tensor: tensors of one shape and one group then read the same
    row, which lets inductor put them in one kernel)."""
    fma = _STEP_FMA
    for i, (p, g, m) in enumerate(zip(params, grads, moms)):
        h = hyper[_STEP_ROWS[i]]
        c = fma(g, h[3].expand_as(g), m * h[2])
        m_new = fma(g, h[5].expand_as(g), m * h[4])
        p.copy_(fma(torch.sign(c), h[1].expand_as(p), p * h[0]))
        m.copy_(m_new)


_STEP_FMA = _fma
_STEP_ROWS: tuple[int, ...] = ()
FMA_VARIANTS = {"fma": _fma, "fma64": _fma64}
"""How the fused step computes its fmas: inductor's fma op (one instruction), or exactly in float64
ops (for an inductor whose Triton fma flushes subnormals to zero); the warm-up keeps the first whose
bytes equal the foreach kernels'."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel writes: a parameter's data outside autograd."""
    return t.detach() if t.requires_grad else t


class FusedLionStep:
    """Lion's step over every parameter of an optimizer as one compiled graph (one pass per
    tensor). Compiled once for the optimizer's shapes (dynamic=False: the kernels are specialised
    to them); lr and weight decay travel as a small float32 tensor, so a schedule never recompiles.
    Each instance traces its own copy of the kernel's code: dynamo keeps at most 8 graphs per code
    object, and a process may build many optimizers (tests do)."""

    def __init__(self, device: torch.device | str, fma: str = "fma") -> None:
        self.device, self.fma = torch.device(device), fma
        self._run, self._rows = None, None
        self.calls = 0

    def _build(self, rows: tuple[int, ...]) -> None:
        """Compile the step for tensors in groups `rows` (the optimizer's layout: built once)."""
        name = f"lion_step_{id(self):x}"
        code = _k_lion_step.__code__.replace(co_name=name)
        if hasattr(code, "co_qualname"):
            code = code.replace(co_qualname=name)
        scope = {**_k_lion_step.__globals__, "_STEP_FMA": FMA_VARIANTS[self.fma], "_STEP_ROWS": rows}
        fn = types.FunctionType(code, scope, name)
        # eager rounds each product before the add that follows it; Triton's fp fusion would not
        options = {"emulate_precision_casts": True} if self.device.type == "cuda" else {}
        self._run, self._rows = torch.compile(fn, dynamic=False, fullgraph=True, options=options), rows

    @staticmethod
    def fits(params: Sequence[torch.Tensor]) -> str | None:
        """Why the fused step cannot take these parameters (None when it can): float32, plain
        (a sharded DTensor steps on its shards through the foreach kernels), dense, contiguous,
        gradients alike."""
        for p in params:
            g = p.grad
            if type(p.data) is not torch.Tensor or (g is not None and type(g) is not torch.Tensor):
                return "a parameter or gradient is not a plain tensor (sharded)"
            if p.dtype != torch.float32 or g is None or g.dtype != torch.float32:
                return "a parameter or its gradient is not float32, or has no gradient"
            if not (p.is_contiguous() and g.is_contiguous()) or p.layout != torch.strided:
                return "a parameter or its gradient is not dense and contiguous"
        return None

    @staticmethod
    def inputs(state: dict, groups: Sequence[tuple[dict, Sequence[torch.Tensor]]]):
        """The step's inputs: parameters (their data, outside autograd), gradients, momenta (made on
        first use), each tensor's group row as a tuple, and one row (s, -lr, b1, 1 - b1, b2, 1 - b2) of
        float32-rounded numbers per group, s = 1 - lr * wd (1.0 without weight decay). One place for
        every caller: this step and optim.lion_cuda's graphed replay of it."""
        ps, gs, ms, rows, hyper = [], [], [], [], []
        f = kernels.f32
        for k, (group, params) in enumerate(groups):
            b1, b2 = group["betas"]
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            hyper.append((f(1.0 - lr * wd) if wd != 0.0 else 1.0, f(-lr), f(b1), f(1.0 - b1), f(b2), f(1.0 - b2)))
            for p in params:
                st = state[p]
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                ps.append(_local(p))
                gs.append(p.grad)
                ms.append(st["exp_avg"])
                rows.append(k)
        return ps, gs, ms, tuple(rows), hyper

    def __call__(self, state: dict, groups: Sequence[tuple[dict, Sequence[torch.Tensor]]]) -> None:
        """One Lion step of every (param group, its parameters), momentum in state[p]["exp_avg"]."""
        ps, gs, ms, rows, hyper = self.inputs(state, groups)
        if not ps:
            return
        if self._rows != rows:
            self._build(rows)
        # pinned: the copy runs in stream order without waiting for the host (no sync on the hot path)
        h = torch.tensor(hyper, dtype=torch.float32, pin_memory=self.device.type == "cuda")
        self._run(ps, gs, ms, h.to(self.device, non_blocking=True))
        self.calls += 1


def check_fused_step(device: torch.device | str, fma: str = "fma") -> list[str]:
    """Run a FusedLionStep (its `fma` variant) and the foreach kernels on the same small state (random
    values, exact zeros, -0.0, near-cancellations of b1*m + (1-b1)*g, subnormals; two groups, one
    without weight decay) and name what differs (empty when the bytes agree)."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    shapes = [(96, 65), (7,), (1000,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    ms = [torch.randn(s, generator=gen).to(device) * 1e-3 for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen).to(device) * 1e-3
    groups = [dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99)), dict(lr=3e-4, weight_decay=0.0, betas=(0.95, 0.98))]
    m0, g0 = ms[2], ps[2].grad
    m0[:4] = torch.tensor([0.0, -0.0, 1e-40, -3e-39], device=device)
    g0[:4] = torch.tensor([-0.0, 0.0, -2e-41, 1e-38], device=device)
    # g*(1-b) == -fl(m*b) but for the product's rounding: c (and m's update) is that rounding error
    # with one fma, 0 or its opposite with two roundings: the sign of c tells the two apart
    (b1, b2), f = groups[1]["betas"], kernels.f32
    g0[4:400] = -(m0[4:400] * f(b1)) / f(1.0 - b1)
    g0[400:800] = -(m0[400:800] * f(b2)) / f(1.0 - b2)
    split = [(groups[0], ps[:2]), (groups[1], ps[2:])]
    ref_p = [p.detach().clone() for p in ps]
    ref_state = {}
    with torch.no_grad():
        ref_params = [torch.nn.Parameter(t) for t in ref_p]
        for rp, p, m in zip(ref_params, ps, ms):
            rp.grad = p.grad
            ref_state[rp] = {"exp_avg": m.clone()}
        lion_group_step_(ref_state, groups[0], ref_params[:2])
        lion_group_step_(ref_state, groups[1], ref_params[2:])
        state = {p: {"exp_avg": m.clone()} for p, m in zip(ps, ms)}
        FusedLionStep(device, fma)(state, split)
    bad = []
    for k, (p, rp) in enumerate(zip(ps, ref_params)):
        if not torch.equal(p.detach().view(torch.int32), rp.detach().view(torch.int32)):
            bad.append(f"p[{k}]")
        if not torch.equal(state[p]["exp_avg"].view(torch.int32), ref_state[rp]["exp_avg"].view(torch.int32)):
            bad.append(f"m[{k}]")
    return bad


def fused_step_impl(impl: str | None, device: torch.device | str) -> bool:
    """Whether Lion steps through FusedLionStep under comm.kernels=`impl` on `device`: 'compiled'
    anywhere (raises where nothing compiles), 'auto' on CUDA where torch.compile works; 'eager'
    and 'native' never (native has no Lion loop: the foreach kernels are already one pass per op)."""
    device = torch.device(device)
    impl = kernels.resolve_impl(impl)
    if impl == "compiled":
        return kernels.use_compiled(impl, device)
    return impl == "auto" and device.type == "cuda" and kernels.compile_unavailable(device) is None


def cuda_graphs_on(device: torch.device | str) -> bool:
    """Whether `device` replays CUDA graphs (a CUDA device)."""
    return torch.device(device).type == "cuda"


def graphed_step_impl(impl: str | None, device: torch.device | str) -> bool:
    """Whether Lion's fused step replays from a CUDA graph (GraphedLionStep): under comm.kernels=auto where
    the fused step runs and the device replays graphs; 'compiled' keeps the plain fused pass everywhere
    (the way to turn the graph off)."""
    return kernels.resolve_impl(impl) == "auto" and cuda_graphs_on(device) and fused_step_impl(impl, device)


class Lion(CommOptimizer):
    """Lion on one shared state (gradient sync, or one process): every rank averages its gradient
    through the scheme (fp32 / bf16 allreduce), then takes the same step."""

    optim_name = "lion"

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, **comm_kwargs) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), **comm_kwargs)
        if self.strategy.exchanges_own_vector:  # which schemes fit "lion" is its entry's; this is its gradient half
            raise ValueError(f"Lion steps one shared state and needs a gradient-sync comm.mode, not {self.scheme.name}; "
                             f"build_optimizer('lion', ...) builds DistributedLion for update sync")
        self._fused: FusedLionStep | GraphedLionStep | None = None
        self._fused_checked = False
        self._fma = "fma"  # the warm-up may pick another FMA_VARIANTS entry

    def momentum_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        return self.state[p].get("exp_avg")

    def _warmup_own_kernels(self) -> float:
        """Under comm.kernels=auto on CUDA or =compiled: check the fused step's bytes against the
        foreach kernels on this device (a small state), its fma variants in order (FMA_VARIANTS), and
        keep the first that agrees. None agreeing raises under 'compiled'; under 'auto' it is logged
        (a warning) and this optimizer keeps the foreach kernels."""
        if not fused_step_impl(self.kernels, self.layout.device):
            return 0.0
        t0 = time.perf_counter()
        auto = kernels.resolve_impl(self.kernels) == "auto"
        found = []
        for variant in FMA_VARIANTS:
            try:
                bad = check_fused_step(self.layout.device, variant)
            except Exception as e:  # a compiler failure: 'compiled' must hear of it, 'auto' steps eagerly
                if not auto:
                    raise
                bad = [f"(it did not compile: {type(e).__name__}: {' '.join(str(e).split())[:200]})"]
            if not bad:
                self._fma = variant
                return time.perf_counter() - t0
            found.append(f"{variant}: {', '.join(bad)}")
        msg = f"lion: the fused step differs from the foreach kernels on {self.layout.device} ({'; '.join(found)})"
        if not auto:
            raise RuntimeError(msg + "; use comm.kernels=eager or auto")
        warnings.warn(msg + "; this run steps with the foreach kernels", RuntimeWarning, stacklevel=2)
        self._fused_checked, self._fused = True, None
        return time.perf_counter() - t0

    def kernel_choices(self) -> list[str]:
        """The base's lines, and how Lion steps: the fused pass (replayed as a CUDA graph) and its fma
        variant, or the foreach kernels."""
        lines = super().kernel_choices()
        if fused_step_impl(self.kernels, self.layout.device):
            refused = self._fused_checked and self._fused is None
            graphed = (isinstance(self._fused, GraphedLionStep) if self._fused_checked else
                       graphed_step_impl(self.kernels, self.layout.device))
            how = "fused pass replayed as a CUDA graph" if graphed else "fused pass"
            lines.append("lion step: foreach kernels (the fused pass was refused)" if refused else
                         f"lion step: {how}, fma variant {self._fma!r} (bytes equal the foreach kernels')")
        return lines

    def _fused_step(self) -> FusedLionStep | GraphedLionStep | None:
        """The fused step where comm.kernels and the parameters allow it, replayed from a CUDA graph
        where graphed_step_impl says so (decided at the first step, when the gradients exist; a
        warm-up that found a mismatch decided already)."""
        if not self._fused_checked:
            self._fused_checked = True
            params = [p for ks in self.layout.per_group.values() for p in self.layout.params(ks)]
            if fused_step_impl(self.kernels, self.layout.device) and FusedLionStep.fits(params) is None:
                step = FusedLionStep(self.layout.device, self._fma)
                self._fused = GraphedLionStep(step) if graphed_step_impl(self.kernels, self.layout.device) else step
        return self._fused

    def _update(self, step: int) -> None:
        fused = self._fused_step()
        if fused is not None:
            groups = [(self.param_groups[gi], self.layout.params(ks)) for gi, ks in self.layout.per_group.items()]
            first = not fused.calls and kernels.resolve_impl(self.kernels) == "auto"
            try:  # the first call compiles the model's shapes: under 'auto' a compiler failure is a warning
                fused(self.state, groups)
                return
            except GraphCaptureError as e:  # the capture ran nothing: the plain pass takes this step and the rest
                warnings.warn(f"lion: the fused step's CUDA graph capture failed ({e}); this run continues with "
                              "the uncaptured fused pass", RuntimeWarning, stacklevel=2)
                self._fused = fused.fused
                self._fused(self.state, groups)
                return
            except Exception as e:  # noqa: BLE001  (compilation fails before any tensor is written)
                if not first:
                    raise
                warnings.warn(f"lion: the fused step did not compile for this model ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}); this run steps with the foreach kernels",
                              RuntimeWarning, stacklevel=2)
                self._fused = None
        for gi, ks in self.layout.per_group.items():
            lion_group_step_(self.state, self.param_groups[gi], self.layout.params(ks))
