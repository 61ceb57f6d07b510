"""comm.kernels' quantizer: the reference quantized votes (`quantize_q`), the fused path's pieces
(argument checks, per-segment scales, the block plan, the one-pass lane quantizers) and the eager
references of the summed wire."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from . import native
from .allreduce import check_lanes
from .kernel_bodies import _k_pack_v, _k_quant_blocks, _k_quant_blocks_stoch, _lane_of
from .kernel_compile import compiled_kernel, dtype_key
from .packing import ceil_div, lanes_per_word, pack_lanes, pack_words16, unpack_lanes, unpack_words16
from .quantize import MAX_LEVELS, ROUNDINGS, lp_quantize, segment_lp_means
from .vote import majority_threshold

WIRE_BITS = (1, 2, 4, 8, 16)
SMALL = 64  # elements; below this the reference runs (dynamo also specialises sizes 0 and 1)


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
        lo, hi = blocks.amin(dim=1), blocks.amax(dim=1)  # two reductions: torch.aminmax over rows is slower on CPU
        # whole: the indices of the blocks inside one segment (a mask here would sync on a GPU)
        m.scatter_reduce_(0, bseg.index_select(0, whole), torch.maximum(-lo, hi).index_select(0, whole), "amax")
    if elems.numel():
        m.scatter_reduce_(0, seg_of, c[elems].abs(), "amax")
    return m


QBLOCK = native.QBLOCK  # elements per block of the one-pass quantizer (a multiple of every lanes-per-word)


def _block_plan(segs: list[tuple[int, int]], per: int, n: int, device: torch.device, cache: dict | None = None) -> tuple:
    """How quantize_pack covers the flat vector, once per layout (kept in `cache`, the run's
    comm.kernels.Kernels: a run has one layout): the
    n // QBLOCK whole blocks go through one kernel, block b with the scale of segment bseg[b] (the
    segment holding its first element); the words of blocks that hold a segment boundary, and
    of the partial block at the end, are then rewritten by one gathered pass: for each of their
    elements its index, its segment, its word slot and lane, and the word positions. The
    gathered pass is at most (segments + 1) blocks long, whatever n is. whole[b]: block b lies
    inside one segment (kept as the indices of those blocks)."""
    key = (tuple(segs), per, n, device)
    cache = {} if cache is None else cache
    if key not in cache:
        if len(cache) >= 8:
            cache.pop(next(iter(cache)))
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
        cache[key] = tuple(t.to(device) if isinstance(t, torch.Tensor) else t
                            for t in (nb, bseg, whole.nonzero().view(-1), elems, seg_of, slot, elems % per, words))
    return cache[key]


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


Q_PIECE = 1 << 20  # elements: quantize_q's nearest-rounding pieces (4 MiB of float32 temporaries)


def quantize_q(c: torch.Tensor, segments: Sequence[tuple[int, int]], levels: int, p: float | None,
               clip: float = 2.0, rounding: str = "nearest", generator: torch.Generator | None = None,
               tie_step: int = 1, *, means: torch.Tensor | None = None) -> torch.Tensor:
    """The reference quantized votes q (int8[n]) of the p-bit scheme (Lion Cub §4.2 eq. 1, App.
    F.1): levels == 0 -> tb(c, tie_step) in {-1, +1}; p None -> sign(c) (the "sign" quantizer);
    else lp_quantize per segment (offset, size), each parameter tensor with its own M_p, the M_p of
    all segments from comm.quantize.segment_lp_means (lp_mean's bits on CPU; its definition of
    the per-tensor norms on CUDA). means: the segments' M_p when the caller has them (a sharded
    tensor's whole-tensor M_p, comm.quantize.sharded_lp_means)."""
    c = c.reshape(-1)
    if levels == 0:  # signs only, 0 forced by the tie break (Lion Cub App. F.1, "1/-1 values")
        fill = torch.tensor(1 if tie_step % 2 == 1 else -1, dtype=torch.int8, device=c.device)
        return torch.where(c > 0, 1, torch.where(c < 0, -1, fill)).to(torch.int8)
    if p is None:  # sign(c) as int8 without a float sign of c's size (4 bytes per element)
        return (c > 0).to(torch.int8).sub_((c < 0).to(torch.int8))
    q = torch.empty(c.numel(), dtype=torch.int8, device=c.device)
    if means is None:
        means = segment_lp_means(c, segments, p)  # on CPU == lp_mean per segment, bit for bit
    if rounding == "nearest":
        # elementwise given M_p: in pieces of Q_PIECE, so its float temporaries are a piece's,
        # not the largest tensor's
        for k, (off, n) in enumerate(segments):
            for lo in range(0, n, Q_PIECE):
                hi = min(n, lo + Q_PIECE)
                q[off + lo:off + hi] = lp_quantize(c[off + lo:off + hi], levels, p, clip, rounding, mean=means[k])
        return q
    # stochastic: one stream of uniforms over the flat vector, a draw per chunk of stochastic_bounds
    # (on CPU these are the per-tensor draws of lp_quantize, value for value)
    bounds = stochastic_bounds(c.numel(), c.device)
    u = torch.empty(max((b - a for a, b in zip(bounds, bounds[1:])), default=0), device=c.device,
                    dtype=means.dtype)
    k = 0
    for a, b in zip(bounds, bounds[1:]):
        ui = u[:b - a].uniform_(generator=generator)
        while k < len(segments) and sum(segments[k]) <= a:
            k += 1
        j = k
        while j < len(segments) and segments[j][0] < b:
            off, n = segments[j]
            lo, hi = max(off, a), min(off + n, b)
            if hi > lo:
                q[lo:hi] = lp_quantize(c[lo:hi], levels, p, clip, rounding, mean=means[j], uniforms=ui[lo - a:hi - a])
            j += 1
    return q


def pack_v_into(v: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Pack uint8 lane values v[n] into out (uint8, or int32 words for bits=16)."""
    per = lanes_per_word(bits)
    n = v.numel()
    full = n // per
    if full * per >= SMALL:
        compiled_kernel(_k_pack_v, bits)((v.device.type,), v[:full * per].view(full, per), out[:full])
    else:
        full = 0
    if full < out.numel():
        tail = v[full * per:]
        out[full:] = pack_words16(tail.to(torch.int32)) if bits == 16 else pack_lanes(tail, bits, check=False)


def quantize_lanes(c: torch.Tensor, segs: list[tuple[int, int]], levels: int, p: float, clip: float,
                   bits: int, scratch: torch.Tensor | None, out: torch.Tensor, use_native: bool, means: torch.Tensor | None,
                   const: Callable, plans: dict) -> None:
    """Nearest-rounding Lion Cub eq. 1 straight into packed lanes, whatever the number of
    tensors: the per-segment scales, then one kernel over the whole blocks of the flat vector and
    one gathered pass over the words of boundary blocks (`_block_plan`); p = inf's norms are a
    segmented reduction over the same plan."""
    dev, per = c.device, lanes_per_word(bits)
    plan = _block_plan(segs, per, c.numel(), dev, plans)
    nb, bseg, _, elems, seg_of, slot, lane, words = plan
    scales = _segment_scales(c, segs, levels, p, clip, scratch, plan, means)
    lv = const(float(levels), scales.dtype, dev)
    if nb and use_native:
        native.quant_blocks(c[:nb * QBLOCK], scales[bseg], levels, bits, out[:nb * QBLOCK // per])
    elif nb:
        # the scale of each block gathered outside: inside, dynamo's duck shaping would tie the
        # number of segments to the number of blocks whenever the two happen to be equal
        compiled_kernel(_k_quant_blocks, bits)((dev.type, dtype_key(c)), c[:nb * QBLOCK].view(nb, -1, per),
                                               scales[bseg], lv, out[:nb * QBLOCK // per].view(nb, -1))
    if words.numel():  # the same float ops as the kernel, so the same lane values
        y = torch.clamp(torch.round(c[elems].to(scales.dtype) * scales[seg_of]), -levels, levels)
        vals = torch.zeros(words.numel(), dtype=torch.int32, device=dev)
        vals.index_add_(0, slot, _lane_of(y, lv) << (lane.to(torch.int32) * bits))
        out[words] = vals.to(out.dtype)


STOCH_CHUNK = 256  # whole blocks per draw of uniforms on CPU (1 MiB of float32)
STOCH_CHUNK_CUDA = 16384  # on CUDA (64 MiB of float32: a handful of draws per model, and the draws' definition)


def stochastic_bounds(n: int, device: torch.device | str) -> list[int]:
    """Where stochastic rounding of an n-element vector cuts its stream of uniforms: positions
    0 = b_0 < b_1 < ... < b_k = n (or [0, 0] for n = 0); chunk i is one draw of b_{i+1} - b_i
    uniforms, in order. Chunks are whole QBLOCK blocks (STOCH_CHUNK of them on CPU, STOCH_CHUNK_CUDA
    on CUDA), the last one taking the partial block, never a chunk of one block (dynamo specialises
    a size-1 dimension); under 2 blocks the whole vector is one chunk. Shared by the reference
    `quantize_q` and the fused path, so both draw the same stream."""
    nb = n // QBLOCK
    nb = nb if nb >= 2 else 0
    per = STOCH_CHUNK_CUDA if torch.device(device).type == "cuda" else STOCH_CHUNK
    cuts = list(range(0, nb, per)) + [nb] if nb else [0, 0]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] == 1:
        del cuts[-2]
    return [b * QBLOCK for b in cuts[:-1]] + [n]


def quantize_lanes_stochastic(c: torch.Tensor, segs: list[tuple[int, int]], levels: int, p: float, clip: float,
                              bits: int, scratch: torch.Tensor | None, generator: torch.Generator | None,
                              out: torch.Tensor, use_native: bool, means: torch.Tensor | None, const: Callable,
                              plans: dict) -> None:
    """Stochastic-rounding Lion Cub eq. 1 straight into packed lanes, whatever the number of
    tensors: the uniforms are drawn chunk after chunk of `stochastic_bounds` in flat order, as the
    reference `quantize_q` draws them. Each chunk's whole blocks are one kernel call, and its share
    of the boundary words (`_block_plan`) one gathered pass; the uniforms live in one chunk-sized
    buffer, never one of the vector's length."""
    dev, per, n = c.device, lanes_per_word(bits), c.numel()
    plan = _block_plan(segs, per, n, dev, plans)
    nb, bseg, _, elems, seg_of, slot, lane, words = plan
    scales = _segment_scales(c, segs, levels, p, clip, scratch, plan, means)
    dt = scales.dtype
    lv = const(float(levels), dt, dev)
    bounds = stochastic_bounds(n, dev)
    cuts = [b // QBLOCK for b in bounds[:-1]] + [nb]
    lo = torch.searchsorted(elems, torch.tensor(bounds, device=dev)).tolist()
    first = slot[[i for i in lo[:-1] if i < elems.numel()]].tolist()
    u = torch.empty(max(b - a for a, b in zip(bounds, bounds[1:])), dtype=dt, device=dev)
    bscale = scales[bseg]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        ui = u[:b - a].uniform_(generator=generator)  # == the reference's torch.rand, in flat order
        b0, b1 = cuts[i], cuts[i + 1]
        if b1 > b0 and use_native:
            native.quant_blocks(c[b0 * QBLOCK:b1 * QBLOCK], bscale[b0:b1], levels, bits,
                                out[b0 * QBLOCK // per:b1 * QBLOCK // per], u=ui[:(b1 - b0) * QBLOCK])
        elif b1 > b0:
            compiled_kernel(_k_quant_blocks_stoch, bits)(
                (dev.type, dtype_key(c)), c[b0 * QBLOCK:b1 * QBLOCK].view(b1 - b0, -1, per), bscale[b0:b1],
                ui[:(b1 - b0) * QBLOCK].view(b1 - b0, -1, per), lv,
                out[b0 * QBLOCK // per:b1 * QBLOCK // per].view(b1 - b0, -1))
        if lo[i + 1] > lo[i]:  # this chunk's boundary words: the kernel's float ops, gathered
            e = elems[lo[i]:lo[i + 1]]
            y = c[e].to(dt) * scales[seg_of[lo[i]:lo[i + 1]]]
            low = torch.floor(y)
            y = torch.clamp(low + (ui[e - a] < (y - low)).to(dt), -levels, levels)
            s0 = first[i]
            sl = slot[lo[i]:lo[i + 1]] - s0
            vals = torch.zeros(int(sl[-1]) + 1, dtype=torch.int32, device=dev)
            vals.index_add_(0, sl, _lane_of(y, lv) << (lane[lo[i]:lo[i + 1]].to(torch.int32) * bits))
            out[words[s0:s0 + vals.numel()]] = vals.to(out.dtype)
