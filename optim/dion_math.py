"""Dion's update (Ahn & Xu 2025) as pure tensor functions: one power iteration with error
feedback for each m x n weight, centralized (Dion Alg. 1) and data-parallel (Dion Alg. 2).

Owns the rank rule (dion_rank), the orientation rule (dion_transposed, dion_factor_rows), the
seeded right factor (init_dion_q), the step over a list of matrices (dion_step_), the exact wire
volume (dion_wire_elements / dion_wire_bytes), the batched mean-allreduce callback over
comm.allreduce_mean (make_reduce_mean) and the rank-r diagnostics.

Per matrix X (m, n) = (fan_out, fan_in) of an nn.Linear weight, with state M (m, n), Q (n, r),
on every data-parallel rank i with its own gradient G_i and momentum M_i and the shared Q
(written for m >= n; see "Orientation" for wide matrices):
    B_i = M_i + G_i
    P   = Orthonormalize( mean_i B_i Q )        mean-allreduce #1 (all P of the step, one call)
    R   = mean_i B_i^T P                        mean-allreduce #2 (all R of the step, one call)
    M_i = B_i - (1 - mu) P R^T                  error feedback: only the applied part decays
    Q   = ColumnNormalize(R)
    X   = (1 - lr*wd) X - lr * sqrt(m/n) * P Q^T
With one rank this is Alg. 1. Alg. 2 equals Alg. 1 run on the mean gradient (Dion Thm. 2.1):
mean_i B_i Q = (mean_i B_i) Q and mean_i B_i^T P = (mean_i B_i)^T P by linearity, so by induction
mean_i M_i is the centralized momentum and P, R, Q, X are the centralized ones. In floating point
the two sides differ by the rounding of those products (and by the wire dtype's rounding); the
identity mean_i M_i = mean_i B_i - (1 - mu) P R^T holds for whatever P, R were used, and P, R, Q,
X are bit-identical on every rank because every rank computes them from the same reduced bits.

Orientation. For a wide matrix (m < n) the step runs on the transpose by default, as
microsoft/dion's `dion_reference` does (it transposes so that dim0 >= dim1): B^T (n, m) takes B's
place above, so P = Orthonormalize(B^T Q) is n x r, R = B P and Q are m x r, the error feedback
is M_i = B_i - (1 - mu) R P^T and the update X -= lr sqrt(m/n) Q P^T. The power iteration's left
factor P then always lives on the longer side and Q (the state carried across steps) on the
shorter one, min(m, n) x r. transpose_wide=False keeps P = B Q on the m side for every shape
(this project's first convention; Q is n x r). Both are Dion; they are different algorithms on
wide matrices (the one-step power iteration approximates the leading subspace from the other
side, and the trajectories part by more than the weights move), equal on square and tall ones.
The wire volume (m + n) r per matrix is the same; only the split between the P call (max(m, n) r
by default) and the R call (min(m, n) r) changes.

Scale sqrt(m/n) = sqrt(fan_out/fan_in) of X's own shape in either orientation (Dion §2.1;
microsoft/dion's sqrt(X.size(0)/X.size(1)), taken from the untransposed weight).
Q starts as a random orthonormal frame from a seed, so every rank draws the same Q without a
broadcast (microsoft/dion draws a Gaussian Q and broadcasts it). Computation is in float32 (float64 for float64 state).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

import comm
from .orthogonal import ORTHO_METHODS, _compute_dtype, dion_scale, orthonormalize_columns

ReduceMean = Callable[[list[torch.Tensor]], list[torch.Tensor]]
DEFAULT_RANK_FRACTION = 0.25  # Dion §3 main results: r = d/4 (also d/8, d/16)


def dion_rank(m: int, n: int, *, rank_fraction: float = DEFAULT_RANK_FRACTION, rank: int | None = None) -> int:
    """Rank r of Dion's factors for an (m, n) matrix: `rank` when given (1 <= rank <= min(m, n)),
    else ceil(rank_fraction * min(m, n)) with rank_fraction in (0, 1] (at least 1)."""
    if isinstance(m, bool) or isinstance(n, bool) or not (isinstance(m, int) and isinstance(n, int)) \
            or m < 1 or n < 1:
        raise ValueError(f"dion_rank: shape ({m}, {n}) is not a non-empty matrix")
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"dion rank={rank!r}; need an int >= 1, or leave rank unset and use rank_fraction")
        if rank > min(m, n):
            raise ValueError(f"dion rank={rank} exceeds min(m, n)={min(m, n)} of the ({m}, {n}) matrix; "
                             f"use rank <= {min(m, n)} or a rank_fraction in (0, 1]")
        return rank
    if isinstance(rank_fraction, bool) or not isinstance(rank_fraction, (int, float)) \
            or not 0.0 < rank_fraction <= 1.0:
        raise ValueError(f"dion rank_fraction={rank_fraction!r}; need 0 < rank_fraction <= 1 "
                         f"(the paper uses 1/4, 1/8, 1/16)")
    return max(1, math.ceil(rank_fraction * min(m, n)))


def dion_transposed(m: int, n: int, transpose_wide: bool = True) -> bool:
    """Whether dion_step_ runs the power iteration on the transpose of an (m, n) matrix: for a wide
    one (m < n) when transpose_wide (the default, microsoft/dion's dion_reference), never otherwise."""
    return bool(transpose_wide) and m < n


def dion_factor_rows(m: int, n: int, transpose_wide: bool = True) -> tuple[int, int]:
    """(rows of P, rows of Q and R) of an (m, n) matrix's factors: (max(m, n), min(m, n)) by
    default, (m, n) with transpose_wide=False. init_dion_q takes the second."""
    return (n, m) if dion_transposed(m, n, transpose_wide) else (m, n)


def init_dion_q(n: int, r: int, *, seed: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Initial right factor Q (n, r), n = dion_factor_rows(...)[1]: a random orthonormal frame
    (the QR factor of a Gaussian matrix) drawn on the CPU in float64 from `seed`, so every rank
    (and every device type) gets the same bits; give each matrix its own seed. Only span and conditioning matter
    (Orthonormalize(B Q D) = Orthonormalize(B Q) for a positive diagonal D): an orthonormal frame
    keeps B Q as well conditioned as B, where a square Gaussian Q at full rank can be nearly
    singular; its unit columns match the state after every step."""
    if not 1 <= r <= n:
        raise ValueError(f"init_dion_q: r={r} must lie in [1, n={n}]")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    q = orthonormalize_columns(torch.randn(n, r, generator=gen, dtype=torch.float64))
    return q.to(dtype=dtype, device=device)


def dion_wire_elements(shapes: Iterable[tuple[int, int, int]]) -> int:
    """Elements one rank hands to the two mean-allreduces of one step, for matrices (m, n, r):
    P and R are m x r and n x r (or n x r and m x r, transposed), so sum of (m + n) * r (Dion
    §2.2: "(m + n) r per step") in either orientation."""
    total = 0
    for m, n, r in shapes:
        if not 1 <= r <= min(m, n):
            raise ValueError(f"dion_wire_elements: rank {r} is not in [1, min(m, n)] for ({m}, {n})")
        total += (m + n) * r
    return total


def dion_wire_bytes(shapes: Iterable[tuple[int, int, int]], wire_dtype: torch.dtype = torch.float32) -> int:
    """Bytes one rank hands to collectives per step: dion_wire_elements * the wire itemsize (what
    comm.CommStats books as bytes_sent). Cheaper than a gradient allreduce only where
    (m + n) r < m n; microsoft/dion allreduces the gradient instead for the others."""
    return dion_wire_elements(shapes) * torch.empty((), dtype=wire_dtype).element_size()


def make_reduce_mean(group=None, wire_dtype: torch.dtype = torch.float32,
                     stats: comm.CommStats | None = None) -> ReduceMean:
    """The data-parallel mean for dion_step_: packs all tensors of one call into one flat buffer
    and makes ONE comm.allreduce_mean on it (SUM in `wire_dtype`, float32 or bfloat16, divided by
    the world size after casting back). Results are identical on every rank."""
    def reduce_mean(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if not tensors:
            return []
        flat = torch.cat([t.reshape(-1) for t in tensors])
        comm.allreduce_mean(flat, wire_dtype=wire_dtype, group=group, stats=stats, inplace=True)
        return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    return reduce_mean


@dataclass
class DionFactors:
    """What one matrix's step used: P (m, r) orthonormal columns and R (n, r) = mean_i B_i^T P,
    both identical on every rank, in the compute dtype; for a transposed matrix (dion_transposed)
    B is read as B^T, so P is (n, r) and R (m, r). With diagnostics, `residual_norm` is
    ||B_i - P R^T||_F (the part of this rank's B that was not applied and stays in M_i beyond
    the decayed mu P R^T) and `rel_error` = residual_norm / ||B_i||_F, the relative error of the
    rank-r approximation (0-dim float64 tensors, this rank's B_i; None without diagnostics)."""
    P: torch.Tensor
    R: torch.Tensor
    residual_norm: torch.Tensor | None = None
    rel_error: torch.Tensor | None = None


def _per_matrix(value, k: int, name: str) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)] * k
    values = [float(v) for v in value]
    if len(values) != k:
        raise ValueError(f"dion_step_: {name} has {len(values)} entries for {k} matrices; give one "
                         "number or one per matrix")
    return values


def dion_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], momenta: Sequence[torch.Tensor],
               qs: Sequence[torch.Tensor], *, lr: float | Sequence[float], mu: float = 0.95,
               weight_decay: float | Sequence[float] = 0.0, scale: float | Sequence[float] | None = None,
               reduce_mean: ReduceMean | None = None, ortho: str = "qr", eps: float = 1e-8,
               diagnostics: bool = False, error_feedback: bool = True,
               transpose_wide: bool = True) -> list[DionFactors]:
    """One Dion step for every matrix of the lists, in place: params X (m, n), momenta M (m, n) and
    right factors Q (k, r) are updated, k = dion_factor_rows(m, n, transpose_wide)[1] (min(m, n)
    by default, n with transpose_wide=False); grads G (m, n) are read. Returns one DionFactors each.

    reduce_mean(list) -> list of the means over data-parallel ranks (same shapes). It is called
    exactly twice per call, once with every matrix's P and once with every R, so a caller steps
    all matrices with two collectives (make_reduce_mean packs each call into one allreduce; its
    wire_dtype=torch.bfloat16 exchanges P and R in bf16). None: one process, or gradients already
    averaged (then momenta are identical and nothing needs reducing).
    lr, weight_decay, scale: one number or one per matrix; scale None is dion_scale(m, n) =
    sqrt(fan_out/fan_in). mu: momentum decay (Dion's 0.95). ortho: "qr" | "cholesky_qr" (see
    orthonormalize_columns). eps: added to R's column norms in the update's ColumnNormalize
    (microsoft/dion's 1e-8), so an all-zero B moves X by weight decay only. transpose_wide: run
    wide matrices (m < n) on their transpose (the module docstring's "Orientation").
    """
    k = len(params)
    if not (len(grads) == len(momenta) == len(qs) == k):
        raise ValueError(f"dion_step_: {k} params, {len(grads)} grads, {len(momenta)} momenta, {len(qs)} Q's; "
                         "need one of each per matrix")
    if not 0.0 <= mu < 1.0:
        raise ValueError(f"dion_step_: mu={mu}; need 0 <= mu < 1 (the paper uses 0.95)")
    if ortho not in ORTHO_METHODS:
        raise ValueError(f"dion_step_: ortho={ortho!r}; valid methods: {list(ORTHO_METHODS)}")
    lrs = _per_matrix(lr, k, "lr")
    wds = _per_matrix(weight_decay, k, "weight_decay")
    scales = [dion_scale(*X.shape) for X in params] if scale is None else _per_matrix(scale, k, "scale")
    for i, (X, G, M, Q) in enumerate(zip(params, grads, momenta, qs)):
        if X.ndim != 2 or G.shape != X.shape or M.shape != X.shape:
            raise ValueError(f"dion_step_: matrix {i}: param {tuple(X.shape)}, grad {tuple(G.shape)}, momentum "
                             f"{tuple(M.shape)}; need three equal 2-D shapes")
        k_rows = dion_factor_rows(*X.shape, transpose_wide)[1]
        if Q.ndim != 2 or Q.size(0) != k_rows or not 1 <= Q.size(1) <= min(X.shape):
            raise ValueError(f"dion_step_: matrix {i}: Q has shape {tuple(Q.shape)} for a {tuple(X.shape)} param "
                             f"with transpose_wide={transpose_wide}; need ({k_rows}, r) with 1 <= r <= "
                             f"{min(X.shape)} (see dion_factor_rows, dion_rank, init_dion_q)")
    # a transposed matrix runs on views: X^T, G^T, M^T take the places of X, G, M below, and every
    # in-place update of a view lands in the matrix itself
    flip = [dion_transposed(*X.shape, transpose_wide) for X in params]
    params = [X.mT if f else X for X, f in zip(params, flip)]
    grads = [G.mT if f else G for G, f in zip(grads, flip)]
    momenta = [M.mT if f else M for M, f in zip(momenta, flip)]

    # B_i = M_i + G_i, kept in the momentum buffer; P_i = B_i Q (local)
    Bs, P_local = [], []
    for G, M, Q in zip(grads, momenta, qs):
        if not error_feedback:  # the ablation of Dion §4.1: M = mu M + G, approximated directly
            M.mul_(mu)
        M.add_(G.to(M.dtype))
        B = M.to(_compute_dtype(M.dtype))  # M itself for float32 / float64 state
        Bs.append(B)
        P_local.append(B @ Q.to(B.dtype))
    P_mean = reduce_mean(P_local) if reduce_mean is not None else P_local
    Ps, R_local = [], []
    for B, Pm in zip(Bs, P_mean):
        P = orthonormalize_columns(Pm.to(B.dtype), ortho)
        Ps.append(P)
        R_local.append(B.mT @ P)
    R_mean = reduce_mean(R_local) if reduce_mean is not None else R_local

    out = []
    for i, (X, M, Q) in enumerate(zip(params, momenta, qs)):
        B, P, R = Bs[i], Ps[i], R_mean[i].to(Bs[i].dtype)
        factors = DionFactors(P, R)
        if diagnostics:
            # ||B_i - P R^T||^2 = ||B_i||^2 - 2 <B_i^T P, R> + ||R||^2 since P^T P = I; float64
            # scalars limit the cancellation when the residual is small
            b2 = B.double().square().sum()
            sq = b2 - 2.0 * (R_local[i].double() * R.double()).sum() + R.double().square().sum()
            factors.residual_norm = sq.clamp_min(0.0).sqrt()
            factors.rel_error = factors.residual_norm / b2.sqrt().clamp_min(torch.finfo(torch.float64).tiny)
        # error feedback (Alg. 1 line 7): M_i = B_i - (1 - mu) P R^T (the ablation keeps M = B)
        if error_feedback:
            M.addmm_(P.to(M.dtype), R.mT.to(M.dtype), alpha=-(1.0 - mu))
        norms = torch.linalg.vector_norm(R, dim=0, keepdim=True)
        Q_update = R / (norms + eps)
        # the state keeps the old column where R's column is exactly 0 (B = 0 on every rank): a
        # zero Q column would give a zero column of B Q next step, which QR fills with an
        # arbitrary unit vector instead of the warm start; the update uses 0 there
        Q.copy_(torch.where(norms > 0, R / norms.clamp_min(torch.finfo(R.dtype).tiny), Q.to(R.dtype)))
        # X = (1 - lr*wd) X - lr * scale * P Q^T  (Alg. 1 line 9 with decoupled weight decay)
        X.addmm_(P.to(X.dtype), Q_update.mT.to(X.dtype), beta=1.0 - lrs[i] * wds[i], alpha=-lrs[i] * scales[i])
        out.append(factors)
    return out


ShardSum = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def dion_mesh_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], momenta: Sequence[torch.Tensor],
                    qs: Sequence[torch.Tensor], *, flip: Sequence[bool], shard_dim: Sequence[int],
                    shard_start: Sequence[int], lr: Sequence[float], weight_decay: Sequence[float],
                    scale: Sequence[float], shard_sum: ShardSum, shard_gather: ShardSum,
                    reduce_mean: ReduceMean | None = None, mu: float = 0.95, ortho: str = "qr", eps: float = 1e-8,
                    diagnostics: bool = False, error_feedback: bool = True) -> list[DionFactors]:
    """dion_step_ on the shards of the matrices (hybrid sharding: FSDP2 gives every rank of a shard
    group the block [s, s + s_j) of dimension `shard_dim` of each X, M, G; `shard_start` gives s).
    As in dion_step_, a `flip`ped matrix runs on its transpose: A = B^T, else A = B, and P = A Q is
    on A's rows, Q and R on its columns. Dion Alg. 2 shards the columns of A (the side of Q; "q-side":
    shard_dim 1 not flipped, or 0 flipped). With the local column block A_j and Q_j:
        P   = Orthonormalize(mean_replicas sum_shards A_j Q_j)      Distributed-PowerIter1 (whole, m x r)
        R_j = mean_replicas A_j^T P                                  local rows of R
        Q_j = R_j / sqrt(sum_shards colnorm^2(R_j))                  Distributed-ColumnNormalize
        M_j = A_j - (1 - mu) P R_j^T,  X_j -= lr scale P Q_j^T       on the local block
    The shard axis carries the partial P (m r) and the r column sums of squares: Dion Table 1's
    (m + 1) r, m the side of P. Where A's rows are sharded instead ("p-side", the fallback when
    FSDP2 cannot split Q's side evenly) P_j = A_j Q is local (Q whole on every rank), its replica mean
    is all-gathered over the shard group (the orthonormalization needs all of P's rows: c r, c the
    padded block) and R = sum_shards A_j^T P_j (n r) is summed before its replica mean; ColumnNormalize
    is local. The error feedback and the update are the same products on the local block either way.
    Collectives, each ONE call over all matrices of the list (a call's list may be empty): shard_sum
    (q-side P), reduce_mean (every P), shard_gather (p-side P), shard_sum (p-side R), reduce_mean (every
    R), shard_sum (q-side column norms). reduce_mean None: the gradients are already the replicas'
    mean. By linearity every sum equals the centralized product (Dion Thm. 2.1), so the result is
    dion_step_'s on the whole matrices up to fp32 reduction order. lr, weight_decay, scale: one per
    matrix (scale: dion_scale of the whole matrix). Q is (s_j, r), this rank's block of the whole Q,
    on the q-side, else the whole Q. With diagnostics, residual_norm holds this rank's share of
    ||B - P R^T||^2 and rel_error its share of ||B||^2 (0-dim float64): summed over the shard group
    (and meaned over replicas) they are the whole matrices' values (Dion.`_diagnostics` does that)."""
    k = len(params)
    # A orientation: a flipped matrix's views; in-place updates of a view land in the matrix
    params = [X.mT if f else X for X, f in zip(params, flip)]
    grads = [G.mT if f else G for G, f in zip(grads, flip)]
    momenta = [M.mT if f else M for M, f in zip(momenta, flip)]
    q_side = [(d == 1) != f for d, f in zip(shard_dim, flip)]
    Bs, P_part = [], []
    for G, M, Q in zip(grads, momenta, qs):
        if not error_feedback:
            M.mul_(mu)
        M.add_(G.to(M.dtype))
        B = M.to(_compute_dtype(M.dtype))
        Bs.append(B)
        P_part.append(B @ Q.to(B.dtype))
    qi = [i for i in range(k) if q_side[i]]
    pi = [i for i in range(k) if not q_side[i]]
    for i, t in zip(qi, shard_sum([P_part[i] for i in qi])):
        P_part[i] = t
    P_mean = reduce_mean(P_part) if reduce_mean is not None else P_part
    whole = shard_gather([P_mean[i] for i in pi])
    Ps: list[torch.Tensor] = [None] * k
    for i in qi:
        Ps[i] = orthonormalize_columns(P_mean[i].to(Bs[i].dtype), ortho)
    whole_rows = {}
    for i, W in zip(pi, whole):
        P_full = orthonormalize_columns(W.to(Bs[i].dtype), ortho)
        whole_rows[i] = P_full.shape[0]
        Ps[i] = P_full[shard_start[i]:shard_start[i] + Bs[i].shape[0]]
    R_part = [B.mT @ P for B, P in zip(Bs, Ps)]
    R_in = list(R_part)
    for i, t in zip(pi, shard_sum([R_part[i] for i in pi])):
        R_in[i] = t
    R_mean = reduce_mean(R_in) if reduce_mean is not None else R_in
    R_mean = [R.to(B.dtype) for R, B in zip(R_mean, Bs)]
    sq = [torch.linalg.vector_norm(R, dim=0, keepdim=True).square() for R in R_mean]
    for i, t in zip(qi, shard_sum([sq[i] for i in qi])):
        sq[i] = t
    out = []
    for i in range(k):
        X, M, Q, B, P, R = params[i], momenta[i], qs[i], Bs[i], Ps[i], R_mean[i]
        factors = DionFactors(P, R)
        if diagnostics:
            # this rank's share of ||B||^2 - 2 <B^T P, R> + ||R||^2 (on the p-side R is whole on every
            # rank of the shard group: its ||R||^2 split by the rank's share of P's rows)
            b2 = B.double().square().sum()
            cross = (R_part[i].double() * R.double()).sum()
            r2 = R.double().square().sum()
            if not q_side[i]:
                r2 = r2 * (B.shape[0] / whole_rows[i])
            factors.residual_norm = b2 - 2.0 * cross + r2
            factors.rel_error = b2
        norms = sq[i].sqrt()
        if error_feedback:
            M.addmm_(P.to(M.dtype), R.mT.to(M.dtype), alpha=-(1.0 - mu))
        Q_update = R / (norms + eps)
        Q.copy_(torch.where(norms > 0, R / norms.clamp_min(torch.finfo(R.dtype).tiny), Q.to(R.dtype)))
        X.addmm_(P.to(X.dtype), Q_update.mT.to(X.dtype), beta=1.0 - lr[i] * weight_decay[i], alpha=-lr[i] * scale[i])
        out.append(factors)
    return out


def low_rank_residual(B: torch.Tensor, P: torch.Tensor, R: torch.Tensor) -> tuple[float, float]:
    """(||B - P R^T||_F, ||B - P R^T||_F / ||B||_F) formed explicitly in float64: the norm of the
    error-feedback residual and the relative error of the rank-r approximation (pass B^T for a
    transposed matrix, whose factors are P (n, r), R (m, r)). An m x n
    temporary; dion_step_(diagnostics=True) gets the same numbers without one."""
    B64 = B.double()
    res = torch.linalg.matrix_norm(B64 - P.double() @ R.double().mT).item()
    nb = torch.linalg.matrix_norm(B64).item()
    return res, (res / nb if nb > 0 else 0.0)


__all__ = ["DEFAULT_RANK_FRACTION", "DionFactors", "ReduceMean", "dion_factor_rows", "dion_rank", "dion_scale",
           "dion_mesh_step_", "dion_step_", "dion_transposed", "dion_wire_bytes", "dion_wire_elements", "init_dion_q",
           "low_rank_residual", "make_reduce_mean"]
