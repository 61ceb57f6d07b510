"""Orthonormalisation kernels for the matrix optimizers (Muon, Dion): pure tensor functions, no
optimizer state and no communication.

Owns:
  newton_schulz(G)            Muon's quintic Newton-Schulz iteration, an approximate polar factor
                              U V^T of G = U S V^T (Jordan et al., "Muon", as in modded-nanogpt)
  muon_update(g, m, beta)     Muon's momentum (EMA form, optional Nesterov) + newton_schulz
  muon_scale(m, n, kind)      the shape-aware factor the orthogonal update is multiplied by
  orthonormalize_columns(P)   the column orthonormalisation of Dion's power iteration (Dion Alg. 1
                              "Orthogonalize", Householder QR or Cholesky-QR2 with a QR fallback)
  dion_scale(m, n)            Dion's sqrt(m/n) update scale (Dion §2.1)

Shapes follow torch.nn.Linear: a weight is (out, in), so m = rows = fan_out, n = cols = fan_in.

What the Newton-Schulz output is, exactly. Each iteration X <- a X + b (X X^T) X + c (X X^T)^2 X
applies the odd polynomial p(x) = a x + b x^3 + c x^5 to every singular value and keeps the
singular vectors, so after normalising by the Frobenius norm and k steps the result is
U diag(phi(s_i / ||G||_F)) V^T with phi = p composed k times. The coefficients
(3.4445, -4.7750, 2.0315) maximise the slope at 0 (p'(0) = 3.4445) rather than converge to 1:
for k = 5, phi maps every x in [0.0015, 1] into [0.680, 1.203] (computed from p alone), and
x below 0.0015 to about 3.4445^5 x, i.e. much smaller singular values are not equalised.
"""
from __future__ import annotations

import math

import torch

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
ORTHO_METHODS = ("qr", "cholesky_qr")
MUON_SCALES = ("shape", "rms")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (reference runs in tests); everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def newton_schulz(G: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximate orthogonal polar factor of G (..., m, n), batched over leading dimensions.

    dtype None computes in bfloat16 on CUDA (as modded-nanogpt and torch.optim.Muon do; the
    iteration tolerates bf16) and float32 elsewhere; pass a dtype to force one (float64 gives the
    exact-arithmetic map to ~1e-12). The matrix is transposed so the Gram matrix X X^T is the
    smaller of the two, and divided by its Frobenius norm (at least eps) first so every singular
    value is <= 1, where p is designed to act. Returns a tensor of G's dtype and shape.

    Rounding. Each iteration is two fused multiply-adds, B = b A + c A A and X = a X + B X
    (addmm / baddbmm, as torch.optim.Muon): the GEMM accumulates in float32 and the sum is
    rounded to `dtype` once, where forming A A, scaling it and adding b A as three bf16 tensors
    rounds three times; the normalisation divides in float32 and rounds once. In bf16 this lands
    0.9-1.2 % (Frobenius, relative) from the exact-arithmetic map, as torch.optim.Muon does; the
    unfused form lands further off (tests/optim/test_orthogonal.py checks the bounds on CPU; the
    measurements are in docs/results/code_notes.md). The fused form is no slower."""
    if G.ndim < 2:
        raise ValueError(f"newton_schulz: G has shape {tuple(G.shape)}; need a matrix (..., m, n). "
                         "1-D parameters (biases, norms) belong to the scalar optimizer (AdamW/Lion)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"newton_schulz: steps={steps!r}; need an int >= 1 (Muon uses {NS_STEPS})")
    if dtype is None:
        dtype = torch.bfloat16 if G.is_cuda else torch.float32
    a, b, c = NS_COEFFS
    transposed = G.size(-2) > G.size(-1)
    X = G.mT if transposed else G
    if X.ndim > 3:  # baddbmm takes one batch dimension
        X = X.reshape(-1, *X.shape[-2:])
    # normalise in the accumulation dtype (float32 for bf16 input), round to `dtype` once
    work = X.to(_compute_dtype(dtype))
    norm = torch.linalg.vector_norm(work, dim=(-2, -1), keepdim=True)
    X = (work / norm.clamp_min(eps)).to(dtype)
    fma = torch.addmm if X.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        A = X @ X.mT                                  # (.., k, k) with k = min(m, n)
        B = fma(A, A, A, beta=b, alpha=c)             # b A + c A^2
        X = fma(X, B, X, beta=a)                      # a X + (b A + c A^2) X
    if G.ndim > 3:
        X = X.reshape(*G.shape[:-2], *X.shape[-2:])
    if transposed:
        X = X.mT
    return X.to(G.dtype)


def muon_scale(m: int, n: int, kind: str = "shape") -> float:
    """Factor the orthogonal update of an (m, n) = (fan_out, fan_in) matrix is multiplied by.

    "shape" (default): max(1, m/n) ** 0.5, Keller Jordan's Muon in modded-nanogpt; keeps the
                       update's RMS->RMS operator norm about 1 for tall matrices. Pairs with
                       Muon learning rates around 0.02 (the Dion paper's Muon grid is 0.01-0.05).
    "rms":             0.2 * sqrt(max(m, n)), Moonlight (Liu et al. 2025, "Muon is Scalable for
                       LLM Training", §2.2): the update's element RMS matches AdamW's (~0.2), so
                       AdamW's learning rate and weight decay can be reused unchanged."""
    if m < 1 or n < 1:
        raise ValueError(f"muon_scale: shape ({m}, {n}) has an empty dimension")
    if kind == "shape":
        return max(1.0, m / n) ** 0.5
    if kind == "rms":
        return 0.2 * math.sqrt(max(m, n))
    raise ValueError(f"muon_scale: kind={kind!r}; valid kinds: {list(MUON_SCALES)}")


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float, nesterov: bool = True,
                steps: int = NS_STEPS, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One Muon direction: momentum <- beta*momentum + (1-beta)*grad (in place), then the
    orthogonalised u = (1-beta)*grad + beta*momentum with nesterov (modded-nanogpt's form), else
    u = momentum. Returns newton_schulz(u), before the learning rate, muon_scale and weight decay
    (the caller applies X <- (1 - lr*wd) X - lr * muon_scale(m, n) * update). The EMA form of the
    momentum only rescales u, which the Frobenius normalisation removes."""
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"muon_update: beta={beta}; need 0 <= beta < 1 (Muon uses 0.95)")
    if grad.shape != momentum.shape:
        raise ValueError(f"muon_update: grad {tuple(grad.shape)} and momentum {tuple(momentum.shape)} differ")
    momentum.lerp_(grad.to(momentum.dtype), 1.0 - beta)
    u = grad.to(momentum.dtype).lerp(momentum, beta) if nesterov else momentum
    return newton_schulz(u, steps=steps, dtype=dtype)


def dion_scale(m: int, n: int) -> float:
    """sqrt(m/n) = sqrt(fan_out/fan_in) for an nn.Linear weight of shape (out, in) = (m, n): the
    factor every Dion experiment applies to the update (Dion §2.1; microsoft/dion uses
    sqrt(X.size(0) / X.size(1)) likewise)."""
    if m < 1 or n < 1:
        raise ValueError(f"dion_scale: shape ({m}, {n}) has an empty dimension")
    return math.sqrt(m / n)


def orthonormalize_columns(P: torch.Tensor, method: str = "qr") -> torch.Tensor:
    """Orthonormal basis of the columns of a tall P (m, r), m >= r: the Q factor of P = Q R with
    diag(R) >= 0, in float32 (float64 for float64 input).

    "qr": Householder QR (torch.linalg.qr; stable for any P, rank-deficient included), with the
          column signs fixed so diag(R) >= 0; that makes the result the unique QR factor and the
          same as Cholesky-QR's up to rounding.
    "cholesky_qr": CholeskyQR2, two passes of P <- P chol(P^T P)^-1: two small r x r
          factorisations and GEMMs, cheaper than Householder on a GPU. It is accurate while
          cond(P) < ~u^-1/2 (about 4e3 in float32); when a Cholesky factorisation fails
          (P numerically rank deficient) or the result is not finite, falls back to "qr"."""
    if method not in ORTHO_METHODS:
        raise ValueError(f"orthonormalize_columns: method={method!r}; valid methods: {list(ORTHO_METHODS)}")
    if P.ndim != 2 or P.size(0) < P.size(1):
        raise ValueError(f"orthonormalize_columns: P has shape {tuple(P.shape)}; need a tall matrix (m, r) "
                         "with m >= r (Dion's rank must not exceed min(m, n))")
    work = P.to(_compute_dtype(P.dtype))
    if method == "cholesky_qr":
        out = _cholesky_qr2(work)
        if out is not None:
            return out
    q, r = torch.linalg.qr(work, mode="reduced")
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(q.dtype)
    return q * signs


def _cholesky_qr2(P: torch.Tensor) -> torch.Tensor | None:
    """Two passes of Cholesky-QR; None when a factorisation fails or the result is not finite
    (the caller then uses Householder QR). The check costs one device sync per matrix."""
    for _ in range(2):
        U, info = torch.linalg.cholesky_ex(P.mT @ P, upper=True)  # P^T P = U^T U
        if int(info) != 0:
            return None
        P = torch.linalg.solve_triangular(U, P, upper=True, left=False)  # P U^-1
    if not bool(torch.isfinite(P).all()):
        return None
    return P


__all__ = ["MUON_SCALES", "NS_COEFFS", "NS_STEPS", "ORTHO_METHODS", "dion_scale", "muon_scale", "muon_update",
           "newton_schulz", "orthonormalize_columns"]
