"""Per-rank checks of the Dion and Muon optimizers over gloo (launched by tests/optim/test_muon_dion.py).

Parameters with the trainer's roles (embedding, head, norm: AdamW; attn, mlp matrices: Dion or
Muon), fed synthetic gradients drawn per rank and step (no model: the gradients do not depend on
the parameters, so the optimizer's arithmetic is compared alone). Every rank can draw every
rank's gradients, so each also runs the centralized algorithm (Dion Alg. 1 via
dion_math.dion_step_, AdamW written out) on the mean gradient in float64 as the reference.

Dion, checked every step: parameters, every Q and the momenta of the full-gradient matrices
bit-identical on all ranks; one grad_sync collective (two with clipping) and exactly two
update_sync collectives; bytes booked == a formula written here from the shapes (and ==
optimizer.wire_bytes_per_step()). After T steps: the parameters and the mean over ranks of the
momenta equal the float64 reference (Dion Thm. 2.1, Alg. 2 == Alg. 1 on the mean gradient) within
the rounding model of tests/workers/dion_dist.py: relative error <= T * A * eps per matrix, with
eps = sqrt(max(m, n)) u_c + P u_w and A = max over steps of (1 + sqrt(2) c_A)(1 + 2 c_R) measured
on the reference (QR's and ColumnNormalize's amplification). AdamW parameters: an elementwise
first-order bound (see `adamw_reference`). Runs: fp32 at rank 1/2 (a mix of factorised and
full-gradient matrices), bf16 at rank 1/4, fp32 with clipping (the clipping norm of Dion._clip_
recomputed here in float64). A state_dict round trip mid-run (through torch.save) continues bit
for bit. Muon: ranks bit-identical, one gradient collective of 4 N (fp32) / 2 N (bf16) bytes.
Each run is a named check (CHECKS; tests/workers/_checks.py records its outcome).
"""
from __future__ import annotations

import copy
import io
import math

import torch
import torch.distributed as dist

import optim
from optim.dion import matrix_seed
from optim.dion_math import dion_factor_rows, dion_rank, dion_step_, dion_transposed, init_dion_q
from optim.orthogonal import orthonormalize_columns

U32 = torch.finfo(torch.float32).eps / 2
BETAS, EPS, LR, MATRIX_LR, MU = (0.9, 0.95), 1e-8, 0.01, 0.03, 0.9
# name -> (shape, role, weight decay); dict order is the "model" order (roles interleaved)
PARAMS = {"emb.weight": ((20, 8), "embedding", 0.1), "attn.a": ((24, 40), "attn", 0.1),
          "norm.weight": ((16,), "norm", 0.0), "attn.b": ((48, 16), "attn", 0.1), "mlp.c": ((32, 32), "mlp", 0.1),
          "mlp.d": ((8, 8), "mlp", 0.1), "mlp.e": ((16, 24), "mlp", 0.1), "head.weight": ((20, 16), "head", 0.1)}
MATRICES = [n for n, (_, role, _) in PARAMS.items() if role in ("attn", "mlp")]
SCALARS = [n for n in PARAMS if n not in MATRICES]
ROLES = ["embedding", "head", "attn", "mlp", "norm"]
MATRIX_ROLES = ("attn", "mlp")
CHECKS = ("dion_fp32_rank_half", "dion_bf16_rank_quarter", "dion_fp32_clipped", "dion_round_trip", "muon")


def sched(t: int) -> float:
    """The trainer's schedule factor at step t (changes every step: the matrix lr must follow it)."""
    return 1.0 - 0.1 * t


def init_params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)  # identical on every rank
    return {n: torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for n, (shape, _, _) in PARAMS.items()}


def grads(rank: int, t: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * (rank + 1) + t)
    return {n: torch.randn(shape, generator=g, dtype=torch.float64).float() for n, (shape, _, _) in PARAMS.items()}


def groups(params: dict[str, torch.nn.Parameter]) -> list[dict]:
    out = []
    for role in ROLES:
        names = [n for n, (_, r, _) in PARAMS.items() if r == role]
        out.append({"params": [params[n] for n in names], "names": names, "layers": ["block.0"] * len(names),
                    "role": role, "lr": LR, "lr_mult": 1.0, "weight_decay": PARAMS[names[0]][2],
                    "matrix": role in MATRIX_ROLES})
    return out


def ranks_of(opts: dict) -> dict[str, int]:
    return {n: dion_rank(*PARAMS[n][0], rank_fraction=opts.get("rank_fraction", 0.25), rank=opts.get("rank") or None)
            for n in MATRICES}


def factorised(opts: dict) -> dict[str, bool]:
    """Dion sends P and R only where (m + n) r < m n (else the matrix's gradient is averaged)."""
    return {n: (sum(PARAMS[n][0]) * r < math.prod(PARAMS[n][0])) for n, r in ranks_of(opts).items()}


def expected_bytes(opts: dict, wire: int, clip: bool) -> tuple[int, int]:
    """(grad_sync, update_sync) bytes per step, from the shapes alone."""
    low = factorised(opts)
    synced = sum(math.prod(PARAMS[n][0]) for n in SCALARS) + \
        sum(math.prod(PARAMS[n][0]) for n in MATRICES if not low[n])
    factors = sum(sum(PARAMS[n][0]) * r for n, r in ranks_of(opts).items() if low[n])
    return wire * synced + (4 if clip and any(low.values()) else 0), wire * factors


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def identical_across_ranks(t: torch.Tensor) -> bool:
    parts = gathered(t)
    return all(torch.equal(parts[0], x) for x in parts[1:])


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    return sum(x.double() for x in gathered(t)) / dist.get_world_size()


# ---- the float64 reference -------------------------------------------------------------------------
def clip_factor(all_grads: list[dict], opts: dict, clip: float) -> float:
    """Dion._clip_'s factor: norm^2 = ||mean synced gradient||^2 + mean_i ||rank i's factorised grads||^2."""
    if clip <= 0:
        return 1.0
    P, low = len(all_grads), factorised(opts)
    synced = sum(float((sum(g[n].double() for g in all_grads) / P).square().sum())
                 for n in PARAMS if n not in MATRICES or not low[n])
    local = sum(float(g[n].double().square().sum()) for g in all_grads for n in MATRICES if low[n]) / P
    return min(1.0, clip / (math.sqrt(synced + local) + 1e-6))


def reference(P: int, T: int, opts: dict, clip: float, u_w: float):
    """Dion Alg. 1 + AdamW on the (clipped) mean gradient in float64. Returns the final parameters,
    momenta, each matrix's amplification A, and each AdamW parameter's elementwise error bound."""
    X = init_params(torch.float64)
    ranks = ranks_of(opts)
    M = {n: torch.zeros_like(X[n]) for n in MATRICES}
    Q = {n: init_dion_q(dion_factor_rows(*PARAMS[n][0])[1], ranks[n], seed=matrix_seed(n), dtype=torch.float64)
         for n in MATRICES}
    amp = {n: 1.0 for n in MATRICES}
    adam = {n: adamw_reference(X[n], P, u_w) for n in SCALARS}
    for t in range(T):
        all_grads = [grads(i, t) for i in range(P)]
        c = clip_factor(all_grads, opts, clip)
        mean = {n: c * sum(g[n].double() for g in all_grads) / P for n in PARAMS}
        abar = {n: c * sum(g[n].double().abs() for g in all_grads) / P for n in PARAMS}
        lr = LR * sched(t)
        for n in SCALARS:
            adam[n].step(mean[n], abar[n], lr, PARAMS[n][2])
        for n in MATRICES:
            r = ranks[n]
            B = M[n] + mean[n]
            if dion_transposed(*PARAMS[n][0]):  # wide: the power iteration runs on B^T
                B = B.mT
            A = B @ Q[n]
            c_a = (torch.linalg.matrix_norm(A) / (math.sqrt(r) * torch.linalg.svdvals(A)[-1])).item()
            R = B.mT @ orthonormalize_columns(A)
            c_r = (R.norm() / (math.sqrt(r) * R.norm(dim=0).min())).item()
            amp[n] = max(amp[n], (1 + math.sqrt(2) * c_a) * (1 + 2 * c_r))
        dion_step_([X[n] for n in MATRICES], [mean[n] for n in MATRICES], [M[n] for n in MATRICES],
                   [Q[n] for n in MATRICES], lr=MATRIX_LR * sched(t), mu=opts.get("mu", MU),
                   weight_decay=[PARAMS[n][2] for n in MATRICES])
    return X, M, amp, {n: adam[n].bound for n in SCALARS}


class adamw_reference:
    """AdamW (decoupled decay, bias correction) in float64 on the mean gradient, with an elementwise
    bound on the fp32 run's deviation. The fp32 run's mean gradient is off by at most e_g * abar
    (abar = mean_i |g_i|; the wire cast, P - 1 additions in the wire dtype, the cast back and the
    division: e_g = (P + 1) u_w + u32). Through m and v: |dm^| <= e_g A1^, |dv^| <= 2 e_g A2^ (A1 =
    the EMA of abar with beta1, A2 = of |g| abar with beta2, bias-corrected), so to first order the
    direction d = m^/(sqrt(v^) + eps) moves by at most e_g (A1^/sqrt(v^) + |d| A2^/v^); fp32's own ~10
    roundings in AdamW add 10 u32 (A1^/sqrt(v^) + |d|). m^ is linear in g; where v^'s relative
    perturbation 2 e_g A2^/v^ is <= 1/4 (the usual case), 1/sqrt(v^) moves by at most 1.54x its
    linearisation, so twice the first-order term bounds the error; elsewhere (a mean gradient that
    nearly cancels) we use the worst case 2 K_t, K_t = sqrt(c2 sum_j w1_j^2 / w2_j) / c1 bounding
    any |d| (Cauchy-Schwarz; w1_j = (1 - b1) b1^j, w2_j = (1 - b2) b2^j, c the bias corrections).
    The parameter's deviation sums lr_t times that, plus the rounding of the update line, 2 u32 |X|
    per step (twice)."""

    def __init__(self, x: torch.Tensor, P: int, u_w: float) -> None:
        self.x = x
        self.m, self.v, self.a1, self.a2 = (torch.zeros_like(x) for _ in range(4))
        self.t, self.e = 0, (P + 1) * u_w + U32
        self.bound = torch.zeros_like(x)

    def step(self, g: torch.Tensor, abar: torch.Tensor, lr: float, wd: float) -> None:
        b1, b2 = BETAS
        self.t += 1
        self.x.mul_(1 - lr * wd)
        self.m.mul_(b1).add_((1 - b1) * g)
        self.v.mul_(b2).add_((1 - b2) * g * g)
        self.a1.mul_(b1).add_((1 - b1) * abar)
        self.a2.mul_(b2).add_((1 - b2) * g.abs() * abar)
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        m, v, a1, a2 = self.m / c1, self.v / c2, self.a1 / c1, self.a2 / c2
        d = m / (v.sqrt() + EPS)
        self.x.sub_(lr * d)
        rel = 2 * self.e * a2 / v + 10 * U32  # relative perturbation of v^
        first = self.e * (a1 / v.sqrt() + d.abs() * a2 / v) + 10 * U32 * (a1 / v.sqrt() + d.abs())
        k_t = math.sqrt(c2 * sum((1 - b1) ** 2 * b1 ** (2 * j) / ((1 - b2) * b2 ** j) for j in range(self.t))) / c1
        dd = torch.where(rel <= 0.25, 2 * first, torch.full_like(first, 2 * k_t))
        self.bound.add_(lr * dd + 4 * U32 * self.x.abs())


# ---- the runs ------------------------------------------------------------------------------------------
def build(name: str, mode: str, opts: dict, clip: float, params: dict[str, torch.nn.Parameter]):
    return optim.build_optimizer(name, groups(params), betas=BETAS, eps=EPS, comm_mode=mode, optim_options=opts,
                                 grad_clip=clip, param_order=list(params.values()))


def set_grads(params: dict[str, torch.nn.Parameter], g: dict[str, torch.Tensor]) -> None:
    for n, p in params.items():
        p.grad = g[n].clone()


def set_lr(opt, t: int) -> None:
    for group in opt.param_groups:
        group["lr"] = LR * sched(t) * group["lr_mult"]


def check_dion(rank: int, P: int, mode: str, opts: dict, clip: float, T: int = 3) -> str:
    wire = {"fp32": 4, "bf16": 2}[mode]
    u_w = {"fp32": U32, "bf16": 2.0 ** -9}[mode]
    params = {n: torch.nn.Parameter(x) for n, x in init_params(torch.float32).items()}
    opt = build("dion", mode, {"matrix_lr": MATRIX_LR, "mu": MU, **opts}, clip, params)
    assert isinstance(opt, optim.dion.Dion)
    low = factorised(opts)
    grad_bytes, update_bytes = expected_bytes(opts, wire, clip > 0)
    assert opt.wire_bytes_per_step() == {"grad_sync": (grad_bytes, grad_bytes),
                                         "update_sync": (update_bytes, update_bytes)}, opt.wire_bytes_per_step()
    for t in range(T):
        set_lr(opt, t)
        set_grads(params, grads(rank, t))
        report = opt.step()
        gs, us = report.phases["grad_sync"], report.phases["update_sync"]
        assert (gs["bytes_sent"], gs["calls"]) == (grad_bytes, 2 if clip > 0 and any(low.values()) else 1), gs
        assert (us["bytes_sent"], us["calls"]) == (update_bytes, 2), us
        assert report.bytes_sent == grad_bytes + update_bytes
        for n, p in params.items():
            assert identical_across_ranks(p.detach()), f"dion {mode} {opts}: {n} differs across ranks at step {t}"
        for n in MATRICES:
            st = opt.state[params[n]]
            assert identical_across_ranks(st["Q"]), f"Q of {n} differs across ranks"
            # factorised matrices keep a momentum per rank; the others see the mean gradient
            assert identical_across_ranks(st["momentum"]) != low[n], (n, low[n])

    X_ref, M_ref, amp, adam_bound = reference(P, T, opts, clip, u_w)
    X0 = init_params(torch.float64)
    eps = math.sqrt(max(max(PARAMS[n][0]) for n in MATRICES)) * U32 + P * u_w
    worst, where = 0.0, ""
    for n in MATRICES:
        tol = T * amp[n] * eps
        ex = (torch.linalg.matrix_norm(params[n].detach().double() - X_ref[n])
              / torch.linalg.matrix_norm(X_ref[n] - X0[n])).item()
        mean_m = mean_over_ranks(opt.state[params[n]]["momentum"])
        em = (torch.linalg.matrix_norm(mean_m - M_ref[n]) / torch.linalg.matrix_norm(M_ref[n])).item()
        assert ex <= tol and em <= tol, (mode, opts, n, ex, em, tol)
        if max(ex, em) / tol > worst:
            worst, where = max(ex, em) / tol, f"{n}: {max(ex, em):.1e} <= {tol:.1e}"
    for n in SCALARS:
        dev = (params[n].detach().double() - X_ref[n]).abs()
        assert (dev <= adam_bound[n]).all(), (mode, n, (dev - adam_bound[n]).max().item())
        # not vacuous: for the typical element the bound is a small fraction of the distance moved
        assert (adam_bound[n] / (X_ref[n] - X0[n]).abs()).median() < 0.2, n
        if (dev / adam_bound[n]).max().item() > worst:
            worst, where = (dev / adam_bound[n]).max().item(), f"{n} (AdamW, elementwise)"
    return f"dion {mode} {opts} clip={clip}: closest to its tolerance {where}, {worst:.2f} of it"


def check_round_trip(rank: int, P: int) -> None:
    opts, clip, mode = {"rank": 4, "scalar_opt": "lion", "matrix_lr": MATRIX_LR}, 0.5, "fp32"
    params = {n: torch.nn.Parameter(x) for n, x in init_params(torch.float32).items()}
    opt = build("dion", mode, opts, clip, params)
    steps = range(5)
    for t in steps[:2]:
        set_lr(opt, t)
        set_grads(params, grads(rank, t))
        opt.step()
    buf = io.BytesIO()
    torch.save({"params": {n: p.detach().clone() for n, p in params.items()}, "opt": opt.state_dict()}, buf)
    low = [n for n, f in factorised(opts).items() if f]
    assert low and not any(identical_across_ranks(opt.state[params[n]]["momentum"]) for n in low)  # per rank
    for t in steps[2:]:
        set_lr(opt, t)
        set_grads(params, grads(rank, t))
        opt.step()
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    twin = {n: torch.nn.Parameter(torch.zeros(PARAMS[n][0])) for n in PARAMS}
    twin_opt = build("dion", mode, opts, clip, twin)
    with torch.no_grad():
        for n, p in twin.items():
            p.copy_(saved["params"][n])
    twin_opt.load_state_dict(copy.deepcopy(saved["opt"]))
    assert twin_opt.steps_done == 2
    for t in steps[2:]:
        set_lr(twin_opt, t)
        set_grads(twin, grads(rank, t))
        twin_opt.step()
    for n in PARAMS:
        assert torch.equal(params[n], twin[n]), f"round trip: {n} differs"
        for key, value in opt.state[params[n]].items():
            assert torch.equal(value, twin_opt.state[twin[n]][key]), f"round trip: state {key} of {n} differs"


def check_muon(rank: int, P: int) -> None:
    n_params = sum(math.prod(shape) for shape, _, _ in PARAMS.values())
    for mode, wire in (("fp32", 4), ("bf16", 2)):
        params = {n: torch.nn.Parameter(x) for n, x in init_params(torch.float32).items()}
        opt = build("muon", mode, {"matrix_lr": MATRIX_LR}, 1.0, params)
        assert opt.wire_bytes_per_step() == {"grad_sync": (wire * n_params, wire * n_params)}
        for t in range(2):
            set_lr(opt, t)
            set_grads(params, grads(rank, t))
            report = opt.step()
            gs = report.phases["grad_sync"]
            assert (gs["bytes_sent"], gs["calls"]) == (wire * n_params, 1), gs
            assert report.phases["update_sync"]["calls"] == 0
            for n, p in params.items():
                assert identical_across_ranks(p.detach()), f"muon {mode}: {n} differs across ranks at step {t}"
                assert not torch.equal(p.detach(), init_params(torch.float32)[n])


def main() -> None:
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    from _checks import Checks  # tests/workers/ is the script's directory
    checks = Checks(CHECKS)
    lines = [checks.run("dion_fp32_rank_half", check_dion, rank, P, "fp32", {"rank_fraction": 0.5}, 0.0),
             checks.run("dion_bf16_rank_quarter", check_dion, rank, P, "bf16", {"rank_fraction": 0.25}, 0.0),
             checks.run("dion_fp32_clipped", check_dion, rank, P, "fp32", {"rank_fraction": 0.25}, 2.0)]
    checks.run("dion_round_trip", check_round_trip, rank, P)
    checks.run("muon", check_muon, rank, P)
    dist.barrier()
    if rank == 0:
        print(f"P={P}: " + "; ".join(map(str, lines)))
    dist.destroy_process_group()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main()
    exit_cleanly()
