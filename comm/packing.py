"""Bit packing for the wire: 1-bit signs and 1/2/4/8-bit integer lanes in uint8 bytes.

Layout (docs/architecture.md, "Wire formats"): bit i of byte j holds b[8j+i] (little-endian within a byte); for
`bits`-wide lanes, lane i of byte j holds v[j*(8/bits)+i] in bits [i*bits, (i+1)*bits). A SUM
allreduce of packed bytes is exact while every lane sum stays < 2**bits (Lion Cub App. F.1).

Lion Cub App. E found packing/unpacking can eat the bandwidth gain, so every path here is a few
whole-tensor torch ops (CPU and CUDA alike), never a Python loop over elements:
- packing 8 one-byte flags into one byte is a single int64 multiply: viewing 8 bytes as one
  little-endian word w = sum_k f_k 2^(8k), the product w * 0x0102040810204080 puts f_k at bit
  56 + k and no cross term reaches bits 56..63, so (w * M) >> 56 is the packed byte;
- unpacking is a table lookup: a 256-entry table of 8/bits lanes per byte, gathered with
  index_select (one pass over the output).
The 16-bit lanes used by `int_allreduce(bits=16)` live in `pack_words16` / `unpack_words16`.
"""
from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":  # the word views below assume little-endian memory
    raise ImportError(f"comm.packing needs a little-endian machine, found {sys.byteorder!r}")

LANE_BITS = (1, 2, 4, 8)
_MAGIC_1BIT = 0x0102040810204080
_LUTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints, without floats (the project's one ceil-div)."""
    return -(-a // b)


def lane_max(bits: int) -> int:
    """The largest value a `bits`-wide unsigned lane holds, 2**bits - 1: the lane rule's one home (the
    p-bit allreduce's levels, comm.max_levels, and every lane mask are written through it)."""
    return (1 << bits) - 1


def lanes_per_word(bits: int) -> int:
    """Lanes per wire word (the project's one lane rule): 8 / bits per byte for bits in {1, 2, 4,
    8}; bits = 16 travels as int32 words of two lanes (neither gloo nor NCCL reduces int16)."""
    return 2 if bits == 16 else 8 // bits


def _lut(bits: int, device: torch.device, signs: bool = False) -> torch.Tensor:
    """Table mapping a packed byte to its 8/bits lanes, one lane per byte, as one word per row.
    With signs=True (bits=1) the lanes are int8 -1/+1 instead of 0/1."""
    key = (bits, device, signs)
    if key not in _LUTS:
        per = 8 // bits
        byte = torch.arange(256, dtype=torch.int64).unsqueeze(1)
        lanes = (byte >> (torch.arange(per) * bits)) & lane_max(bits)
        lanes = (2 * lanes - 1).to(torch.int8) if signs else lanes.to(torch.uint8)
        word = {1: torch.int64, 2: torch.int32, 4: torch.int16}[bits]
        _LUTS[key] = lanes.contiguous().view(word).view(256).to(device)
    return _LUTS[key]


def _padded_u8(v: torch.Tensor, multiple: int) -> torch.Tensor:
    """v (uint8/bool, 1-D) as a contiguous uint8 buffer, zero-padded to a multiple of `multiple`,
    whose storage offset allows viewing it as `multiple`-byte words."""
    v = v.reshape(-1)
    if v.dtype == torch.bool:
        v = v.view(torch.uint8)
    n = v.numel()
    m = ceil_div(n, multiple) * multiple
    if m == n and v.is_contiguous() and v.storage_offset() % multiple == 0:
        return v
    out = torch.zeros(m, dtype=torch.uint8, device=v.device)
    out[:n] = v
    return out


def _pack_flags(u8: torch.Tensor) -> torch.Tensor:
    """u8: 0/1 bytes, length a multiple of 8, word aligned -> packed bytes (see module doc)."""
    words = u8.view(torch.int64)
    return ((words * _MAGIC_1BIT) >> 56).to(torch.uint8)


CPU_BLOCK = 1 << 18


def _block(t: torch.Tensor) -> int:
    """Elements per block (a multiple of 8) for the cache-blocked CPU loops: temporaries stay in
    L2 and are reused instead of freshly allocated and page-faulted. One block on GPUs."""
    if t.device.type == "cpu":
        return CPU_BLOCK
    return ceil_div(max(8, t.numel()), 8) * 8


def pack_positive(x: torch.Tensor, include_zero: bool, length: int | None = None) -> torch.Tensor:
    """Packed flags of x > 0 (x >= 0 with include_zero), zero-padded to `length` bits (a multiple
    of 8, default ceil(n/8)*8): the sign-to-bits step of the 1-bit collectives, fused blockwise."""
    x = x.reshape(-1)
    n = x.numel()
    length = ceil_div(n, 8) * 8 if length is None else length
    if length % 8 or length < n:
        raise ValueError(f"pack_positive: length={length} must be a multiple of 8 and >= n={n}")
    out = torch.empty(length // 8, dtype=torch.uint8, device=x.device)
    cmp = torch.ge if include_zero else torch.gt
    B = _block(x)
    flags = torch.empty(min(B, length), dtype=torch.bool, device=x.device)
    words = torch.empty(min(B, length) // 8, dtype=torch.int64, device=x.device)
    for s in range(0, length, B):
        e = min(length, s + B)
        f = flags[: e - s]
        valid = max(0, min(e, n) - s)
        if valid:
            cmp(x[s:s + valid], 0, out=f[:valid])
        if valid < e - s:
            f[valid:].fill_(False)
        w = words[: (e - s) // 8]
        torch.mul(f.view(torch.uint8).view(torch.int64), _MAGIC_1BIT, out=w)
        w >>= 56
        out[s // 8:e // 8].copy_(w)
    return out


def _lookup(table: torch.Tensor, packed: torch.Tensor, out_words: torch.Tensor) -> None:
    """out_words[j] = table[packed[j]], blockwise on CPU so the int32 index stays in cache."""
    m = packed.numel()
    B = _block(packed)
    if m <= B:
        torch.index_select(table, 0, packed.to(torch.int32), out=out_words)
        return
    idx = torch.empty(B, dtype=torch.int32, device=packed.device)
    for s in range(0, m, B):
        e = min(m, s + B)
        idx[: e - s].copy_(packed[s:e])
        torch.index_select(table, 0, idx[: e - s], out=out_words[s:e])


def pack_bits(b: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor of n flags into uint8[ceil(n/8)]; bit i of byte j = b[8j+i]."""
    if b.dtype != torch.bool:
        raise TypeError(f"pack_bits expects a bool tensor, got {b.dtype}; pass e.g. `x > 0`")
    return _pack_flags(_padded_u8(b, 8))


def _unpack_1bit(packed: torch.Tensor, n: int, name: str, dtype: torch.dtype, signs: bool) -> torch.Tensor:
    """One table lookup per byte: packed bits -> 8 values of `dtype` each (0/1, or -1/+1)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"{name} expects uint8 bytes, got {packed.dtype}")
    if n < 0 or packed.numel() * 8 < n:
        raise ValueError(f"{name}: {packed.numel()} bytes cannot hold n={n} bits")
    flat = packed.reshape(-1)[:ceil_div(n, 8)]
    out = torch.empty(flat.numel() * 8, dtype=dtype, device=flat.device)
    _lookup(_lut(1, flat.device, signs=signs), flat, out.view(torch.int64))
    return out[:n]


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8[>= ceil(n/8)] -> bool[n]."""
    return _unpack_1bit(packed, n, "unpack_bits", torch.uint8, signs=False).view(torch.bool)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Packed bits -> int8[n] with bit 1 -> +1 and bit 0 -> -1 (one table lookup, no bool pass)."""
    return _unpack_1bit(packed, n, "unpack_signs", torch.int8, signs=True)


def pack_lanes(v: torch.Tensor, bits: int, check: bool = True) -> torch.Tensor:
    """Pack uint8 values v[n] (each < 2**bits) into uint8[ceil(n*bits/8)] lanes of `bits` bits.

    Lane i of byte j holds v[j*(8/bits)+i]; bits in {1, 2, 4, 8}. Values out of range raise
    (a silently truncated lane would corrupt an exact sum); check=False skips that pass for
    callers that have already validated v (and may then return v itself for bits=8)."""
    if bits not in LANE_BITS:
        raise ValueError(f"pack_lanes: bits must be one of {LANE_BITS}, got {bits}; "
                         f"16-bit lanes use pack_words16")
    if v.dtype != torch.uint8:
        raise TypeError(f"pack_lanes expects uint8 values, got {v.dtype}")
    v = v.reshape(-1)
    if check and v.numel() and bits < 8:
        vmax = int(v.max())
        if vmax > lane_max(bits):
            raise ValueError(f"pack_lanes: value {vmax} does not fit a {bits}-bit lane "
                             f"(max {lane_max(bits)})")
    if bits == 8:
        return v.clone() if check else v
    if bits == 1:
        return _pack_flags(_padded_u8(v, 8))
    if bits == 4:  # two bytes v0 + 256 v1 as one int16 -> v0 | v1 << 4 in the low byte
        w = _padded_u8(v, 2).view(torch.int16)
        y = w >> 4
        y |= w
        return y.to(torch.uint8)
    # bits == 2: four bytes as one int32 (top byte < 4, so the word stays positive); the low
    # byte of w | w>>6 | w>>12 | w>>18 is v0 | v1 << 2 | v2 << 4 | v3 << 6
    w = _padded_u8(v, 4).view(torch.int32)
    y = w >> 6
    y |= w
    y |= w >> 12
    y |= w >> 18
    return y.to(torch.uint8)


def unpack_lanes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_lanes: uint8 bytes -> uint8[n] lane values."""
    if bits not in LANE_BITS:
        raise ValueError(f"unpack_lanes: bits must be one of {LANE_BITS}, got {bits}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_lanes expects uint8 bytes, got {packed.dtype}")
    per = 8 // bits
    if n < 0 or packed.numel() * per < n:
        raise ValueError(f"unpack_lanes: {packed.numel()} bytes cannot hold n={n} {bits}-bit lanes")
    flat = packed.reshape(-1)[:ceil_div(n, per)]
    if bits == 8:
        return flat.clone()
    table = _lut(bits, flat.device)
    out = torch.empty(flat.numel() * per, dtype=torch.uint8, device=flat.device)
    _lookup(table, flat, out.view(table.dtype))
    return out[:n]


def pack_words16(v: torch.Tensor) -> torch.Tensor:
    """Pack int32 values v[n] in [0, 2**16) into int32 words of two 16-bit lanes (low lane first).

    Neither gloo nor NCCL reduces int16, so `int_allreduce(bits=16)` carries its 16-bit lanes in
    int32 words: still 2 bytes per element. A lane sum < 2**16 never carries into the next lane;
    the high lane may set the int32 sign bit, and the SUM relies on two's-complement wraparound
    of the carrier word (checked by tests/comm/test_comm.py at the largest legal levels)."""
    v = v.reshape(-1).to(torch.int32)
    if v.numel():
        lo, hi = torch.aminmax(v)
        if int(lo) < 0 or int(hi) >= 1 << 16:
            raise ValueError(f"pack_words16: values must be in [0, 65535], got [{int(lo)}, {int(hi)}]")
    n = v.numel()
    if n % 2:
        v = torch.cat([v, v.new_zeros(1)])
    pairs = v.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 16)


def unpack_words16(words: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_words16: int32 words -> int32[n] lane values in [0, 2**16)."""
    if words.dtype != torch.int32 or words.numel() * 2 < n:
        raise ValueError(f"unpack_words16: need int32 words holding {n} lanes, got "
                         f"{words.numel()} {words.dtype}")
    lanes = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], dim=1)
    return lanes.view(-1)[:n]
