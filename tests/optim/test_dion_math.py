"""optim.dion_math: Dion Alg. 1 on one process against independent float64 recomputations and the
SVD, the rank rule and its errors, the wire formula; Alg. 2 at P = 2 and 4 through
tests/workers/dion_dist.py.

Rounding bounds used below (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1):
a float sum or inner product of k terms, in any order and with or without FMA, is off by at most
gamma_k * (the same sum of absolute values), gamma_k = k u / (1 - k u), u the unit roundoff.
"""
from __future__ import annotations

import math

import pytest
import torch

from optim.dion_math import (DionFactors, dion_factor_rows, dion_rank, dion_scale, dion_step_, dion_transposed,
                             dion_wire_bytes, dion_wire_elements, init_dion_q, low_rank_residual, make_reduce_mean)
from tests.checks import Worker

U32 = torch.finfo(torch.float32).eps / 2


def gamma(k: int, u: float = U32) -> float:
    return k * u / (1 - k * u)


def random_state(m, n, r, seed, dtype=torch.float32, transpose_wide=True):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(m, n, generator=g).to(dtype)
    M = (0.3 * torch.randn(m, n, generator=g)).to(dtype)
    G = torch.randn(m, n, generator=g).to(dtype)
    return X, M, G, init_dion_q(dion_factor_rows(m, n, transpose_wide)[1], r, seed=seed + 1, dtype=dtype)


def working(m, n, transpose_wide=True):
    """The orientation dion_step_ works in: the transpose for a transposed (wide) matrix."""
    return (lambda T: T.mT) if dion_transposed(m, n, transpose_wide) else (lambda T: T)


def test_orientation_rule():
    assert dion_factor_rows(48, 32) == (48, 32) and dion_factor_rows(32, 32) == (32, 32)
    assert dion_factor_rows(32, 48) == (48, 32)                          # wide: P on n, Q on m
    assert dion_factor_rows(32, 48, transpose_wide=False) == (32, 48)    # the option: P on m
    assert dion_transposed(32, 48) and not dion_transposed(48, 32) and not dion_transposed(32, 32)
    assert not dion_transposed(32, 48, transpose_wide=False)


# ---- (c) one step at r < min(m, n) against a float64 recomputation ------------------------------
@pytest.mark.parametrize("m,n,transpose_wide", [(48, 32, True), (32, 48, True), (32, 48, False)])
def test_step_matches_float64_recomputation(m, n, transpose_wide):
    """In the working orientation (B^T for a transposed wide matrix: P is then n x r, R m x r)
    every line of Alg. 1; the scale stays sqrt(m/n) of X's own shape."""
    r = dion_rank(m, n)  # ceil(32 / 4) = 8
    assert r == 8
    mu, lr, wd, eps = 0.95, 0.02, 0.1, 1e-8
    X, M, G, Q = random_state(m, n, r, seed=m, transpose_wide=transpose_wide)
    X0, M0, Q0 = X.clone(), M.clone(), Q.clone()
    f, = dion_step_([X], [G], [M], [Q], lr=lr, mu=mu, weight_decay=wd, diagnostics=True,
                    transpose_wide=transpose_wide)
    step = lr * math.sqrt(m / n)
    w = working(m, n, transpose_wide)
    X, M, X0, M0, G = w(X), w(M), w(X0), w(M0), w(G)
    m, n = X.shape                       # from here on, the working orientation
    B = M0 + G                           # the float32 buffer the step builds (same rounding)
    P, R = f.P.double(), f.R.double()
    assert P.shape == (m, r) and R.shape == (n, r) and Q.shape == (n, r)
    B64, X64 = B.double(), X0.double()

    # P: orthonormal columns spanning B Q_old (Householder QR: orthogonality O(m r u))
    assert (P.mT @ P - torch.eye(r, dtype=torch.float64)).abs().max() <= 10 * m * r * U32
    A = B64 @ Q0.double()
    kappa = torch.linalg.cond(A).item()
    assert (A - P @ (P.mT @ A)).norm() <= 10 * m * r * U32 * kappa * A.norm()
    # R = B^T P, an inner product of length m per entry
    assert ((R - B64.mT @ P).abs() <= gamma(m) * (B64.abs().mT @ P.abs())).all()
    # error feedback, exactly B - (1 - mu) P R^T up to the rounding of that line: B + alpha P R^T
    # is an inner product of length r + 1 (addmm) after B = M + G was rounded once
    M_ref = B64 - (1 - mu) * P @ R.mT
    bound = (U32 + gamma(r + 1)) * (B64.abs() + (1 - mu) * P.abs() @ R.abs().mT)
    assert ((M.double() - M_ref).abs() <= bound).all()
    # Q = ColumnNormalize(R): unit columns along R
    # (a norm of n squares: gamma_n / 2 relative, then a sqrt and a division)
    assert torch.allclose(Q.double(), R / R.norm(dim=0), rtol=0, atol=gamma(n) / 2 + 3 * U32)
    # X = (1 - lr wd) X - lr sqrt(m/n) P (R / (|R| + eps))^T, m/n of the original shape (step above)
    Qu = R / (R.norm(dim=0) + eps)
    X_ref = (1 - lr * wd) * X64 - step * P @ Qu.mT
    bound = (U32 + gamma(r + 1)) * ((1 - lr * wd) * X64.abs() + step * P.abs() @ Qu.abs().mT) \
        + step * (gamma(n) / 2 + 4 * U32) * P.abs() @ Qu.abs().mT  # Qu's rounding: norm, + eps, division
    assert ((X.double() - X_ref).abs() <= bound).all()

    # diagnostics: the cheap ||B||^2 - 2<R, R> + ||R||^2 vs the explicit float64 residual; it
    # differs by the orthogonality error eta of P and the rounding of R (derived, first order)
    res, rel = low_rank_residual(B, f.P, f.R)
    eta = torch.linalg.matrix_norm(P.mT @ P - torch.eye(r, dtype=torch.float64), ord=2).item()
    sq_err = eta * R.norm().item() ** 2 + 2 * gamma(m) * (B64.abs().mT @ P.abs()).norm().item() * R.norm().item()
    assert abs(f.residual_norm.item() - res) <= sq_err / res + 1e-12 * res
    assert abs(f.rel_error.item() - rel) <= (sq_err / res + 1e-12 * res) / B64.norm().item()
    assert 0 < rel < 1
    # the rank-r residual can be no smaller than the best rank-r one (Eckart-Young)
    s = torch.linalg.svdvals(B64)
    assert res >= s[r:].square().sum().sqrt().item() * (1 - 1e-6)


def test_cholesky_qr_step_equals_qr_step():
    m, n = 40, 24
    r = dion_rank(m, n, rank_fraction=0.5)
    runs = []
    for method in ("qr", "cholesky_qr"):
        X, M, G, Q = random_state(m, n, r, seed=5)
        f, = dion_step_([X], [G], [M], [Q], lr=0.02, mu=0.95, ortho=method)
        runs.append((X, M, Q, f.P))
    (X1, M1, Q1, P1), (X2, M2, Q2, P2) = runs
    # both give the QR factor with diag(R) >= 0; they differ by the QR perturbation bound
    # sqrt(2) kappa(B Q) * O(m r u) of each method's backward error (Sun 1991)
    _, _, G, Q0 = random_state(m, n, r, seed=5)
    _, M0, _, _ = random_state(m, n, r, seed=5)
    kappa = torch.linalg.cond(((M0 + G) @ Q0).double()).item()
    tol = math.sqrt(2) * kappa * 20 * m * r * U32
    assert (P1 - P2).abs().max().item() <= tol
    assert (X1 - X2).abs().max().item() <= 0.02 * math.sqrt(m / n) * 4 * tol * r
    assert (Q1 - Q2).abs().max().item() <= 4 * tol * r * math.sqrt(m)


# ---- (b) full rank: plain momentum, and the polar factor once the power iteration converged -----
@pytest.mark.parametrize("m,n", [(10, 6), (6, 10), (8, 8)])
def test_full_rank_error_feedback_is_plain_momentum(m, n):
    """At r = min(m, n), P spans the column space of B, so P R^T = P P^T B = B and the error
    feedback gives M = mu B exactly in real arithmetic; in float32 up to the span error of the
    QR, O(m r u kappa(B Q)), and the rounding of the update line."""
    r = dion_rank(m, n, rank_fraction=1.0)
    assert r == min(m, n)
    mu = 0.9
    X, M, G, Q = random_state(m, n, r, seed=11 * m + n)
    w = working(m, n)
    B = w(M + G).double()
    kappa = torch.linalg.cond(B @ Q.double()).item()
    f, = dion_step_([X], [G], [M], [Q], lr=0.01, mu=mu)
    M = w(M)
    m, n = B.shape  # the working orientation
    # QR backward error O(m r u) ||A||_F tilts span P away from span A = col B by at most
    # 10 m r u sqrt(r) kappa(A) (constant 10 for Householder's small constants)
    span_err = 10 * m * r * math.sqrt(r) * U32 * kappa * B.norm().item()
    r_err = gamma(m) * (B.abs().mT @ f.P.double().abs()).norm().item()  # R = B^T P rounded
    line = (U32 + gamma(r + 1)) * (B.norm().item() + (1 - mu) * math.sqrt(r) * f.R.double().norm().item())
    assert (M.double() - mu * B).norm().item() <= (1 - mu) * (span_err + r_err) + line
    assert low_rank_residual(B, f.P, f.R)[0] <= span_err + r_err


@pytest.mark.parametrize("m,n", [(10, 6), (6, 10)])
def test_full_rank_converges_to_polar_factor(m, n):
    """Constant gradient G = U diag(s) V^T with s_j = rho^j (rho = 0.6), full rank, float64.
    With M = mu B (above) B_t is a positive multiple of G, and P_{t+1} = QR(B_{t+1} B_t^T P_t D)
    with D > 0 diagonal: orthogonal iteration on G G^T. Hence for the leading-j subspaces
    (Golub & Van Loan, Thm. 8.2.2) tan theta_j(t) <= rho^(2(t-1)) tan theta_j(1), with
    theta_j(1) measured after the first step from the random Q_0. From the angles:
      |p_j - s u_j| <= sqrt(2) sqrt(sin^2 theta_(j-1) + sin^2 theta_j)          (p_j in S_j, p_j _|_ S_(j-1))
      |q_j - s v_j| <= 2 s_1 / s_j * |p_j - s u_j|                              (q_j = B^T p_j / |B^T p_j|)
      ||P Q^T - U V^T||_F <= sum_j |p_j - s u_j| (1 + 2 s_1 / s_j)
    which the test checks at every step, and that it has fallen below 1e-6 by step 30."""
    rho, mu, k = 0.6, 0.95, min(m, n)
    g = torch.Generator().manual_seed(m * 100 + n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    s = rho ** torch.arange(k, dtype=torch.float64)
    G = U @ torch.diag(s) @ V.mT
    X = torch.zeros(m, n, dtype=torch.float64)
    M = torch.zeros_like(X)
    Q = init_dion_q(dion_factor_rows(m, n)[1], k, seed=3, dtype=torch.float64)
    if dion_transposed(m, n):  # the iteration runs on G^T = V S U^T: P tracks V
        U, V = V, U
    polar = U @ V.mT               # of the working orientation

    def tan_angles(P):
        # tan of the largest principal angle between span P[:, :j] and span U[:, :j]:
        # ||(P_j - U_j C) C^-1||_2 with C = U_j^T P_j (no cancellation, unlike via cosines)
        out = []
        for j in range(1, k + 1):
            C = U[:, :j].mT @ P[:, :j]
            out.append(torch.linalg.matrix_norm((P[:, :j] - U[:, :j] @ C) @ torch.linalg.inv(C), ord=2).item())
        return out

    tan1 = None
    for t in range(1, 31):
        f, = dion_step_([X], [G], [M], [Q], lr=0.0, mu=mu, eps=0.0)
        tans = tan_angles(f.P)
        if tan1 is None:
            tan1 = tans
        predicted = [rho ** (2 * (t - 1)) * x for x in tan1]
        assert all(a <= b * (1 + 1e-9) + 1e-12 for a, b in zip(tans, predicted)), (t, tans, predicted)
        sins = [0.0] + [min(1.0, x) for x in predicted]
        bound = sum(math.sqrt(2) * math.sqrt(sins[j] ** 2 + sins[j + 1] ** 2) * (1 + 2 * s[0].item() / s[j].item())
                    for j in range(k))
        err = torch.linalg.matrix_norm(f.P @ Q.mT - polar).item()  # Q is the new, unit-column Q
        assert err <= bound + 1e-10, (t, err, bound)
    assert bound < 1e-6 and err < 1e-6


# ---- wide matrices: microsoft/dion's transposed convention ----------------------------------------
def reference_transposed_dion(X, M, Q, grads, lr, mu, wd, eps=1e-8):
    """Dion Alg. 1 for a wide X (m < n) as microsoft/dion's dion_reference runs it, written out
    independently in float64: the power iteration on B^T (so P = B^T Q is n x r, Q and R m x r),
    error feedback M -= (1 - mu) R P^T, Q = R / |R|, X -= lr sqrt(m/n) (R / (|R| + eps)) P^T.
    Yields X after each step."""
    X, M, Q = X.double().clone(), M.double().clone(), Q.double().clone()
    m, n = X.shape
    assert m < n and Q.shape[0] == m
    for G in grads:
        B = M + G.double()
        P, _ = torch.linalg.qr(B.T @ Q)   # column signs do not matter: R P^T and Q P^T are invariant
        R = B @ P
        M = B - (1 - mu) * R @ P.T
        norms = R.norm(dim=0, keepdim=True)
        Q = R / norms
        X = (1 - lr * wd) * X - lr * math.sqrt(m / n) * (R / (norms + eps)) @ P.T
        yield X


@pytest.mark.parametrize("m,n,r", [(24, 40, 6), (16, 64, 3)])
def test_wide_matrix_follows_the_transposed_reference(m, n, r):
    """Ours (float32, default transpose_wide) against the float64 reference above from the same
    X, M, Q, over T steps: within 1e-4 of the distance the weights moved (float32 QR and GEMMs on
    matrices this size: ~1e-6, amplified by the power iteration's conditioning over the steps). The
    other convention (transpose_wide=False, Q n x r drawn from the same seed) is a different
    algorithm on wide matrices: it parts from the reference by more than 10 % of that distance."""
    T, lr, mu, wd = 5, 0.05, 0.95, 0.1
    X0, M0, _, Q0 = random_state(m, n, r, seed=m + n)
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(m, n, generator=g) for _ in range(T)]
    X, M, Q = X0.clone(), M0.clone(), Q0.clone()
    _, _, _, Q_rows = random_state(m, n, r, seed=m + n, transpose_wide=False)
    X2, M2 = X0.clone(), M0.clone()
    for t, X_ref in enumerate(reference_transposed_dion(X0, M0, Q0, grads, lr, mu, wd)):
        dion_step_([X], [grads[t]], [M], [Q], lr=lr, mu=mu, weight_decay=wd)
        dion_step_([X2], [grads[t]], [M2], [Q_rows], lr=lr, mu=mu, weight_decay=wd, transpose_wide=False)
        moved = (X_ref - X0.double()).norm().item()
        assert (X.double() - X_ref).norm().item() <= 1e-4 * moved, (t, (X.double() - X_ref).norm().item(), moved)
    assert Q.shape == (m, r) and Q_rows.shape == (n, r)
    assert (X2.double() - X_ref).norm().item() > 0.1 * moved


def test_square_and_tall_matrices_are_the_same_in_both_conventions():
    for m, n in ((32, 32), (40, 24)):
        r = dion_rank(m, n)
        runs = []
        for tw in (True, False):
            X, M, G, Q = random_state(m, n, r, seed=3, transpose_wide=tw)
            dion_step_([X], [G], [M], [Q], lr=0.05, transpose_wide=tw)
            runs.append((X, M, Q))
        assert all(torch.equal(a, b) for a, b in zip(*runs))


# ---- zero gradients, API errors ------------------------------------------------------------------
def test_zero_gradient_moves_by_weight_decay_only_and_recovers():
    m, n, r = 12, 20, 3  # wide: the step runs on the transpose, Q is m x r
    X = torch.randn(m, n)
    M = torch.zeros(m, n)
    Q = init_dion_q(m, r, seed=9)
    X0, Q0 = X.clone(), Q.clone()
    dion_step_([X], [torch.zeros(m, n)], [M], [Q], lr=0.1, mu=0.9, weight_decay=0.5)
    assert torch.equal(M, torch.zeros(m, n))
    assert torch.equal(Q, Q0)  # a zero R keeps the old Q, so B Q does not lose directions
    assert torch.allclose(X, 0.95 * X0, rtol=0, atol=1e-6)
    G = torch.randn(m, n)
    f, = dion_step_([X], [G], [M], [Q], lr=0.1, mu=0.9)
    q, rr = torch.linalg.qr(G.mT @ Q0)  # B = G: the first nonzero step starts from the kept Q
    assert torch.allclose(f.P, q * torch.sign(torch.diagonal(rr)), atol=1e-5)
    assert torch.allclose(Q.norm(dim=0), torch.ones(r), atol=1e-6)


def test_rank_rule_and_errors():
    assert dion_rank(768, 3072) == 192                        # d / 4
    assert dion_rank(768, 768, rank_fraction=1 / 16) == 48    # d / 16
    assert dion_rank(3, 5, rank_fraction=0.1) == 1            # at least 1
    assert dion_rank(64, 192, rank=64) == 64
    with pytest.raises(ValueError, match=r"rank=65 exceeds min\(m, n\)=64"):
        dion_rank(64, 192, rank=65)
    with pytest.raises(ValueError, match="rank=0"):
        dion_rank(64, 192, rank=0)
    for bad in (0.0, -0.25, 1.5, float("nan")):
        with pytest.raises(ValueError, match="rank_fraction"):
            dion_rank(64, 192, rank_fraction=bad)
    X, M, G, Q = random_state(8, 6, 2, seed=1)
    with pytest.raises(ValueError, match=r"Q has shape \(6, 7\)"):
        dion_step_([X], [G], [M], [torch.randn(6, 7)], lr=0.1)
    with pytest.raises(ValueError, match="lr has 2 entries for 1 matrices"):
        dion_step_([X], [G], [M], [Q], lr=[0.1, 0.2])
    with pytest.raises(ValueError, match="mu=1.0"):
        dion_step_([X], [G], [M], [Q], lr=0.1, mu=1.0)
    with pytest.raises(ValueError, match="ortho='svd'"):
        dion_step_([X], [G], [M], [Q], lr=0.1, ortho="svd")
    with pytest.raises(ValueError, match=r"rank 9 is not in \[1, min\(m, n\)\]"):
        dion_wire_elements([(8, 6, 9)])


def test_init_q_seeded_and_scale_independent():
    a = init_dion_q(50, 5, seed=42)
    assert torch.equal(a, init_dion_q(50, 5, seed=42))
    assert not torch.equal(a, init_dion_q(50, 5, seed=43))
    assert torch.allclose(a.norm(dim=0), torch.ones(5), atol=1e-6)
    # the step does not depend on the scale of Q's columns (QR of B Q D, D > 0 diagonal)
    X1, M1, G, Q1 = random_state(30, 50, 5, seed=2)
    X2, M2, _, _ = random_state(30, 50, 5, seed=2)
    Q2 = Q1 * torch.tensor([1.0, 3.0, 0.5, 10.0, 2.0])
    dion_step_([X1], [G], [M1], [Q1], lr=0.05)
    dion_step_([X2], [G], [M2], [Q2], lr=0.05)
    assert torch.allclose(X1, X2, atol=1e-5) and torch.allclose(Q1, Q2, atol=1e-5)


def test_many_matrices_two_reduce_calls_and_wire_formula():
    shapes = [(24, 40), (48, 16), (16, 16)]
    ranks = [dion_rank(m, n) for m, n in shapes]
    states = [random_state(m, n, r, seed=i) for i, ((m, n), r) in enumerate(zip(shapes, ranks))]
    seen = []

    def reduce_mean(ts):
        seen.append([tuple(t.shape) for t in ts])
        return make_reduce_mean()(ts)  # one process: a copy, no collective

    Xs, Ms, Gs, Qs = (list(x) for x in zip(*states))
    out = dion_step_(Xs, Gs, Ms, Qs, lr=[0.01, 0.02, 0.03], weight_decay=0.1, reduce_mean=reduce_mean)
    assert all(isinstance(f, DionFactors) for f in out)
    rows = [dion_factor_rows(m, n) for m, n in shapes]  # (24, 40) is wide: P (40, r), R (24, r)
    assert seen == [[(p, r) for (p, _), r in zip(rows, ranks)], [(q, r) for (_, q), r in zip(rows, ranks)]]
    assert seen[0][0] == (40, ranks[0]) and seen[1][0] == (24, ranks[0])
    elements = sum(math.prod(s) for call in seen for s in call)
    assert dion_wire_elements([(m, n, r) for (m, n), r in zip(shapes, ranks)]) == elements
    assert dion_wire_bytes([(m, n, r) for (m, n), r in zip(shapes, ranks)], torch.bfloat16) == 2 * elements
    # an identity reduce_mean gives bit for bit the single-process step
    states2 = [random_state(m, n, r, seed=i) for i, ((m, n), r) in enumerate(zip(shapes, ranks))]
    Xs2, Ms2, Gs2, Qs2 = (list(x) for x in zip(*states2))
    dion_step_(Xs2, Gs2, Ms2, Qs2, lr=[0.01, 0.02, 0.03], weight_decay=0.1)
    assert all(torch.equal(a, b) for a, b in zip(Xs + Ms + Qs, Xs2 + Ms2 + Qs2))
    assert dion_scale(48, 16) == math.sqrt(3)


# ---- (d) Dion Alg. 2 over gloo -------------------------------------------------------------------
DION_DIST = Worker("dion_dist.py", timeout=240)


@pytest.mark.parametrize("nproc,check", DION_DIST.cases([2, 4]))
def test_distributed_equals_centralized_on_mean_gradient(nproc, check):
    DION_DIST.check(nproc, check)
