"""Lp quantization of Lion update vectors (Lion Cub §4.2, eq. 1).

Lion Cub §4.2, eq. (1):  Q_p(x)_i = clamp(round(L / (clip * M_p(x)) * x_i), -L, L),
M_p(x) = (mean_j |x_j|^p)^(1/p), with L = 2^(n-1) - 1 levels and clip = 2 in the paper.
Limits of M_p: p = inf -> max|x| (the classic Q_inf of §2), p = 0 -> the geometric mean of the
nonzero |x_j| (the limit of the power mean; zeros are left out because one zero would make the
geometric mean 0 and zero out the whole tensor). M_p(x) = 0 (x == 0) -> all zeros.

This is the reference of the p-bit wire (comm.kernels.quantize_q / quantize_pack reproduce it
byte for byte), so it lives in comm/; `optim.quantize` is its public name for optimizers. The lane
rule that picks L for the p-bit allreduce (P * 2L <= 2^bits - 1) is optim.sync.effective_levels.

`segment_lp_means` gives M_p of every tensor of a flat vector at once, in a number of torch calls
that grows with the number of distinct tensor sizes (a chunk of rows per size), not with the
number of tensors; on CPU each value is bit for bit lp_mean's (see its docstring for why).

`sharded_lp_means` gives the same per-tensor M_p when each tensor is split over the ranks of a
group (hybrid sharding: a rank holds a block of rows of every tensor). M_p is one scalar of the
whole tensor (eq. 1 averages over all d elements), so a shard's own M_p would make the scale, and
with L_inf the algorithm, depend on the shard count. Each rank's M_p and weight of every tensor
(`segment_lp_partials`) travel in one all_gather, and every rank combines them in shard order
(`combine_lp_partials`), so all ranks of the group hold the same bits.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ._groups import all_gather_single

ROUNDINGS = ("nearest", "stochastic")
MAX_LEVELS = 127  # quantized votes travel as int8 (comm.int_allreduce takes int8[n])
# ATen splits a reduction or an elementwise loop across intra-op threads only from this many
# elements on (at::internal::GRAIN_SIZE); below it, or on one thread, each runs serially
_GRAIN = 32768
CPU_CHUNK = 1 << 18  # elements of |x| per reduction call on CPU (1 MiB of float32: cache-resident)
# exponents whose elementwise work gives the same bits in ATen's vectorized and scalar code (|x|,
# x / s, x * x, sqrt, max: all correctly rounded). log (p = 0) and a general pow do not (pow(x, 2/3)
# differs in a sizeable share of values between a 0-d tensor, which takes the scalar code, and a
# contiguous vector; docs/results/code_notes.md), so `_by_scalar_loop` gives the means' final exp / pow the
# scalar code of lp_mean's 0-d tensors, and their rows are padded to run as loops of their own,
# as the reference's tensors do (torch 2.13 gives a contiguous loop's tail the vector code, but a
# loop that finished with scalar code would then still match)
_EXACT_P = (0.5, 1.0, 2.0, math.inf)


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


def _by_scalar_loop(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn applied in place to a copy of the 1-d t through ATen's scalar loop, as it runs on the
    0-d tensor of lp_mean (a strided view never takes the vectorized loop)."""
    buf = t.new_empty((t.numel(), 2))[:, 0]
    return fn(buf.copy_(t))


def _rows_lp_mean(a: torch.Tensor, p: float) -> torch.Tensor:
    """lp_mean of each row of a (k, m) view holding |x| (overwritten), the same ops as lp_mean."""
    if math.isinf(p):
        return a.amax(1)
    if p == 1:
        return a.mean(1)  # on CPU: the row's sum (ATen's cascade, row by row), divided by m
    zero = a.new_zeros(())
    if p == 0:
        nonzero = a > 0
        logs = torch.where(nonzero, a.clamp_min_(torch.finfo(a.dtype).tiny).log_(), zero)
        count = nonzero.sum(1)
        mean = _by_scalar_loop(logs.sum(1) / count.clamp_min(1), torch.exp_)
        return torch.where(count > 0, mean, zero)
    amax = a.amax(1)
    safe = torch.where(amax > 0, amax, a.new_ones(()))
    return amax * _by_scalar_loop(a.div_(safe.unsqueeze(1)).pow_(p).mean(1), lambda t: t.pow_(1.0 / p))


_GROUPS: dict[tuple, list] = {}


def _segment_groups(segs: tuple, p: float, serial: bool, budget: int) -> tuple[list, list[int] | None, int, dict]:
    """The chunks `segment_lp_means` reduces, once per (layout, p, threading, budget): segments
    of one size m, up to `budget` elements of rows per chunk (at least one row), as
    (m, row stride in the buffer, segment indices, offsets, common offset step or None); the
    order of the segments over all chunks (None: in order, none empty); the buffer elements a
    chunk needs; a cache of index tensors per device. Rows that hold a
    position-dependent op (p not in _EXACT_P) are padded by one element, so that each row runs as
    a loop of its own; a chunk has one row where ATen would split the reference's own reduction
    or loop across threads (serial False: rows from _GRAIN elements, or any row for p outside
    _EXACT_P)."""
    key = (segs, p, serial, budget)
    if key not in _GROUPS:
        if len(_GROUPS) >= 16:
            _GROUPS.pop(next(iter(_GROUPS)))
        exact = p in _EXACT_P
        by_size: dict[int, list[int]] = {}
        for i, (_, m) in enumerate(segs):
            if m:
                by_size.setdefault(m, []).append(i)
        chunks, order, need = [], [], 0
        for m, idx in by_size.items():
            row = m if exact else m + 1
            per = 1 if not serial and (m >= _GRAIN or not exact) else max(1, budget // row)
            for j in range(0, len(idx), per):
                part = idx[j:j + per]
                offs = [segs[i][0] for i in part]
                steps = {b - a for a, b in zip(offs, offs[1:])}
                step = steps.pop() if len(steps) == 1 else (0 if len(offs) == 1 else None)
                chunks.append((m, row, part, offs, step))
                order += part
                need = max(need, len(part) * row)
        identity = order == list(range(len(segs)))
        _GROUPS[key] = (chunks, None if identity else order, need, {})
    return _GROUPS[key]


def segment_lp_means(c: torch.Tensor, segments: Sequence[tuple[int, int]], p: float,
                     scratch: torch.Tensor | None = None) -> torch.Tensor:
    """M_p (lp_mean) of every segment (offset, size) of the flat vector c, as one tensor.

    The segments of one size are reduced together, as the rows of a matrix: a strided view of c
    when their offsets step evenly (a transformer's layers), else gathered rows, |x| written to
    one buffer (`scratch`, when it is a float32 (float64 for float64 c) buffer large enough, else
    a new one). So the number of calls grows with the number of distinct sizes, not of tensors.
    On CPU each value is lp_mean's bit for bit: ATen reduces each row of a matrix with the loop it
    runs on a vector of that length, and every elementwise op is either exact or, for p = 0 and
    a general p, kept at its reference position (`_segment_groups`). On CUDA a row reduction may
    round differently from a whole-tensor one: there this function is the definition of the
    per-tensor norms of the p-bit wire (comm.kernels.quantize_q and quantize_pack both use it).
    """
    c = c.reshape(-1)
    if c.stride(0) != 1:  # the rows are strided views of contiguous storage
        c = c.contiguous()
    p = float(p)
    mdt = torch.float64 if c.dtype == torch.float64 else torch.float32
    segs = tuple((int(o), int(m)) for o, m in segments)
    cpu = c.device.type == "cpu"
    serial = not cpu or torch.get_num_threads() == 1
    # a chunk's |x| is written, then read back: on CPU a chunk that stays in the L2 cache reads
    # back at cache speed, a larger one from memory; on a GPU fewer, larger chunks save launches
    budget = CPU_CHUNK if cpu else max([m for _, m in segs] + [CPU_CHUNK])
    chunks, order, need, index = _segment_groups(segs, p, serial, budget)
    if not chunks:
        return torch.zeros(len(segs), dtype=mdt, device=c.device)
    if scratch is None or scratch.numel() < need or scratch.dtype != mdt or scratch.device != c.device:
        scratch = torch.empty(need, dtype=mdt, device=c.device)
    base = c.storage_offset()
    means = []
    for j, (m, row, part, offs, step) in enumerate(chunks):
        k = len(part)
        a = scratch[:k * row].view(k, row)[:, :m]
        if step is not None:  # evenly spaced: a strided view, no gather
            rows = c.as_strided((k, m), (step, 1), base + offs[0])
        else:
            if (j, c.device) not in index:
                index[(j, c.device)] = torch.tensor(offs, device=c.device)
            rows = c.unfold(0, m, 1)  # every window of m elements; the chunk's are gathered
            if c.dtype == mdt and a.is_contiguous():
                torch.index_select(rows, 0, index[(j, c.device)], out=a).abs_()
                means.append(_rows_lp_mean(a, p))
                continue
            rows = rows.index_select(0, index[(j, c.device)])
        if rows.dtype == mdt:
            torch.abs(rows, out=a)
        else:
            a.copy_(rows).abs_()
        means.append(_rows_lp_mean(a, p))
    flat = torch.cat(means) if len(means) > 1 else means[0]
    if order is None:
        return flat
    if ("order", c.device) not in index:
        index[("order", c.device)] = torch.tensor(order, dtype=torch.int64, device=c.device)
    out = torch.zeros(len(segs), dtype=mdt, device=c.device)
    return out.index_copy_(0, index[("order", c.device)], flat)


def segment_lp_partials(c: torch.Tensor, segments: Sequence[tuple[int, int]], p: float,
                        scratch: torch.Tensor | None = None) -> torch.Tensor:
    """What a shard of every segment contributes to the whole tensor's M_p: float64 [len(segments), 2]
    of (M_p of the shard, its weight), the weight being the shard's elements, or for p = 0 its
    nonzero elements (the geometric mean is over the nonzero |x| only)."""
    p = float(p)
    means = segment_lp_means(c, segments, p, scratch).to(torch.float64)
    c = c.reshape(-1)
    if p == 0:
        weight = torch.stack([c[o:o + m].count_nonzero() for o, m in segments]).to(torch.float64) if segments \
            else means.new_zeros(0)
    else:
        weight = torch.tensor([float(m) for _, m in segments], dtype=torch.float64, device=c.device)
    return torch.stack([means, weight], dim=1)


def combine_lp_partials(parts: torch.Tensor, p: float) -> torch.Tensor:
    """M_p of every whole tensor from its shards' `segment_lp_partials`, stacked as parts[S, k, 2]
    (float64, summed in shard order, so the same bits on every rank that holds the same parts):
    p = inf the max of the shards' maxima (exact); p = 0 exp of the nonzero-weighted mean of the
    shards' log M_0; else (sum_s n_s M_s^p / sum_s n_s)^(1/p), with the largest M_s factored out as
    lp_mean factors out max|x| (no under- or overflow of M^p). A tensor with no element (or, for
    p = 0, no nonzero) gets 0."""
    p = float(p)
    m, w = parts[..., 0], parts[..., 1]
    if math.isinf(p):
        return m.amax(0)
    total = w.sum(0)
    zero = m.new_zeros(())
    if p == 0:
        logs = torch.where(w > 0, m.clamp_min(torch.finfo(m.dtype).tiny).log(), zero)
        return torch.where(total > 0, torch.exp((w * logs).sum(0) / total.clamp_min(1)), zero)
    if p == 1:
        return (w * m).sum(0) / total.clamp_min(1)
    top = m.amax(0)
    safe = torch.where(top > 0, top, m.new_ones(()))
    return top * ((w * (m / safe).pow(p)).sum(0) / total.clamp_min(1)).pow(1.0 / p)


def sharded_lp_means(c: torch.Tensor, segments: Sequence[tuple[int, int]], p: float, group,
                     scratch: torch.Tensor | None = None) -> torch.Tensor:
    """M_p of every whole tensor when `c` holds this rank's shard of each (segments: the local
    (offset, size) of each tensor; the other shards on the other ranks of `group`): one all_gather
    of every tensor's `segment_lp_partials` (16 bytes per tensor per rank), combined on every rank
    by `combine_lp_partials` (identical bits on all ranks of the group). In M_p's dtype (float32;
    float64 for float64 c). It equals segment_lp_means of the whole tensors up to the fp32 rounding
    of the shards' partial sums: p = inf exactly; for sums, a relative difference of a few times
    log2(size) units of fp32 rounding at most."""
    mdt = torch.float64 if c.dtype == torch.float64 else torch.float32
    local = segment_lp_partials(c, segments, p, scratch)
    S = dist.get_world_size(group)
    parts = local.new_empty((S * local.shape[0], 2))  # gloo gathers along dim 0 only
    all_gather_single(parts, local, group=group)
    return combine_lp_partials(parts.view(S, -1, 2), p).to(mdt)


def levels_for_bits(bits: int) -> int:
    """L = 2^(bits-1) - 1 of eq. (1): the levels one value of `bits` bits (sign and magnitude) holds,
    for a quantizer with no lane sum to fit (the p-bit allreduce's lane-sum rule is comm.max_levels)."""
    if bits < 2:
        raise ValueError(f"bits={bits}: eq. (1) needs >= 2 bits for at least one level (1 bit is the sign vote)")
    return (1 << (bits - 1)) - 1


def lp_quantize(x: torch.Tensor, levels: int, p: float, clip: float = 2.0, rounding: str = "nearest",
                generator: torch.Generator | None = None, *, mean: torch.Tensor | None = None,
                uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize `x` to int8 values in [-levels, levels] by Lion Cub eq. (1).

    `p` is any float >= 0 (0, 0.5, 1, 2, inf are the paper's). rounding="nearest" rounds half to
    even; "stochastic" rounds y up with probability y - floor(y) (unbiased: E[q] = y before the
    clamp), drawing from `generator` (seed it per rank). Returns an int8 tensor shaped like x.
    mean: M_p(x) when the caller has it (a 0-d tensor, from `segment_lp_means`).
    uniforms: for stochastic rounding, the uniforms to round with (x.numel() of them, M_p's
    dtype) instead of drawing them from `generator` (`comm.kernels.quantize_q` draws one stream
    for a whole flat vector).
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
    m = lp_mean(x, p) if mean is None else mean
    work = x.detach().to(m.dtype)
    scale = torch.where(m > 0, levels / (clip * m.clamp_min(torch.finfo(m.dtype).tiny)), m.new_zeros(()))
    y = work * scale
    if rounding == "nearest":
        y = torch.round(y)
    else:
        low = torch.floor(y)
        if uniforms is None:
            u = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
        elif uniforms.numel() != y.numel() or uniforms.dtype != y.dtype:
            raise ValueError(f"lp_quantize: uniforms has {uniforms.numel()} {uniforms.dtype} values; need "
                             f"{y.numel()} {y.dtype} (one per element of x, in M_p's dtype)")
        else:
            u = uniforms.view(y.shape)
        y = low + (u < (y - low)).to(y.dtype)
    return y.clamp_(-levels, levels).to(torch.int8)
