"""The traced kernel bodies behind comm.kernels (torch ops only: inductor turns each into one
loop), with the inductor options they compile with and `f32` (a Python float rounded as ATen rounds it)."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import torch

from .packing import lane_max, lanes_per_word


# inductor's C++ backend refuses to vectorise loops whose loads are mostly strided (the 8 strided
# loads of a packed byte); with its heuristic off, sign packing vectorises
INDUCTOR_OPTIONS = {"cpp.enable_tiling_heuristics": False}


# Triton contracts a multiply and the add or subtract that follows it into one fma (fp fusion, on
# by default) where eager CUDA rounds the product first: stochastic rounding's y - floor(y), with
# y = x * scale, would differ from eager's in the last bit. emulate_precision_casts is inductor's
# switch for eager numerics (Triton compiles with fp fusion off). Only the kernels marked
# `eager_float` get it, the quantizers: the integer kernels have no float arithmetic to fuse.
# inductor's C++ backend compiles with -ffp-contract=off already.
INDUCTOR_OPTIONS_EAGER_FLOAT_CUDA = {**INDUCTOR_OPTIONS, "emulate_precision_casts": True}


def eager_float(fn: Callable) -> Callable:
    """Mark a kernel whose float arithmetic must round as eager's does on CUDA too (a multiply
    feeding an add): `compiled_kernel` compiles it without Triton's fp fusion."""
    fn.eager_float = True
    return fn


def f32(x: float) -> float:
    """x rounded to float32 (what ATen does to a Python scalar used with a float32 tensor)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # finite but beyond float32: the cast gives inf
        return math.copysign(math.inf, x)


# ---- traced kernel bodies (torch ops only: inductor turns each into one loop) ---------------
def _k_sign_bits(x8: torch.Tensor, odd: torch.Tensor, out: torch.Tensor) -> None:
    """x8: (nb, 8) -> out[nb] bytes of tb(x) flags, bit k = x8[:, k] (tb as in comm.vote)."""
    acc = None
    for k in range(8):
        xk = x8[:, k]
        f = ((xk > 0) | ((xk == 0) & odd)).to(torch.int32) * (1 << k)
        acc = f if acc is None else acc + f
    out.copy_(acc.to(torch.uint8))


def _pack_groups(v: list[torch.Tensor], bits: int) -> torch.Tensor:
    """v[i]: int32 lane values of lane i of each word -> the word (uint8, or int32 for 16)."""
    acc = None
    for i, vi in enumerate(v):
        f = vi * (1 << (i * bits))
        acc = f if acc is None else acc + f
    return acc if bits == 16 else acc.to(torch.uint8)


def _k_tb_lanes(c2: torch.Tensor, odd: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """levels == 0 wire: lane = 1 for tb(c) = +1 with optim.lioncub's where-form of the tie break
    (c > 0, or c not < 0 on odd steps), packed `bits` wide; c2: (words, lanes per word)."""
    v = []
    for i in range(c2.shape[1]):
        ci = c2[:, i]
        v.append(((ci > 0) | (~(ci < 0) & odd)).to(torch.int32))
    out.copy_(_pack_groups(v, bits))


def _k_pack_v(v2: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """v2: (words, lanes per word) uint8 lane values -> packed words (comm.packing layout)."""
    out.copy_(_pack_groups([v2[:, i].to(torch.int32) for i in range(v2.shape[1])], bits))


def _lane_of(y: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The int32 lane value q + L of clamped float y, with q = int8(y) as lp_quantize converts it
    (through int32: a NaN y, from an inf in the tensor that zeroes its scale, gives q = 0 as the
    reference's float -> int8 does, not a lane of INT32_MIN's low bits)."""
    return y.to(torch.int32).to(torch.int8).to(torch.int32) + levels.to(torch.int32)


@eager_float
def _k_quant_blocks(x3: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, out: torch.Tensor,
                    bits: int) -> None:
    """Lion Cub eq. 1 and the lane packing in one pass over whole blocks of the flat vector:
    x3 (blocks, words per block, lanes per word); block b uses scale[b] (its segment's scale,
    one per block, not per element) -> out (blocks, words per block)."""
    s = scale.unsqueeze(1)
    v = []
    for i in range(x3.shape[2]):
        y = torch.clamp(torch.round(x3[:, :, i].to(scale.dtype) * s), -levels, levels)
        v.append(_lane_of(y, levels))
    out.copy_(_pack_groups(v, bits))


@eager_float
def _k_quant_blocks_stoch(x3: torch.Tensor, scale: torch.Tensor, u3: torch.Tensor, levels: torch.Tensor,
                          out: torch.Tensor, bits: int) -> None:
    """_k_quant_blocks with stochastic rounding: u3, shaped like x3, holds each element's uniform
    (the rounding of comm.quantize.lp_quantize)."""
    s = scale.unsqueeze(1)
    v = []
    for i in range(x3.shape[2]):
        y = x3[:, :, i].to(scale.dtype) * s
        low = torch.floor(y)
        y = low + (u3[:, :, i] < (y - low)).to(y.dtype)
        v.append(_lane_of(torch.clamp(y, -levels, levels), levels))
    out.copy_(_pack_groups(v, bits))


def _k_sign_v(x: torch.Tensor, levels: torch.Tensor, out: torch.Tensor) -> None:
    """The "sign" quantizer with levels >= 1: q = sign(x), shifted by L."""
    out.copy_((torch.sign(x).to(torch.int32) + levels).to(torch.uint8))


def _k_unpack(w2: torch.Tensor, mul: torch.Tensor, offset: torch.Tensor, out: torch.Tensor, bits: int,
              esize: int, plus: int | None, minus: int | None) -> None:
    """Summed wire words -> per-lane totals t = mul*v - offset (2v - P for signs, v - P*L), or
    the bit patterns `plus` / `minus` / 0 of sign(t) in an `esize`-byte type. w2: (m, g) wire
    words; out: the result viewed as m integers of g*lanes*esize in {1, 4, 8} bytes, one word
    per row, so the lanes land with contiguous stores (inductor's C++ backend turns the strided
    stores of a (words, lanes) layout into scalar ones, and does not vectorise int16)."""
    per = lanes_per_word(bits)
    E = 8 * esize
    nbytes = w2.shape[1] * per * esize
    acc = torch.int64 if nbytes > 4 else torch.int32
    word = None
    for gi in range(w2.shape[1]):
        w = w2[:, gi]
        wi = w.to(torch.int64) & 0xFFFFFFFF if bits == 16 else w.to(acc)  # int32 carrier may be < 0
        for lane in range(per):
            k = gi * per + lane
            t = ((wi >> (lane * bits)) & lane_max(bits)).to(acc) * mul - offset
            if plus is not None:
                t = torch.where(t > 0, plus, torch.where(t < 0, minus, 0)).to(acc)
            # two's complement lanes: the top lane signed (cannot overflow), the others masked
            top = k == w2.shape[1] * per - 1
            term = t if top else t & lane_max(E)
            term = term * (1 << (k * E)) if k else term
            word = term if word is None else word + term
    out.copy_(word.to(out.dtype))


# sign(t) as raw bits of the update dtype: +1, -1 (0 is all zero bits)
_SIGN_BITS = {torch.float32: (4, 0x3F800000, 0xBF800000 - (1 << 32)),
              torch.bfloat16: (2, 0x3F80, 0xBF80 - (1 << 16)), torch.float16: (2, 0x3C00, 0xBC00 - (1 << 16)),
              torch.int8: (1, 1, -1), torch.int16: (2, 1, -1), torch.int32: (4, 1, -1)}


_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _k_majority(r: torch.Tensor, thr: torch.Tensor, out: torch.Tensor) -> None:
    """r: (P, c) packed chunks -> out[c]: bit k set when the count of set bits k over the P rows
    reaches thr (comm.vote.majority_flags' exact threshold form of the tie break)."""
    acc = None
    for k in range(8):
        cnt = ((r >> k) & 1).sum(0, dtype=thr.dtype)
        f = (cnt >= thr).to(torch.int32) * (1 << k)
        acc = f if acc is None else acc + f
    out.copy_(acc.to(torch.uint8))
