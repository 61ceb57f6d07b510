"""Lp quantization of Lion update vectors (Lion Cub §4.2, eq. 1).

Lion Cub §4.2, eq. (1):  Q_p(x)_i = clamp(round(L / (clip * M_p(x)) * x_i), -L, L),
M_p(x) = (mean_j |x_j|^p)^(1/p), with L = 2^(n-1) - 1 levels and clip = 2 in the paper.
Limits of M_p: p = inf -> max|x| (the classic Q_inf of §2), p = 0 -> the geometric mean of the
nonzero |x_j| (the limit of the power mean; zeros are left out because one zero would make the
geometric mean 0 and zero out the whole tensor). M_p(x) = 0 (x == 0) -> all zeros.

This is the reference of the p-bit wire (comm.kernels.quantize_q / quantize_pack reproduce it
byte for byte), so it lives in comm/; `optim.quantize` is its public name for optimizers. The lane
rule that picks L for the p-bit allreduce (P * 2L <= 2^bits - 1) is optim.sync.effective_levels.
"""
from __future__ import annotations

import math

import torch

ROUNDINGS = ("nearest", "stochastic")
MAX_LEVELS = 127  # quantized votes travel as int8 (comm.int_allreduce takes int8[n])


def lp_mean(x: torch.Tensor, p: float) -> torch.Tensor:
    """M_p(x) of Lion Cub eq. (1) as a 0-d tensor (no host sync), computed in fp32 (fp64 for fp64 x)."""
    a = x.detach().abs().to(torch.float64 if x.dtype == torch.float64 else torch.float32).reshape(-1)
    if a.numel() == 0:
        return a.new_zeros(())
    if math.isinf(p):
        return a.max()
    if p == 0:
        nonzero = a > 0
        logs = torch.where(nonzero, a.clamp_min(torch.finfo(a.dtype).tiny).log(), a.new_zeros(()))
        count = nonzero.sum()
        return torch.where(count > 0, torch.exp(logs.sum() / count.clamp_min(1)), a.new_zeros(()))
    if p == 1:  # L1, the paper's choice: a plain mean, no power to under- or overflow
        return a.mean()
    # Factor out max|x| so |x|^p neither underflows (lm_head updates reach 1e-12, Lion Cub §4.1)
    # nor overflows; M_p(x) = max|x| * M_p(x / max|x|) exactly in real arithmetic.
    amax = a.max()
    safe = torch.where(amax > 0, amax, a.new_ones(()))
    return amax * (a / safe).pow(p).mean().pow(1.0 / p)


def levels_for_bits(bits: int) -> int:
    """L = 2^(bits-1) - 1 of eq. (1): the levels one value of `bits` bits (sign and magnitude) holds,
    for a quantizer with no lane sum to fit (the p-bit allreduce's lane-sum rule is comm.max_levels)."""
    if bits < 2:
        raise ValueError(f"bits={bits}: eq. (1) needs >= 2 bits for at least one level (1 bit is the sign vote)")
    return (1 << (bits - 1)) - 1


def lp_quantize(x: torch.Tensor, levels: int, p: float, clip: float = 2.0, rounding: str = "nearest",
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Quantize `x` to int8 values in [-levels, levels] by Lion Cub eq. (1).

    `p` is any float >= 0 (0, 0.5, 1, 2, inf are the paper's). rounding="nearest" rounds half to
    even; "stochastic" rounds y up with probability y - floor(y) (unbiased: E[q] = y before the
    clamp), drawing from `generator` (seed it per rank). Returns an int8 tensor shaped like x.
    """
    if not isinstance(levels, int) or not 1 <= levels <= MAX_LEVELS:
        raise ValueError(f"lp_quantize: levels={levels!r}; need an int in [1, {MAX_LEVELS}] "
                         "(levels == 0 means signs only: send tb(x) instead of quantizing)")
    p = float(p)
    if not (p >= 0):
        raise ValueError(f"lp_quantize: p={p}; need p >= 0 (0, 0.5, 1, 2, inf are typical)")
    if not clip > 0:
        raise ValueError(f"lp_quantize: clip={clip}; need clip > 0 (the paper uses 2)")
    if rounding not in ROUNDINGS:
        raise ValueError(f"lp_quantize: rounding={rounding!r}; choose one of {ROUNDINGS}")
    m = lp_mean(x, p)
    work = x.detach().to(m.dtype)
    scale = torch.where(m > 0, levels / (clip * m.clamp_min(torch.finfo(m.dtype).tiny)), m.new_zeros(()))
    y = work * scale
    if rounding == "nearest":
        y = torch.round(y)
    else:
        low = torch.floor(y)
        u = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
        y = low + (u < (y - low)).to(y.dtype)
    return y.clamp_(-levels, levels).to(torch.int8)
