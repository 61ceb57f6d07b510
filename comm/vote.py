"""Majority votes over 1-bit signs: the 1-bit compressed allreduce and its hierarchical form.

Tie break (Lion Cub App. B.1): tb(x, step) = +1 for x > 0, -1 for x < 0, and for
x == 0 +1 when `step` is odd, -1 when even. As a flag (1 = "+1"): x >= 0 on odd steps, x > 0 on
even steps. The majority of P signs is tb(2 * count_plus - P, step) in exact integer arithmetic
(a threshold written as count > P/2 is off by one for odd P, as in Lion Cub's public research code); `majority_flags`
evaluates it as an equivalent integer threshold on the count.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._groups import all_gather_single, device_of, node_groups, reduce_scatter_single, resolve_node_size, world
from .packing import _lookup, _lut, _pack_flags, ceil_div, pack_positive, unpack_signs
from .stats import CallTimer, CommStats, default_stats



def tb_flags(x: torch.Tensor, step: int, length: int | None = None) -> torch.Tensor:
    """1/0 flags (uint8) of tb(x, step) for a 1-D x, zero-padded to `length`."""
    x = x.reshape(-1)
    n = x.numel()
    length = n if length is None else length
    flags = torch.empty(length, dtype=torch.bool, device=x.device)
    if step % 2:
        torch.ge(x, 0, out=flags[:n])
    else:
        torch.gt(x, 0, out=flags[:n])
    flags[n:] = False
    return flags.view(torch.uint8)


def tb_packed(x: torch.Tensor, step: int, length: int | None = None) -> torch.Tensor:
    """tb(x, step) as packed bits (1 = +1), zero-padded to `length` bits."""
    return pack_positive(x, include_zero=bool(step % 2), length=length)


def count_dtype(P: int) -> torch.dtype:
    """Narrowest fast dtype for counts in [0, P] (torch's int16 kernels are slow on CPU)."""
    return torch.uint8 if P <= 255 else torch.int32


def majority_threshold(P: int, step: int) -> int:
    """The least count c of "+" votes among P with tb(2c - P, step) = +1 (the project's one
    majority rule). Exact threshold form, no subtraction in a narrow dtype: 2c - P > 0 or
    (2c - P == 0 and odd step) <=> c >= ceil(P / 2) on odd steps; 2c - P > 0 <=> c >= floor(P / 2)
    + 1 on even steps."""
    return (P + 1) // 2 if step % 2 else P // 2 + 1


def majority_flags(plus: torch.Tensor, P: int, step: int) -> torch.Tensor:
    """Flags (bool) of tb(2 * plus - P, step) for counts `plus` of "+" votes among P."""
    return plus >= majority_threshold(P, step)


def local_majority(recv: torch.Tensor, P: int, step: int) -> torch.Tensor:
    """recv: uint8[P * c] packed chunks from P ranks (row r = rank r) -> packed tb(2*plus - P)."""
    c = recv.numel() // P
    flags = torch.empty(P * c * 8, dtype=torch.uint8, device=recv.device)
    _lookup(_lut(1, recv.device), recv, flags.view(torch.int64))
    plus = flags.view(P, c * 8).sum(dim=0, dtype=count_dtype(P))
    return _pack_flags(majority_flags(plus, P, step).view(torch.uint8))


def sign_vote_1bit(x: torch.Tensor, step: int, group=None,
                   stats: CommStats | None = None) -> torch.Tensor:
    """Majority vote of the tie-broken signs of x over the group: int8[n] of +-1.

    Result tb(sum_i tb(x_i, step), step), identical on every rank. Wire per rank: the packed
    signs (ceil(n/8P)*P bytes) into the all-to-all, one packed chunk (ceil(n/8P) bytes) into the
    all-gather. Any n >= 0; one rank votes alone with no communication."""
    stats = default_stats() if stats is None else stats
    P, _ = world(group)
    n = x.numel()
    with stats.call("sign_vote_1bit", device_of(x)) as timer:
        if P == 1:
            with timer.pack():
                return (tb_flags(x, step).view(torch.int8) * 2 - 1)
        npad = ceil_div(n, 8 * P) * 8 * P
        with timer.pack():
            packed = tb_packed(x, step, npad)
        packed = _vote_packed(packed, step, group, timer)
        with timer.pack():
            return unpack_signs(packed, n)


_reference_majority = local_majority  # the parameter `local_majority` below shadows the name


def _vote_packed(packed: torch.Tensor, step: int, group, timer: CallTimer,
                 local_majority=None) -> torch.Tensor:
    """Lion Cub §3 1-bit compressed allreduce of packed sign bits (uint8, length a multiple of
    P): all-to-all of P chunks, local exact majority of my chunk, all-gather.
    Returns the packed result, identical on every rank of `group`."""
    P, _ = world(group)
    if P == 1:
        return packed
    recv = torch.empty_like(packed)
    with timer.coll(sent=packed, recv=recv):
        dist.all_to_all_single(recv, packed, group=group)
    with timer.pack():
        mine = (local_majority or _reference_majority)(recv, P, step)
    out = torch.empty_like(packed)
    with timer.coll(sent=mine, recv=out):
        all_gather_single(out, mine, group=group)
    return out


def sign_vote_packed(packed: torch.Tensor, step: int, group=None, stats: CommStats | None = None,
                     local_majority=None) -> torch.Tensor:
    """The collective part of sign_vote_1bit for signs packed by the caller (uint8 of a length
    that is a multiple of P; bit = 1 for +1): returns the packed majority tb(2*plus - P, step),
    identical on every rank. `local_majority(recv, P, step)` may replace the reference majority
    with a fused kernel of the same semantics."""
    stats = default_stats() if stats is None else stats
    P, _ = world(group)
    if packed.numel() % max(P, 1):
        raise ValueError(f"sign_vote_packed: {packed.numel()} packed bytes do not split into {P} chunks; "
                         f"pad the signs to a multiple of 8*P")
    with stats.call("sign_vote_1bit", device_of(packed)) as timer:
        return _vote_packed(packed, step, group, timer, local_majority)


def hierarchical_sign_vote(x: torch.Tensor, step: int, node_size: int | None = None, group=None,
                           stats: CommStats | None = None) -> torch.Tensor:
    """Hierarchical 1-bit allreduce (BinSGDM §4): int8[n] of +-1, identical on every rank.

    Ranks form contiguous nodes of `node_size` (default LOCAL_WORLD_SIZE, else one node); it
    must divide the world size P. Contract, with S_k = sum of the raw x_i over the ranks i of
    node k (exact for integer x, float32/64 otherwise):

        result = tb( sum_k tb(S_k, step), step )

    i.e. sign_vote_1bit applied to the node-level sums. Pass signs (int8 +-1) to get a vote of
    node-level votes; pass raw values to get BinSGDM's "aggregate in full precision inside the
    node, quantise once per node". node_size == 1 equals sign_vote_1bit(x); one node equals
    tb(sum_i x_i). Steps (BinSGDM §4 i-iv): (i) intra-node reduce-scatter of x, so local rank l
    holds shard l of S_k; (ii)-(iii) 1-bit vote of that shard among the ranks with local index l
    on every node (all-to-all + all-gather of packed bits across nodes); (iv) intra-node
    all-gather of the packed shard results."""
    stats = default_stats() if stats is None else stats
    P, _ = world(group)
    m = resolve_node_size(node_size, P)
    k = P // m
    n = x.numel()
    xs = x.reshape(-1)
    with stats.call("hierarchical_sign_vote", device_of(x)) as timer:
        intra, inter = node_groups(group, m) if P > 1 else (None, None)
        npad = ceil_div(n, 8 * P) * 8 * P
        acc = torch.float64 if x.dtype == torch.float64 else (
            torch.float32 if x.is_floating_point() else torch.int32)
        if m > 1:
            with timer.pack():
                buf = torch.zeros(npad, dtype=acc, device=x.device)
                buf[:n] = xs
            shard = torch.empty(npad // m, dtype=acc, device=x.device)
            with timer.coll(sent=buf, recv=shard):
                reduce_scatter_single(shard, buf, group=intra)
            with timer.pack():
                packed = tb_packed(shard, step)
        else:
            with timer.pack():
                packed = tb_packed(xs, step, npad)
        mine = _vote_packed(packed, step, inter, timer) if k > 1 else packed
        if m > 1:
            out = torch.empty(npad // 8, dtype=torch.uint8, device=x.device)
            with timer.coll(sent=mine, recv=out):
                all_gather_single(out, mine, group=intra)
        else:
            out = mine
        with timer.pack():
            return unpack_signs(out, n)
