"""Allreduces: the direct p-bit integer sum in packed lanes, and the float mean for gradients.

int_allreduce is Lion Cub's "direct allreduce" (§3, Table 1; App. F.1 for p-bit quantized
updates): shift q in [-L, L] to [0, 2L], pack into `bits`-wide lanes, SUM-allreduce the bytes.
The sum of P lanes must stay below 2**bits or it carries into the neighbouring lane; the
research code overflowed silently past 15 workers at 4 bits, so here the
rule P * 2L <= 2**bits - 1 is checked before anything is sent.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ._groups import device_of, world
from .packing import LANE_BITS, lane_max, pack_lanes, pack_words16, unpack_lanes, unpack_words16
from .stats import CommStats, default_stats

INT_BITS = LANE_BITS + (16,)
# Value checks that read a tensor back to the host (a device sync) run only in debug mode:
# LIONCUB_DEBUG=1 in the environment, or set_debug(True).
DEBUG = os.environ.get("LIONCUB_DEBUG", "") not in ("", "0")


def set_debug(on: bool) -> None:
    """Turn on the value checks that cost a host sync (int_allreduce's range check)."""
    global DEBUG
    DEBUG = bool(on)


def max_levels(P: int, bits: int) -> int:
    """Largest L with P * 2L <= 2**bits - 1 (0 = only the 0/1 sign encoding fits, -1 = nothing)."""
    if bits not in INT_BITS:
        raise ValueError(f"bits must be one of {INT_BITS}, got {bits}")
    top = lane_max(bits)
    if P > top:
        return -1
    return top // (2 * P)


def check_lanes(P: int, levels: int, bits: int) -> None:
    """Raise ValueError when `levels` at `bits` would overflow a lane summed over P ranks."""
    if bits not in INT_BITS:
        raise ValueError(f"int_allreduce: bits must be one of {INT_BITS}, got {bits}")
    if levels < 0:
        raise ValueError(f"int_allreduce: levels must be >= 0, got {levels}")
    top = lane_max(bits)
    if levels == 0:
        if max_levels(P, bits) < 0:
            raise ValueError(f"int_allreduce: the 0/1 sign encoding (levels=0) sums to at most "
                             f"P={P} per lane, more than 2**{bits}-1={top}; use more bits or "
                             f"fewer ranks")
    elif levels > max_levels(P, bits):
        raise ValueError(f"int_allreduce: P * 2 * levels = {P} * 2 * {levels} = {P * 2 * levels} "
                         f"exceeds the {bits}-bit lane maximum 2**{bits}-1={top}; use "
                         f"levels <= {max_levels(P, bits)} or more bits")


def _check_values(q: torch.Tensor, levels: int) -> None:
    if q.is_floating_point() or q.is_complex() or q.dtype == torch.bool:
        raise TypeError(f"int_allreduce expects integer q (int8), got {q.dtype}")
    if q.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(q))
    if levels == 0:
        # zeros: as uint8, -1 reads 255 and +1 reads 1, so no zero <=> the unsigned min is >= 1
        has_zero = (int(torch.amin(q.view(torch.uint8))) == 0 if q.dtype == torch.int8
                    else bool((q == 0).any()))
        if lo < -1 or hi > 1 or has_zero:
            raise ValueError(f"int_allreduce: levels=0 carries signs only and needs q in "
                             f"{{-1, +1}}, got values in [{lo}, {hi}] (zeros included); use "
                             f"levels >= 1 to send 0")
    elif lo < -levels or hi > levels:
        raise ValueError(f"int_allreduce: q must lie in [-{levels}, {levels}], got [{lo}, {hi}]")


def int_allreduce(q: torch.Tensor, levels: int, bits: int, group=None,
                  stats: CommStats | None = None) -> torch.Tensor:
    """Exact sum over ranks of integer q[n] in [-levels, levels], as int32[n] on every rank.

    q is int8 (the public contract); other integer dtypes are accepted (bits=16 allows levels > 127).

    Wire: uint8 bytes of `bits`-wide lanes for bits in {1, 2, 4, 8} (ceil(n*bits/8) bytes per
    rank), int32 words of two 16-bit lanes for bits=16 (2 bytes per element; neither gloo nor
    NCCL reduces int16). levels=0 means q holds signs +-1 sent as 0/1 flags (Lion Cub §3 "direct
    allreduce"); the sum is then 2*count_plus - P. Raises ValueError when P * 2 * levels >
    2**bits - 1 (levels=0: P > 2**bits - 1), and, in debug mode (LIONCUB_DEBUG=1, set_debug),
    when q is out of range (that check reads q back to the host)."""
    stats = default_stats() if stats is None else stats
    P, _ = world(group)
    check_lanes(P, levels, bits)
    q = q.reshape(-1)
    n = q.numel()
    with stats.call("int_allreduce", device_of(q)) as timer:
        with timer.pack():
            if DEBUG:  # reads q's range back to the host: debug mode only
                _check_values(q, levels)
            if bits == 16:
                v32 = (q > 0).to(torch.int32) if levels == 0 else q.to(torch.int32) + levels
                wire = pack_words16(v32)
            else:
                if levels == 0:
                    v = (q > 0).view(torch.uint8)
                elif q.dtype == torch.int8:
                    v = q.view(torch.uint8) + levels  # uint8 wraparound: (q mod 256) + L = q + L
                else:
                    v = (q.to(torch.int32) + levels).to(torch.uint8)  # < 256 by check_lanes
                wire = pack_lanes(v, bits, check=False)
        if P > 1:
            with timer.coll(sent=wire, recv=wire):
                dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group)
        with timer.pack():
            if bits == 16:
                total = unpack_words16(wire, n)
            else:
                total = unpack_lanes(wire, bits, n).to(torch.int32)
            if levels == 0:
                return total.mul_(2).sub_(P)
            return total.sub_(P * levels)


def allreduce_mean(x: torch.Tensor, wire_dtype: torch.dtype = torch.float32, group=None,
                   stats: CommStats | None = None, inplace: bool = False) -> torch.Tensor:
    """Mean of x over ranks, in x.dtype, identical on every rank: one SUM allreduce of a single
    flat buffer in `wire_dtype` (float32 or bfloat16), divided by P after casting back.

    inplace=True writes the mean into x (contiguous) and returns x: the trainer's flat gradient
    buffer then needs no wire copy when the wire dtype is x.dtype, and no copy back either way."""
    if wire_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"allreduce_mean: wire_dtype must be torch.float32 or torch.bfloat16, "
                         f"got {wire_dtype}")
    if inplace and not x.is_contiguous():
        raise ValueError("allreduce_mean(inplace=True) needs a contiguous tensor; pass x.contiguous() "
                         "or use inplace=False")
    stats = default_stats() if stats is None else stats
    P, _ = world(group)
    with stats.call(f"allreduce_mean[{str(wire_dtype).removeprefix('torch.')}]",
                    device_of(x)) as timer:
        flat = x.view(-1) if inplace else None
        with timer.pack():
            if inplace and wire_dtype == x.dtype:
                buf = flat
            else:
                buf = x.reshape(-1).to(wire_dtype, copy=True)
        if P > 1:
            with timer.coll(sent=buf, recv=buf):
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        with timer.pack():
            if inplace:
                if buf is not flat:
                    flat.copy_(buf)
                out = x
            else:
                out = buf.to(x.dtype).view(x.shape)  # buf itself when the wire dtype is x.dtype
            if P > 1:
                out.div_(P)
            return out


def any_rank(flag: bool | torch.Tensor, group=None, stats: CommStats | None = None) -> bool:
    """True on every rank if `flag` is true on any rank: one MAX-allreduce of one int32 (a control
    message, e.g. the divergence guard's agreement). `flag` may be a 0-d bool tensor on the device,
    so the only host sync is reading the agreed result."""
    stats = default_stats() if stats is None else stats
    P, _ = world(group)
    t = (flag if isinstance(flag, torch.Tensor) else torch.tensor(bool(flag))).reshape(1).to(torch.int32)
    with stats.call("any_rank", device_of(t)) as timer:
        if P > 1:
            with timer.coll(sent=t, recv=t):
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def allreduce_packed_(wire: torch.Tensor, group=None, stats: CommStats | None = None,
                      name: str = "allreduce_packed") -> torch.Tensor:
    """SUM-allreduce of an already packed wire in place (the collective of int_allreduce, for
    callers that pack with a fused kernel); the caller guarantees every lane sum fits."""
    stats = default_stats() if stats is None else stats
    P, _ = world(group)
    with stats.call(name, device_of(wire)) as timer:
        if P > 1:
            with timer.coll(sent=wire, recv=wire):
                dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group)
    return wire
