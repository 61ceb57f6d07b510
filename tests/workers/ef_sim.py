"""A single-process simulation of comm.ef_compressed_allreduce over P workers and P servers,
written from torch ops and the collective's documented contract (its module docstring). Shared by
the workers that check the collective (comm_compressed.py) and the optimizers built on it
(ef_optim_dist.py)."""
from __future__ import annotations

import math

import torch

from comm import Compressor

LEVELS = 7   # int4 codes: q in [-7, 7]


def layout(n: int, Q: int, comp: Compressor) -> tuple[int, int]:
    """(chunk length c, block length B): ceil(n/Q) rounded up to 8 elements (1-bit), 2 (4-bit)
    or the block."""
    step = comp.block if comp.block else (2 if comp.kind == "int4" else 8)
    c = math.ceil(math.ceil(n / Q) / step) * step
    return c, (comp.block or c)


def sim_compress(v: torch.Tensor, valid: int, B: int, comp: Compressor,
                 u: torch.Tensor | None) -> torch.Tensor:
    """D(C(v)) for v float32[R*B] whose first `valid` elements are real."""
    V = v.view(-1, B)
    counts = torch.tensor([min(B, max(0, valid - j * B)) for j in range(V.shape[0])],
                          dtype=torch.float32)
    if comp.kind == "scaled_sign":
        # the sum order of the norm is the primitive's: the same primitive on the same shape
        if comp.scale == "mean_abs":
            s = torch.linalg.vector_norm(V, ord=1, dim=1) / counts.clamp(min=1)
        else:
            s = torch.linalg.vector_norm(V, ord=2, dim=1) / counts.clamp(min=1).sqrt()
        s = torch.where(counts > 0, s, 0.0)[:, None]
        return torch.where(V >= 0, s, -s).reshape(-1)      # sign(0) -> +1
    if comp.kind == "binary_stochastic":
        U = u.view(-1, B)
        if comp.bound is None:
            bound = V.abs().amax(dim=1, keepdim=True)
            inv = torch.where(bound > 0, 1.0 / bound, 0.0)
        else:
            bound, inv = torch.full((V.shape[0], 1), float(comp.bound)), 1.0 / comp.bound
        prob_plus = ((V * inv).clamp(-1.0, 1.0) + 1.0) * 0.5  # BinSGDM eq. 5
        return torch.where(U < prob_plus, bound, -bound).reshape(-1)
    amax = V.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, LEVELS / amax, 0.0)
    q = torch.round(V * inv).clamp(-LEVELS, LEVELS)
    return (q * (amax / LEVELS)).reshape(-1)


def sim_draws(gen: torch.Generator, valid: int, length: int, comp: Compressor) -> torch.Tensor | None:
    if comp.kind != "binary_stochastic":
        return None
    u = torch.ones(length)
    u[:valid] = torch.rand(valid, generator=gen)
    return u


def new_error(err: torch.Tensor, target: torch.Tensor, dec: torch.Tensor, beta: float) -> torch.Tensor:
    if beta == 0.0:
        return target - dec
    return err * beta + (target - dec) * (1.0 - beta)


def sim_exchange(srcs: list[torch.Tensor], werrs: list[torch.Tensor], serrs: list[torch.Tensor],
                 comp: Compressor, c: int, B: int, gens: list, beta: float) -> torch.Tensor:
    """Q workers (srcs[i]: the real elements) -> the Q*c decoded result; errors in place."""
    Q = len(srcs)
    nr = srcs[0].numel()
    pieces = []
    for i in range(Q):                       # workers
        y = torch.zeros(Q * c)
        y[:nr] = srcs[i].float() + werrs[i]
        dec = sim_compress(y, nr, B, comp, sim_draws(gens[i], nr, Q * c, comp))
        werrs[i].copy_(new_error(werrs[i], y[:nr], dec[:nr], beta))
        pieces.append(dec.view(Q, c))
    out = torch.zeros(Q * c)
    for r in range(Q):                       # owner of chunk r
        valid = min(c, max(0, nr - r * c))
        z = pieces[0][r].clone()
        for i in range(1, Q):
            z = z + pieces[i][r]
        z = z / Q + serrs[r]
        z[valid:] = 0.0
        dec = sim_compress(z, valid, B, comp, sim_draws(gens[r], valid, c, comp))
        e = new_error(serrs[r], z, dec, beta)
        e[valid:] = 0.0
        serrs[r].copy_(e)
        out[r * c:(r + 1) * c] = dec
    return out


def sim_call(xs, werrs, serrs, comp, gens, beta: float = 0.0, m: int = 1) -> torch.Tensor:
    """One ef_compressed_allreduce over all P = len(xs) ranks (node_size m; BinSGDM §4 when m > 1:
    node means, then the exchange per local index); returns the result."""
    P, n = len(xs), xs[0].numel()
    if n == 0:
        return torch.zeros(0)
    c, B = layout(n, P, comp)
    if m == 1:
        return sim_exchange(xs, werrs, serrs, comp, c, B, gens, beta)[:n]
    k, L = P // m, P // m * c
    means = []
    for node in range(k):                    # exact node sums for dyadic inputs, then / m in fp32
        s = torch.zeros(P * c, dtype=torch.float64)
        for j in range(m):
            s[:n] += xs[node * m + j].double()
        means.append(s.float() / m)
    result = torch.zeros(P * c)
    for l in range(m):                       # the ranks with local index l, one per node
        ranks = [node * m + l for node in range(k)]
        nr = max(0, min(L, n - l * L))
        res = sim_exchange([means[node][l * L:l * L + nr] for node in range(k)],
                           [werrs[r][:nr] for r in ranks], [serrs[r] for r in ranks],
                           comp, c, B, [gens[r] for r in ranks], beta)
        result[l * L:(l + 1) * L] = res
    return result[:n]


# ------------------------------------------------------------------------------------------------
# checks
# ------------------------------------------------------------------------------------------------
