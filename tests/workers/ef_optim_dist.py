"""Per-rank checks of the error-feedback optimizers (onebit_adam, binsgdm, adamw / lion on loco)
against a single-process simulation of all P workers written here from torch ops and the
documented semantics of comm.ef_compressed_allreduce, run under torchrun at P = 2 and 4 by
tests/optim/test_ef_optim.py:

- parameters, momenta and error states (and LoCo's 8-bit codes) bitwise equal to the simulation
  after every step, and identical on every rank;
- the bytes of every step's StepReport equal the declared formula (fp32 allreduce during 1-bit
  Adam's warm-up, comm.compressed_bytes afterwards and for binsgdm / loco);
- a resume through state_dict / load_state_dict (torch.save round trip) continues bit for bit,
  across 1-bit Adam's freeze, BinSGDM's max rule and a LoCo error reset.

Gradients are dyadic (k/64 times a power of two), so the fp32 sums of an allreduce are exact in
any order and the simulation's mean equals gloo's.
"""
from __future__ import annotations

import io
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import comm
from comm import Compressor
from optim import build_optimizer
from optim.base import digest
from ef_sim import sim_call  # this folder is the script's sys.path[0]

P = RANK = 0
ASSERTIONS = 0
# one pytest item each (tests/workers/_checks.py); binsgdm_hierarchical_m2 runs at even P only
CHECKS = ("onebit_adam", "binsgdm_flat", "binsgdm_flat_t0_2", "loco_adamw", "loco_lion", "binsgdm_hierarchical_m2")
STEPS = 8
# (role, shape, weight decay): one parameter per group; role order = group order, so the flat
# layout (and the flat gradient buffer) is the concatenation in this order
SHAPES = [("attn", (32, 40), 0.1), ("norm", (40,), 0.0), ("mlp", (24, 32), 0.1)]
LR = 2e-3


def check(cond: bool, msg: str) -> None:
    global ASSERTIONS
    ASSERTIONS += 1
    assert cond, f"[rank {RANK}/{P}] {msg}"


# ------------------------------------------------------------------------------------------------
# LoCo's 8-bit error code (the simulation of the collective itself is ef_sim.py)
# ------------------------------------------------------------------------------------------------

def sim_q8(e: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LoCo's 8-bit error code per block: scale = max|e| / 127, q = round(e * 127 / max|e|)."""
    qs, ss = [], []
    for a in range(0, e.numel(), block):
        v = e[a:a + block]
        amax = v.abs().amax()
        ss.append(amax / 127)
        qs.append(torch.round(v * torch.where(amax > 0, 127 / amax, 0.0)).clamp(-127, 127).to(torch.int8))
    return torch.cat(qs), torch.stack(ss)


def sim_dq8(q: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    return torch.cat([q[a:a + block].float() * s[a // block] for a in range(0, q.numel(), block)])


# ------------------------------------------------------------------------------------------------
# the toy problem: three parameter tensors, dyadic per-rank gradients
# ------------------------------------------------------------------------------------------------

def init_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(shape, generator=g) * 0.1 for _, shape, _ in SHAPES]


def make_groups(tensors: list[torch.Tensor], lr: float = LR) -> tuple[list[torch.nn.Parameter], list[dict]]:
    params = [torch.nn.Parameter(t.clone()) for t in tensors]
    groups = [{"params": [p], "names": [role], "role": role, "lr": lr, "weight_decay": wd}
              for p, (role, _, wd) in zip(params, SHAPES)]
    return params, groups


def grads(step: int, rank: int, dead_until: int = 0) -> list[torch.Tensor]:
    """Dyadic gradients of `rank` at `step`; the first 4 rows of the last tensor are 0 on every
    rank while step <= dead_until (never-seen embedding rows: variance 0 at 1-bit Adam's freeze),
    and one row of the first tensor is always 0 (b = 0 for BinSGDM: u = 0/0 := 0)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for k, (_, shape, _) in enumerate(SHAPES):
        x = torch.randint(-64, 65, shape, generator=g).float() / 64 * 2.0 ** -(k + 3)
        if k == 0:
            x[5] = 0.0
        if k == 2 and step <= dead_until:
            x[:4] = 0.0
        out.append(x)
    return out


def lr_at(step: int) -> float:
    return LR * (1.0 - 0.05 * step)   # a schedule: the optimizers must read lr every step


def set_lr(groups: list[dict], step: int) -> None:
    for g in groups:
        g["lr"] = lr_at(step)


def gathered_digests(tensors: list[torch.Tensor]) -> list[str]:
    out: list = [None] * P
    dist.all_gather_object(out, digest(tensors))
    return out


def roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def views(flat: torch.Tensor) -> list[torch.Tensor]:
    out, off = [], 0
    for _, shape, _ in SHAPES:
        n = math.prod(shape)
        out.append(flat[off:off + n].view(shape))
        off += n
    return out


N = sum(math.prod(s) for _, s, _ in SHAPES)


def run_optimizer(name: str, mode: str, comm_options: dict, optim_options: dict, steps: int,
                  dead_until: int = 0, betas=(0.9, 0.999), start=None):
    """Build the optimizer on fresh parameters (or on `start` = (tensors, state, first step)) and
    yield (step, params, optimizer, report) after each step of this rank's gradients."""
    tensors, state, first = start if start else (init_params(), None, 1)
    params, groups = make_groups(tensors)
    opt = build_optimizer(name, groups, betas=betas, eps=1e-8, comm_mode=mode, comm_options=comm_options,
                          optim_options=optim_options, grad_clip=0.0)
    if state is not None:
        opt.load_state_dict(state)
    for t in range(first, steps + 1):
        for p, g in zip(params, grads(t, RANK, dead_until)):
            p.grad = g
        set_lr(opt.param_groups, t)
        rep = opt.step()
        yield t, params, opt, rep


def check_same(what: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Bitwise equal parameter lists (the largest difference in the message when not)."""
    ok = all(torch.equal(a, b) for a, b in zip(got, want))
    check(ok, what if ok else f"{what}: parameters differ from the simulation (max "
                              f"{max(float((a - b).detach().abs().max()) for a, b in zip(got, want)):.3g})")


def check_ranks_identical(what: str, tensors: list[torch.Tensor]) -> None:
    ds = gathered_digests(tensors)
    check(len(set(ds)) == 1, f"{what}: parameters differ between ranks")


def check_resume(name, mode, co, oo, steps, at, dead_until=0, betas=(0.9, 0.999)) -> None:
    """Save at step `at` (torch.save round trip), continue a fresh optimizer from it: equal to the
    uninterrupted run at the end, parameters and every tensor of the state."""
    saved, final = None, None
    for t, params, opt, _ in run_optimizer(name, mode, co, oo, steps, dead_until, betas):
        if t == at:
            saved = ([p.detach().clone() for p in params], roundtrip(opt.state_dict()), at + 1)
        final = (params, opt)
    for t, params, opt, _ in run_optimizer(name, mode, co, oo, steps, dead_until, betas, start=saved):
        pass
    check(all(torch.equal(a, b) for a, b in zip(params, final[0])), f"{name}/{mode} resume at {at}: parameters")
    flat_a, flat_b = _tensors(final[1].state_dict()), _tensors(opt.state_dict())
    check(len(flat_a) == len(flat_b) and all(torch.equal(a, b) for a, b in zip(flat_a, flat_b)),
          f"{name}/{mode} resume at {at}: optimizer state differs")


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


# ------------------------------------------------------------------------------------------------
# the optimizers against their simulations
# ------------------------------------------------------------------------------------------------

def test_onebit_adam() -> None:
    T, block, b1, b2, eps = 3, 64, 0.9, 0.999, 1e-8
    comp = Compressor("scaled_sign", block=block)
    co, oo = {"compressor": "scaled_sign", "block": block}, {"freeze_step": T}
    # the simulation: warm-up = torch's AdamW on the exact mean gradient, then P momenta
    ref_params, ref_groups = make_groups(init_params())
    ref = torch.optim.AdamW([{"params": g["params"], "lr": LR, "weight_decay": g["weight_decay"]}
                             for g in ref_groups], betas=(b1, b2), eps=eps, foreach=True)
    wn, sn = comm.ef_buffer_sizes(N, P, comp)
    werrs, serrs = [torch.zeros(wn) for _ in range(P)], [torch.zeros(sn) for _ in range(P)]
    m_bar = d = dead = None
    for t, params, opt, rep in run_optimizer("onebit_adam", "compressed", co, oo, STEPS, dead_until=T + 2,
                                             betas=(b1, b2)):
        gs = [grads(t, r, T + 2) for r in range(P)]
        set_lr(ref.param_groups, t)
        if t <= T:
            for k, p in enumerate(ref_params):
                s = gs[0][k].clone()
                for r in range(1, P):
                    s = s + gs[r][k]
                p.grad = s / P
            ref.step()
            if t == T:  # fold the bias corrections (onebit_adam's docstring)
                ms, ds = [], []
                for p in ref_params:
                    st = ref.state[p]
                    tt = float(st["step"])
                    ms.append((st["exp_avg"] / (1 - b1 ** tt)).reshape(-1))
                    dv = torch.sqrt(st["exp_avg_sq"]).div_(math.sqrt(1 - b2 ** tt)).add_(eps)
                    ds.append(dv.masked_fill_(st["exp_avg_sq"] == 0, math.inf).reshape(-1))
                m_bar, d = torch.cat(ms), torch.cat(ds)
                dead = torch.isinf(d)
                # never a gradient in the warm-up: row 5 of the first tensor, rows 0-3 of the last
                check(int(dead.sum()) == 40 + 4 * 32, f"onebit t={t}: {int(dead.sum())} dead elements, expected 168")
            exp = {"grad_sync": (4 * N, 4 * N) if P > 1 else (0, 0), "update_sync": (0, 0)}
        else:
            mis = []
            for r in range(P):
                mi = m_bar.clone()
                mv = views(mi)
                torch._foreach_mul_(mv, b1)
                torch._foreach_add_(mv, gs[r], alpha=1 - b1)
                mis.append(mi)
            m_bar = sim_call(mis, werrs, serrs, comp, [None] * P)
            m_bar.masked_fill_(dead, 0.0)
            lr = lr_at(t)
            for k, (p, (_, _, wd)) in enumerate(zip(ref_params, SHAPES)):
                with torch.no_grad():
                    if wd:
                        torch._foreach_mul_([p], 1 - lr * wd)
                    torch._foreach_addcdiv_([p], [views(m_bar)[k]], [views(d)[k]], value=-lr)
            exp = {"grad_sync": (0, 0), "update_sync": comm.compressed_bytes(N, P, comp)}
            check(torch.equal(opt.m_flat, m_bar), f"onebit t={t}: momentum differs from the simulation")
            check(torch.equal(opt.exchange.werr, werrs[RANK]) and torch.equal(opt.exchange.serr, serrs[RANK]),
                  f"onebit t={t}: error states differ from the simulation")
        check_same(f"onebit t={t}", list(params), ref_params)
        for phase, want in exp.items():
            got = (rep.phases[phase]["bytes_sent"], rep.phases[phase]["bytes_recv"])
            check(got == want, f"onebit t={t}: {phase} bytes {got} != {want}")
        check_ranks_identical(f"onebit t={t}", list(params))
    check(bool((views(m_bar)[2][:4] == 0).all()), "onebit: dead rows' momentum not zeroed")
    check_resume("onebit_adam", "compressed", co, oo, STEPS, at=T - 1, dead_until=T + 2, betas=(b1, b2))
    check_resume("onebit_adam", "compressed", co, oo, STEPS, at=T + 2, dead_until=T + 2, betas=(b1, b2))


def test_binsgdm(node: int, t0: int) -> None:
    beta, block = 0.9, 64
    comp = Compressor("binary_stochastic", block=block)
    co = {"compressor": "binary_stochastic", "block": block, "ef_node_size": node}
    oo = {"t0": t0}
    wn, sn = comm.ef_buffer_sizes(N, P, comp, node_size=node if node > 1 else None)
    werrs, serrs = [torch.zeros(wn) for _ in range(P)], [torch.zeros(sn) for _ in range(P)]
    ms, bhs = [torch.zeros(N) for _ in range(P)], [torch.zeros(N) for _ in range(P)]
    bs: list = [None] * P
    ref = [p.detach().clone() for p in init_params()]
    gens = None
    for t, params, opt, rep in run_optimizer("binsgdm", "compressed", co, oo, STEPS, betas=(beta, beta)):
        if gens is None:  # the same seeds: each rank's exchange generator, from the run's seed and its rank
            seeds: list = [None] * P
            dist.all_gather_object(seeds, opt.exchange.ctx.seed)
            gens = [torch.Generator().manual_seed(s) for s in seeds]
        gs = [grads(t, r) for r in range(P)]
        us = []
        for r in range(P):
            if t0 >= 0 and t == t0 + 1:
                bs[r] = bhs[r].clone()
            mv, bv, u = views(ms[r]), views(bhs[r]), torch.zeros(N)
            torch._foreach_mul_(mv, beta)
            torch._foreach_add_(mv, gs[r], alpha=1 - beta)
            torch._foreach_copy_(views(u), gs[r])
            torch._foreach_abs_(views(u))
            torch._foreach_mul_(bv, beta)
            torch._foreach_add_(bv, views(u), alpha=1 - beta)
            den = bhs[r]
            if t0 >= 0 and t > t0:
                den = torch.maximum(bs[r], bhs[r], out=bs[r])
            torch.div(ms[r], den, out=u)
            us.append(u.nan_to_num_(nan=0.0, posinf=1.0, neginf=-1.0))
        ubar = sim_call(us, werrs, serrs, comp, gens, m=node if node > 1 else 1)
        check(bool((ubar.abs() == 1).all()), f"binsgdm t={t}: the server's Q is not +-1")
        lr = lr_at(t)
        for k, (_, _, wd) in enumerate(SHAPES):
            if wd:
                torch._foreach_mul_([ref[k]], 1 - lr * wd)
            torch._foreach_add_([ref[k]], [views(ubar)[k]], alpha=-lr)
        what = f"binsgdm node={node} t0={t0} t={t}"
        check_same(what, list(params), ref)
        check(torch.equal(opt.m, ms[RANK]) and torch.equal(opt.b_hat, bhs[RANK]), f"{what}: m / b_hat differ")
        check((opt.b is None) == (bs[RANK] is None) and (opt.b is None or torch.equal(opt.b, bs[RANK])),
              f"{what}: the max-rule b differs")
        check(torch.equal(opt.exchange.werr, werrs[RANK]) and torch.equal(opt.exchange.serr, serrs[RANK]),
              f"{what}: error states differ from the simulation")
        want = comm.compressed_bytes(N, P, comp, node_size=node if node > 1 else None)
        got = (rep.phases["update_sync"]["bytes_sent"], rep.phases["update_sync"]["bytes_recv"])
        check(got == want and rep.phases["grad_sync"]["bytes_sent"] == 0, f"{what}: bytes {got} != {want}")
        check_ranks_identical(what, list(params))
    check_resume("binsgdm", "compressed", co, oo, STEPS, at=4, betas=(beta, beta))


def test_loco(inner: str) -> None:
    block, err_beta, reset = 64, 0.8, 3
    comp = Compressor("int4", block=block)
    co = {"err_beta": err_beta, "reset_every": reset, "block": block}
    b1, b2 = 0.9, 0.95
    ref_params, ref_groups = make_groups(init_params())
    ref = torch.optim.AdamW([{"params": g["params"], "lr": LR, "weight_decay": g["weight_decay"]}
                             for g in ref_groups], betas=(b1, b2), eps=1e-8, foreach=True)
    lion_m = [torch.zeros_like(p) for p in ref_params]
    wn, sn = comm.ef_buffer_sizes(N, P, comp)
    wq = [torch.zeros(wn, dtype=torch.int8) for _ in range(P)]
    ws = [torch.zeros(math.ceil(wn / block)) for _ in range(P)]
    sq = [torch.zeros(sn, dtype=torch.int8) for _ in range(P)]
    ss = [torch.zeros(math.ceil(sn / block)) for _ in range(P)]
    for t, params, opt, rep in run_optimizer(inner, "loco", co, {}, STEPS, betas=(b1, b2)):
        if (t - 1) % reset == 0:       # calls so far = t - 1: zeroed every `reset` calls
            for v in wq + ws + sq + ss:
                v.zero_()
        werrs = [sim_dq8(wq[r], ws[r], block) for r in range(P)]
        serrs = [sim_dq8(sq[r], ss[r], block) for r in range(P)]
        gbar = sim_call([torch.cat([g.reshape(-1) for g in grads(t, r)]) for r in range(P)], werrs, serrs, comp,
                        [None] * P, beta=err_beta)
        for r in range(P):
            wq[r], ws[r] = sim_q8(werrs[r], block)
            sq[r], ss[r] = sim_q8(serrs[r], block)
        lr = lr_at(t)
        if inner == "adamw":
            set_lr(ref.param_groups, t)
            for p, g in zip(ref_params, views(gbar)):
                p.grad = g.clone()
            ref.step()
        else:  # Lion on the mean gradient: c = b1 m + (1 - b1) g, p -= lr sign(c), m = b2 m + (1 - b2) g
            with torch.no_grad():
                for k, (p, (_, _, wd)) in enumerate(zip(ref_params, SHAPES)):
                    g = views(gbar)[k]
                    c = torch._foreach_mul([lion_m[k]], b1)
                    torch._foreach_add_(c, [g], alpha=1 - b1)
                    torch._foreach_sign_(c)
                    if wd:
                        torch._foreach_mul_([p], 1 - lr * wd)
                    torch._foreach_add_([p], c, alpha=-lr)
                    torch._foreach_mul_([lion_m[k]], b2)
                    torch._foreach_add_([lion_m[k]], [g], alpha=1 - b2)
        what = f"loco/{inner} t={t}"
        check_same(what, list(params), ref_params)
        (st,) = opt.exchange.errors.values()
        check(torch.equal(st.wq, wq[RANK]) and torch.equal(st.ws, ws[RANK]) and torch.equal(st.sq, sq[RANK])
              and torch.equal(st.ss, ss[RANK]), f"{what}: 8-bit error states differ from the simulation")
        want = comm.compressed_bytes(N, P, comp)
        got = (rep.phases["grad_sync"]["bytes_sent"], rep.phases["grad_sync"]["bytes_recv"])
        check(got == want, f"{what}: bytes {got} != {want}")
        check_ranks_identical(what, list(params))
    check(bool(wq[RANK].abs().sum() > 0), f"loco/{inner}: the worker error is all zero: nothing was compensated")
    check_resume(inner, "loco", co, {}, STEPS, at=2, betas=(b1, b2))   # continues across the reset at call 3


def main() -> None:
    global P, RANK
    dist.init_process_group("gloo")
    P, RANK = dist.get_world_size(), dist.get_rank()
    from _checks import Checks
    checks, t0 = Checks(CHECKS), time.time()
    cases = [("onebit_adam", test_onebit_adam, ()), ("binsgdm_flat", test_binsgdm, (1, -1)),
             ("binsgdm_flat_t0_2", test_binsgdm, (1, 2)), ("loco_adamw", test_loco, ("adamw",)),
             ("loco_lion", test_loco, ("lion",))]
    if P % 2 == 0:
        cases.append(("binsgdm_hierarchical_m2", test_binsgdm, (2, -1)))
    for name, fn, args in cases:
        checks.run(name, fn, *args)
    dist.barrier()
    if RANK == 0:
        print(f"ef_optim_dist P={P}: {ASSERTIONS} assertions in {time.time() - t0:.1f}s", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo worker threads occasionally abort at interpreter exit (tests/workers/comm_collectives.py)


if __name__ == "__main__":
    main()
