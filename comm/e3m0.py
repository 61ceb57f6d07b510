"""4-bit float E3M0 codec and its mean-allreduce: the 4-bit pseudo-gradients of Streaming DiLoCo
(Douillard et al. 2025, "quantize the outer gradients to four bits", accumulated in fp32).

E3M0 is a float with 1 sign bit, 3 exponent bits and no mantissa: every nonzero value is a signed
power of two. We give each block of `block` elements one fp32 scale s = max |x| over the block's
real elements (the block's largest element is then exactly representable) and code each element
as 4 bits:

    bit 3: sign (1 = negative);  bits 0-2: k in 0..7;  value = 0 if k == 0, else +-s * 2**(k - 7)

so the magnitudes are {0, s/64, s/32, ..., s/2, s}. Rounding is to the nearest of them in value
(ties away from zero): with m = |x| / s in [2**(j-1), 2**j) the code is 2**j when m >= 0.75 * 2**j,
else 2**(j-1); below s/64 it is s/64 when m >= 2**-7, else 0. The relative error of a value
>= s/64 is at most 1/3 (m = 0.75 * 2**j), and a block of zeros (s = 0) decodes to zeros.
Nibbles pack two per byte in comm.packing's lane order (element 2i in bits 0-3, 2i+1 in bits 4-7).

The mean (`e3m0_allreduce_mean`) has the shape of comm.ef_compressed_allreduce, without error
feedback (the paper sends its 4-bit outer gradients without it): the zero-padded vector splits
into P chunks of c elements (c = ceil(n / P) rounded up to a multiple of `block`); every rank
encodes its P chunks, one all-to-all hands chunk r to rank r, rank r decodes the P copies and sums
them in rank order in fp32, divides by P and encodes its chunk again, and one all-gather hands every
rank every encoded chunk, decoded identically everywhere. So the result is bitwise identical on
every rank. At P = 1 nothing is sent and the result is decode(encode(x)) (re-encoding a decoded
block gives the same codes: its scale is its own max |value|, and every value is representable).

Bytes of one packed chunk: w = c / 2 + 4 * c / block. One call on one rank: all-to-all P w sent and
received, all-gather w sent and P w received: (sent, received) = ((P + 1) w, 2 P w)
(`e3m0_bytes`; comm.CommStats counts the same at the collectives).
"""
from __future__ import annotations

import torch

from ._groups import device_of, world
from .compressed import _exchange
from .packing import pack_lanes, unpack_lanes
from .stats import CommStats, default_stats
from ._groups import all_gather_single

E3M0_CODES = 8            # k in 0..7: zero and the magnitudes s * 2**-6 .. s
_SIGN = 8                 # bit 3 of a nibble
_SCALE_BYTES = 4


def _check_block(block: int) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0 or block % 2:
        raise ValueError(f"e3m0: block={block!r} must be a positive even number of elements per fp32 scale "
                         f"(two 4-bit codes per byte; e.g. 2048, about one weight row)")


def e3m0_layout(n: int, P: int, block: int) -> int:
    """c: elements per chunk of the padded vector (ceil(n / P) rounded up to a multiple of block)."""
    _check_block(block)
    per = -(-n // P)
    return -(-per // block) * block


def e3m0_chunk_bytes(c: int, block: int) -> int:
    """Bytes of one encoded chunk of c elements (c a multiple of block): codes, then its scales."""
    return c // 2 + _SCALE_BYTES * (c // block)


def e3m0_bytes(n: int, P: int, block: int) -> tuple[int, int]:
    """Exact (bytes_sent, bytes_recv) of one e3m0_allreduce_mean of n elements over P ranks on one
    rank: ((P + 1) w, 2 P w), w = e3m0_chunk_bytes; nothing at P = 1 or n = 0."""
    if P <= 1 or n == 0:
        return 0, 0
    w = e3m0_chunk_bytes(e3m0_layout(n, P, block), block)
    return (P + 1) * w, 2 * P * w


def e3m0_encode(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8[numel / 2], scales float32[numel / block]) of x (numel a multiple of block;
    zero padding encodes as 0 and does not change a block's scale)."""
    _check_block(block)
    v = x.detach().reshape(-1).to(torch.float32)
    if v.numel() % block:
        raise ValueError(f"e3m0_encode: {v.numel()} elements are not a whole number of blocks of {block}; "
                         f"pad to a multiple of the block")
    rows = v.view(-1, block)
    scales = rows.abs().amax(dim=1) if rows.numel() else rows.new_zeros(0)
    inv = torch.where(scales > 0, 1.0 / scales, 0.0).unsqueeze(1)
    m = (rows.abs() * inv).clamp_(max=1.0)          # 1/s * s may round just above 1
    mant, exp = torch.frexp(m)                      # m = mant * 2**exp, mant in [0.5, 1) (0 for m = 0)
    j = exp.to(torch.int32) - 1 + (mant >= 0.75).to(torch.int32)   # nearest power 2**j
    k = (j + (E3M0_CODES - 1)).clamp_(1, E3M0_CODES - 1)   # [s/128, s/64) rounds up to s/64
    k = torch.where(m >= 2.0 ** -(E3M0_CODES - 1), k, 0)     # below s/128: 0 (frexp(0) has exponent 0)
    nib = k.to(torch.uint8) | torch.where(rows < 0, _SIGN, 0).to(torch.uint8)
    nib = torch.where(k == 0, 0, nib).to(torch.uint8)   # -0 codes as +0
    return pack_lanes(nib.reshape(-1), 4, check=False), scales.contiguous()


def e3m0_decode(codes: torch.Tensor, scales: torch.Tensor, block: int, n: int | None = None) -> torch.Tensor:
    """float32[n] (default: every coded element) from e3m0_encode's codes and scales."""
    _check_block(block)
    total = codes.numel() * 2
    nib = unpack_lanes(codes, 4, total).to(torch.int32).view(-1, block)
    k = nib & (_SIGN - 1)
    mag = torch.where(k > 0, torch.exp2((k - (E3M0_CODES - 1)).to(torch.float32)), 0.0)
    val = torch.where((nib & _SIGN) > 0, -mag, mag) * scales.to(torch.float32).unsqueeze(1)
    out = val.reshape(-1)
    return out if n is None else out[:n]


def _encode_rows(y: torch.Tensor, rows: int, c: int, block: int) -> torch.Tensor:
    """uint8[rows, w]: each chunk of c elements of y (rows * c) as codes then scale bytes."""
    codes, scales = e3m0_encode(y, block)
    w = e3m0_chunk_bytes(c, block)
    wire = torch.empty(rows, w, dtype=torch.uint8, device=y.device)
    wire[:, :c // 2] = codes.view(rows, c // 2)
    wire[:, c // 2:] = scales.view(rows, c // block).contiguous().view(torch.uint8)
    return wire


def _decode_row(row: torch.Tensor, c: int, block: int) -> torch.Tensor:
    scales = row[c // 2:].clone().view(torch.float32)   # a 4-byte aligned copy
    return e3m0_decode(row[:c // 2], scales, block)


def e3m0_allreduce_mean(x: torch.Tensor, block: int = 2048, group=None, stats: CommStats | None = None
                        ) -> torch.Tensor:
    """The E3M0 estimate of the mean of x over the ranks of `group` (module docstring): a new float32
    tensor shaped like x, bitwise identical on every rank. Bytes: e3m0_bytes(x.numel(), P, block)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"e3m0_allreduce_mean: x must be a floating-point tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x)}")
    stats = default_stats() if stats is None else stats
    P, r = world(group)
    n = x.numel()
    c = e3m0_layout(n, P, block)
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return out.view(x.shape)
    with stats.call("e3m0_allreduce_mean", device_of(x)) as timer:
        with timer.pack():
            y = torch.zeros(P * c, dtype=torch.float32, device=x.device)
            y[:n] = x.detach().reshape(-1)
            wire = _encode_rows(y, P, c, block)
        recv = _exchange(wire, P, group, timer)
        with timer.pack():
            z = _decode_row(recv[0], c, block)
            for i in range(1, P):          # rank order: the sum every rank and simulation reproduces
                z += _decode_row(recv[i], c, block)
            z /= P
            mine = _encode_rows(z, 1, c, block).view(-1)
        if P > 1:
            gathered = torch.empty(P * mine.numel(), dtype=torch.uint8, device=x.device)
            with timer.coll(sent=mine, recv=gathered):
                all_gather_single(gathered, mine, group=group)
            gathered = gathered.view(P, -1)
        else:
            gathered = mine.view(1, -1)
        with timer.pack():
            for i in range(P):
                lo, hi = i * c, min(n, (i + 1) * c)
                if hi > lo:
                    out[lo:hi] = _decode_row(gathered[i], c, block)[:hi - lo]
    return out.view(x.shape)
