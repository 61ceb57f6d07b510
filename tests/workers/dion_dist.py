"""Per-rank checks of distributed Dion, Dion Alg. 2 (launched by tests/optim/test_dion_math.py).

Every rank draws its own gradients (seeded by rank and step) for several matrices of different
shapes and ranks and runs T steps of optim.dion_math.dion_step_ with a data-parallel
reduce_mean; every rank can also draw every other rank's gradients, so each runs the
centralized Dion (Alg. 1, no reduce) on the mean gradient in float64 as the reference.
Three runs: float64 state with a float64 allreduce (written here: the callback is the caller's),
float32 with make_reduce_mean (float32 wire), float32 with make_reduce_mean(bfloat16 wire).

Exact (every run, every step):
  - X and Q (and P, R) bit-identical on all ranks; exactly two reduce_mean calls per step;
  - bytes booked by comm.CommStats per step == dion_wire_bytes(shapes, wire dtype);
  - error feedback commutes with the mean: mean_i M_i = mean_i B_i - (1 - mu) P R^T for the P, R
    the step used, up to the rounding of that one line, elementwise
    (u + gamma_(r+1)) * mean_i (|B_i| + (1 - mu) |P| |R|^T) (B_i = M_i + G_i rounded once more: u).
Up to rounding (after T steps), the run vs the float64 centralized run on the mean gradient
(Dion Thm. 2.1 holds in real arithmetic): relative error of X - X_0 and of mean_i M_i at most
T * A * eps, a first-order model:
  eps = sqrt(max(m, n)) u_c + P u_w : one step's relative perturbation of the exchanged factors
        (products of inner dimension <= max(m, n) in the compute precision, probabilistic sqrt
        growth; the wire cast plus the P - 1 additions of the allreduce in the wire precision)
  A   = per matrix, max over steps of (1 + sqrt(2) c_A)(1 + 2 c_R), measured on the float64 reference:
        c_A = ||B Q||_F / (sqrt(r) sigma_r(B Q)) is QR's amplification (Sun 1991:
        ||dQ||_F <= sqrt(2) ||dA||_F / sigma_r(A)); c_R = ||R||_F / (sqrt(r) min_j ||R_j||) is
        ColumnNormalize's (|d(x/|x|)| <= 2 |dx| / |x|).
  Steps add (first order; a step's fresh gradient dominates B, so an earlier error is not
  re-amplified as a product).
Each run is a named check (CHECKS; tests/workers/_checks.py records its outcome).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

import comm
from optim.dion_math import (dion_factor_rows, dion_step_, dion_transposed, dion_wire_bytes, init_dion_q,
                             make_reduce_mean)
from optim.orthogonal import orthonormalize_columns

SHAPES = [(24, 40, 6), (48, 16, 4), (32, 32, 8), (20, 12, 12)]  # (m, n, r): r = ceil(min/4); full rank
T = 3
MU, WD = 0.9, 0.1
LRS = [0.05, 0.04, 0.05, 0.03]
CHECKS = ("fp64", "fp32", "bf16_wire")


def gamma(k: int, u: float) -> float:
    return k * u / (1 - k * u)


def grads(rank: int, step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    return [torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype) for m, n, _ in SHAPES]


def init_state(dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)  # identical on every rank
    X = [torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype) for m, n, _ in SHAPES]
    M = [torch.zeros(m, n, dtype=dtype) for m, n, _ in SHAPES]
    Q = [init_dion_q(dion_factor_rows(m, n)[1], r, seed=100 + i, dtype=dtype) for i, (m, n, r) in enumerate(SHAPES)]
    return X, M, Q


def mean_over_ranks(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """float64 mean, for checking (a float64 SUM of float32 values is exact to ~1e-16)."""
    flat = torch.cat([t.double().reshape(-1) for t in ts])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    return [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in ts]), ts)]


def fp64_reduce_mean(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.to(ts[0].dtype) for t in mean_over_ranks(ts)]


def identical_across_ranks(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(parts[0], x) for x in parts[1:])


def reference(P: int):
    """Centralized Dion (Alg. 1) on the mean gradient in float64, and each matrix's A."""
    X, M, Q = init_state(torch.float64)
    amp = [1.0] * len(SHAPES)
    for t in range(T):
        mean_g = [sum(gs) / P for gs in zip(*[grads(i, t, torch.float64) for i in range(P)])]
        for k, (m, n, r) in enumerate(SHAPES):
            B = M[k] + mean_g[k]
            if dion_transposed(m, n):  # wide: the power iteration runs on B^T
                B = B.mT
            A = B @ Q[k]
            c_a = (torch.linalg.matrix_norm(A) / (math.sqrt(r) * torch.linalg.svdvals(A)[-1])).item()
            R = B.mT @ orthonormalize_columns(A)
            norms = R.norm(dim=0)
            c_r = (R.norm() / (math.sqrt(r) * norms.min())).item()
            amp[k] = max(amp[k], (1 + math.sqrt(2) * c_a) * (1 + 2 * c_r))
        dion_step_(X, mean_g, M, Q, lr=LRS, mu=MU, weight_decay=WD)
    return X, M, amp


def run(name: str, dtype: torch.dtype, wire: torch.dtype, rank: int, P: int, ref) -> str:
    X_ref, M_ref, amp = ref
    stats = comm.CommStats()
    base = fp64_reduce_mean if wire == torch.float64 else make_reduce_mean(wire_dtype=wire, stats=stats)
    calls = []

    def reduce_mean(ts):
        calls.append(len(ts))
        return base(ts)

    u_c = torch.finfo(dtype).eps / 2
    X, M, Q = init_state(dtype)
    X0 = [x.clone() for x in X]
    for t in range(T):
        G = grads(rank, t, dtype)
        B = [m + g for m, g in zip(M, G)]  # the step's B_i, same rounding
        calls.clear()
        stats.begin_step()
        factors = dion_step_(X, G, M, Q, lr=LRS, mu=MU, weight_decay=WD, reduce_mean=reduce_mean)
        assert calls == [len(SHAPES), len(SHAPES)], (name, calls)
        if wire != torch.float64 and P > 1:
            assert stats.step_summary()["bytes_sent"] == dion_wire_bytes(SHAPES, wire), (name, stats.step_summary())
            assert stats.step_summary()["calls"] == 2
        for x, q in zip(X, Q):
            assert identical_across_ranks(x) and identical_across_ranks(q), f"{name}: ranks differ at step {t}"
        for f in factors:
            assert identical_across_ranks(f.P) and identical_across_ranks(f.R)
        # error feedback commutes with the mean, whatever P and R were
        mean_m, mean_b, mean_abs_b = (mean_over_ranks(ts) for ts in (M, B, [b.abs() for b in B]))
        for k, (f, (m, n, r)) in enumerate(zip(factors, SHAPES)):
            PR = f.P.double() @ f.R.double().mT
            if dion_transposed(m, n):  # the factors of B^T
                PR = PR.mT
            lhs = (mean_m[k] - (mean_b[k] - (1 - MU) * PR)).abs()
            absPR = f.P.double().abs() @ f.R.double().abs().mT
            if dion_transposed(m, n):
                absPR = absPR.mT
            bound = (u_c + gamma(r + 1, u_c)) * (mean_abs_b[k] + (1 - MU) * absPR)
            assert (lhs <= bound * (1 + 1e-9) + 1e-300).all(), (name, t, k, (lhs - bound).max().item())

    mean_m = mean_over_ranks(M)
    u_w = torch.finfo(wire).eps / 2
    eps = math.sqrt(max(max(m, n) for m, n, _ in SHAPES)) * u_c + P * u_w
    worst, tol = 0.0, 0.0
    for k in range(len(SHAPES)):
        tol = T * amp[k] * eps
        change = torch.linalg.matrix_norm(X_ref[k] - X0[k].double())
        ex = (torch.linalg.matrix_norm(X[k].double() - X_ref[k]) / change).item()
        em = (torch.linalg.matrix_norm(mean_m[k] - M_ref[k]) / torch.linalg.matrix_norm(M_ref[k])).item()
        assert ex <= tol and em <= tol, (name, SHAPES[k], ex, em, tol)
        if max(ex, em) / tol > worst:
            worst, detail = max(ex, em) / tol, f"{max(ex, em):.1e} <= {tol:.1e} for {SHAPES[k]}"
    return f"{name}: closest to its tolerance {detail} (A = {max(amp):.0f})"


def main() -> None:
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ref = reference(P)
    from _checks import Checks  # tests/workers/ is the script's directory
    checks = Checks(CHECKS)
    lines = [checks.run("fp64", run, "fp64", torch.float64, torch.float64, rank, P, ref),
             checks.run("fp32", run, "fp32", torch.float32, torch.float32, rank, P, ref),
             checks.run("bf16_wire", run, "bf16 wire", torch.float32, torch.bfloat16, rank, P, ref)]
    dist.barrier()
    if rank == 0:
        print(f"P={P}: " + "; ".join(map(str, lines)))
    dist.destroy_process_group()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main()
    exit_cleanly()
