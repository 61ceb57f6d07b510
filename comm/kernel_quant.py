"""comm.kernels' quantizer helpers: argument checks, per-segment scales, the block plan, and
the eager references of the summed wire."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import native
from .allreduce import check_lanes
from .packing import ceil_div, pack_lanes, pack_words16, unpack_lanes, unpack_words16
from .quantize import MAX_LEVELS, ROUNDINGS, segment_lp_means
from .vote import majority_threshold

WIRE_BITS = (1, 2, 4, 8, 16)


def _check_segments(segments: Sequence[tuple[int, int]], n: int) -> None:
    pos = 0
    for off, m in segments:
        if off != pos or m < 0:
            raise ValueError(f"quantize_pack: segments must tile [0, {n}) in order as (offset, size); "
                             f"segment ({off}, {m}) follows position {pos}")
        pos += m
    if pos != n:
        raise ValueError(f"quantize_pack: segments cover {pos} elements but c has {n}")


def wire_of(q: torch.Tensor, levels: int, bits: int) -> torch.Tensor:
    """The wire comm.int_allreduce builds from int8 q: v = q + L (levels == 0: v = [q > 0]) in
    `bits`-wide lanes, uint8 bytes (int32 words of two 16-bit lanes for bits = 16)."""
    q = q.reshape(-1)
    if bits == 16:
        return pack_words16((q > 0).to(torch.int32) if levels == 0 else q.to(torch.int32) + levels)
    v = (q > 0).view(torch.uint8) if levels == 0 else q.view(torch.uint8) + levels
    return pack_lanes(v, bits, check=False)


def _check_quantize_args(levels: int, p: float | None, clip: float, bits: int, rounding: str) -> None:
    if bits not in WIRE_BITS:
        raise ValueError(f"quantize_pack: bits={bits!r}; the p-bit allreduce supports {WIRE_BITS}")
    if not isinstance(levels, int) or not 0 <= levels <= MAX_LEVELS:
        raise ValueError(f"quantize_pack: levels={levels!r}; need an int in [0, {MAX_LEVELS}]")
    check_lanes(1, levels, bits)  # the lane must hold at least one rank's 2L
    if levels and p is not None:
        if not float(p) >= 0:
            raise ValueError(f"quantize_pack: p={p}; need p >= 0 (or None for the sign quantizer)")
        if not clip > 0:
            raise ValueError(f"quantize_pack: clip={clip}; need clip > 0 (the paper uses 2)")
        if rounding not in ROUNDINGS:
            raise ValueError(f"quantize_pack: rounding={rounding!r}; choose one of {ROUNDINGS}")


def _segment_scales(c: torch.Tensor, segs: list[tuple[int, int]], levels: int, p: float, clip: float,
                    scratch: torch.Tensor | None, plan: tuple | None = None,
                    means: torch.Tensor | None = None) -> torch.Tensor:
    """Scale levels / (clip * M_p) of every segment. p = inf with a block plan: one segmented
    max over the whole vector (a max is exact in any order, so it equals the per-tensor max).
    Otherwise comm.quantize.segment_lp_means, as the reference quantize_q computes them: a few
    calls per distinct tensor size, each value bit-identical to lp_mean on CPU."""
    mdt = torch.float64 if c.dtype == torch.float64 else torch.float32
    if means is not None:
        m = means
    elif math.isinf(p) and plan is not None:
        m = _segment_max_abs(c, len(segs), plan).to(mdt)
    else:
        m = segment_lp_means(c, segs, p, scratch)
    return _scales_of(m, levels, clip)


def _scales_of(m: torch.Tensor, levels: int, clip: float) -> torch.Tensor:
    """levels / (clip * M_p), 0 where M_p = 0: the expression of comm.quantize.lp_quantize,
    elementwise over the segments."""
    return torch.where(m > 0, levels / (clip * m.clamp_min(torch.finfo(m.dtype).tiny)), m.new_zeros(()))


def _segment_max_abs(c: torch.Tensor, nsegs: int, plan: tuple) -> torch.Tensor:
    """max |c| of every segment as a segmented reduction: per whole block a min and a max (no
    |c| temporary), reduced into the block's segment, and the gathered elements of the boundary
    blocks reduced into theirs."""
    nb, bseg, whole, elems, seg_of = plan[:5]
    m = torch.zeros(nsegs, dtype=c.dtype, device=c.device)
    if nb:
        blocks = c[:nb * QBLOCK].view(nb, QBLOCK)
        lo, hi = blocks.amin(dim=1), blocks.amax(dim=1)  # torch's aminmax over rows is ~50x slower on CPU
        # whole: the indices of the blocks inside one segment (a mask here would sync on a GPU)
        m.scatter_reduce_(0, bseg.index_select(0, whole), torch.maximum(-lo, hi).index_select(0, whole), "amax")
    if elems.numel():
        m.scatter_reduce_(0, seg_of, c[elems].abs(), "amax")
    return m


_PLANS: dict[tuple, tuple] = {}


QBLOCK = native.QBLOCK  # elements per block of the one-pass quantizer (a multiple of every lanes-per-word)


def _block_plan(segs: list[tuple[int, int]], per: int, n: int, device: torch.device) -> tuple:
    """How quantize_pack covers the flat vector, once per layout (cached: a run has one): the
    n // QBLOCK whole blocks go through one kernel, block b with the scale of segment bseg[b] (the
    segment holding its first element); the words of blocks that hold a segment boundary, and
    of the partial block at the end, are then rewritten by one gathered pass: for each of their
    elements its index, its segment, its word slot and lane, and the word positions. The
    gathered pass is at most (segments + 1) blocks long, whatever n is. whole[b]: block b lies
    inside one segment (kept as the indices of those blocks)."""
    key = (tuple(segs), per, n, device)
    if key not in _PLANS:
        if len(_PLANS) >= 8:
            _PLANS.pop(next(iter(_PLANS)))
        nb = n // QBLOCK
        nb = nb if nb >= 2 else 0  # dynamo specialises a size-1 dimension: one block goes gathered
        starts = torch.tensor([off for off, _ in segs], dtype=torch.int64)
        ends = torch.tensor([off + m for off, m in segs], dtype=torch.int64)
        first = torch.arange(nb, dtype=torch.int64) * QBLOCK
        bseg = (torch.searchsorted(starts, first, right=True) - 1).clamp_min(0)
        whole = ends[bseg] >= first + QBLOCK if nb else torch.zeros(0, dtype=torch.bool)
        wpb = QBLOCK // per
        fix = [b * wpb + torch.arange(wpb) for b in (~whole).nonzero().view(-1).tolist()]
        fix.append(torch.arange(nb * wpb, ceil_div(n, per)))
        words = torch.cat(fix)
        elems = (words.view(-1, 1) * per + torch.arange(per)).view(-1)
        slot = torch.arange(words.numel()).repeat_interleave(per)
        keep = elems < n  # the last word's padding lanes stay 0
        elems, slot = elems[keep], slot[keep]
        seg_of = torch.searchsorted(starts, elems, right=True) - 1
        _PLANS[key] = tuple(t.to(device) if isinstance(t, torch.Tensor) else t
                            for t in (nb, bseg, whole.nonzero().view(-1), elems, seg_of, slot, elems % per, words))
    return _PLANS[key]


def native_quantizes(c: torch.Tensor, levels: int, p: float | None, bits: int) -> bool:
    """Whether comm.native has the quantize_pack loop for this configuration: Lp (nearest or
    stochastic) and the levels == 0 lanes up to 8 bits, for c's dtype; the "sign" quantizer
    (p None) has none."""
    return native.supports(c) and (p is not None if levels else bits <= 8)


def unpack_sum_reference(wire: torch.Tensor, bits: int, n: int, levels: int, P: int) -> torch.Tensor:
    """What comm.int_allreduce returns from the summed wire: int32[n] exact sums of q."""
    total = unpack_words16(wire, n) if bits == 16 else unpack_lanes(wire, bits, n).to(torch.int32)
    return total.mul_(2).sub_(P) if levels == 0 else total.sub_(P * levels)


def _sign_of_sum_eager(flat: torch.Tensor, bits: int, n: int, levels: int, P: int, rdt: torch.dtype,
                       out: torch.Tensor | None) -> torch.Tensor:
    """sign(unpack_sum_reference(...)) in `rdt` by comparing the one-byte lane values with the
    offset, without the int32 sums: sign(v - P*L) for L >= 1; for signs only, sign(2v - P) is +1
    for v >= floor(P/2) + 1 and -1 for v < ceil(P/2) (the same integer thresholds as the
    majority, comm.vote.majority_threshold)."""
    v = unpack_lanes(flat, bits, n)
    if levels == 0:
        plus, minus = v >= majority_threshold(P, 2), v < majority_threshold(P, 1)
    else:
        plus, minus = v > P * levels, v < P * levels
    res = torch.empty(n, dtype=rdt, device=flat.device) if out is None else out
    res.copy_(plus)
    return res.masked_fill_(minus, -1)
