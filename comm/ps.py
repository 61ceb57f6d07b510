"""Distributed Lion's parameter-server aggregation (Distributed Lion Alg. 1, eq. 5), packed.

Group rank 0 plays the server (and is also a worker). Each worker sends its tie-broken signs as
1 bit per element; the server counts the "+" votes c and sends back either the majority
tb(2c - P, step) as 1 bit per element ("vote"), or c itself in ceil(log2(P+1)) bit planes
("avg", from which every rank forms the mean vote (2c - P) / P).

Topologies (Lion Cub Table 1, Fig. 2): "naive" = every worker talks to the server directly, so
the server's link carries P-1 payloads each way; "tree" = a binary tree over group ranks (heap
order: children of r are 2r+1 and 2r+2) — partial counts flow up (a subtree of s ranks sends
ceil(log2(s+1)) bit planes, the least that holds its count exactly), the result flows down.
Both give the same result on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._groups import device_of, global_rank, world
from .packing import _lut, _pack_flags, unpack_signs
from .stats import CallTimer, CommStats, default_stats
from .vote import count_dtype, majority_flags, tb_flags

AGGREGATES = ("vote", "avg")
TOPOLOGIES = ("naive", "tree")


def count_bits(c: int) -> int:
    """Bits needed for a count in [0, c]: ceil(log2(c + 1))."""
    return max(1, int(c).bit_length())


def _pack_planes(count: torch.Tensor, nb: int) -> torch.Tensor:
    """int counts[npad] (npad % 8 == 0) -> nb packed bit planes, least significant first."""
    return torch.cat([_pack_flags(((count >> b) & 1).to(torch.uint8)) for b in range(nb)])


def _unpack_planes(buf: torch.Tensor, nb: int, npad: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of _pack_planes: counts[npad] in `dtype` (wide enough for 2**nb - 1)."""
    lut = _lut(1, buf.device)
    planes = torch.index_select(lut, 0, buf.to(torch.int32)).view(torch.uint8).view(nb, npad)
    count = planes[0].to(dtype)
    for b in range(1, nb):
        count |= planes[b].to(dtype) << b
    return count


def _subtree_size(r: int, P: int) -> int:
    if r >= P:
        return 0
    return 1 + _subtree_size(2 * r + 1, P) + _subtree_size(2 * r + 2, P)


def _wait_all(reqs: list) -> None:
    for req in reqs:
        req.wait()


def ps_vote(x: torch.Tensor, step: int, aggregate: str = "vote", topology: str = "naive",
            group=None, stats: CommStats | None = None) -> torch.Tensor:
    """Parameter-server majority vote (int8[n] of +-1) or mean vote (float32[n] in [-1, 1]).

    vote: tb(2c - P, step) with c = number of ranks whose tb(x_i, step) is +1 — equal to
    sign_vote_1bit(x, step). avg: (2c - P) / P, the mean of the tie-broken votes, no tie break."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"ps_vote: aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"ps_vote: topology must be one of {TOPOLOGIES}, got {topology!r}")
    stats = default_stats() if stats is None else stats
    P, rank = world(group)
    n = x.numel()
    npad = -(-n // 8) * 8
    with stats.call(f"ps_vote[{aggregate},{topology}]", device_of(x)) as timer:
        with timer.pack():
            flags = tb_flags(x, step, npad)
        if P == 1:
            count = flags
        elif topology == "naive":
            count = _naive(flags, P, rank, aggregate, step, group, timer)
        else:
            count = _tree(flags, P, rank, aggregate, step, group, timer)
        with timer.pack():
            if aggregate == "vote":
                if isinstance(count, tuple):  # packed majority bits from the server
                    return unpack_signs(count[0], n)
                return majority_flags(count[:n], P, step).to(torch.int8) * 2 - 1
            # (2c - P) / P, computed in float32 where every step is exact for P < 2**24
            return (count[:n].to(torch.float32) * 2 - P) / P


def _server_payload(count: torch.Tensor, P: int, aggregate: str, step: int) -> torch.Tensor:
    if aggregate == "vote":
        return _pack_flags(majority_flags(count, P, step).view(torch.uint8))
    return _pack_planes(count, count_bits(P))


def _decode_payload(buf: torch.Tensor, P: int, aggregate: str, npad: int):
    """Server payload -> ('packed majority',) for vote, or the counts for avg."""
    if aggregate == "vote":
        return (buf,)
    return _unpack_planes(buf, count_bits(P), npad, count_dtype(P))


def _payload_bytes(P: int, aggregate: str, npad: int) -> int:
    return npad // 8 * (1 if aggregate == "vote" else count_bits(P))


def _naive(flags, P, rank, aggregate, step, group, timer: CallTimer):
    npad = flags.numel()
    dev = flags.device
    if rank == 0:
        bufs = [torch.empty(npad // 8, dtype=torch.uint8, device=dev) for _ in range(P - 1)]
        with timer.coll(recv=bufs):
            _wait_all([dist.irecv(b, src=global_rank(group, r), group=group)
                       for r, b in zip(range(1, P), bufs)])
        with timer.pack():
            lut = _lut(1, dev)
            recv = torch.cat(bufs)
            votes = torch.index_select(lut, 0, recv.to(torch.int32)).view(torch.uint8)
            count = votes.view(P - 1, npad).sum(dim=0, dtype=count_dtype(P)) + flags
            payload = _server_payload(count, P, aggregate, step)
        with timer.coll(sent=[payload] * (P - 1)):
            _wait_all([dist.isend(payload, dst=global_rank(group, r), group=group)
                       for r in range(1, P)])
        return count
    with timer.pack():
        packed = _pack_flags(flags)
    with timer.coll(sent=packed):
        dist.send(packed, dst=global_rank(group, 0), group=group)
    payload = torch.empty(_payload_bytes(P, aggregate, npad), dtype=torch.uint8, device=dev)
    with timer.coll(recv=payload):
        dist.recv(payload, src=global_rank(group, 0), group=group)
    with timer.pack():
        return _decode_payload(payload, P, aggregate, npad)


def _tree(flags, P, rank, aggregate, step, group, timer: CallTimer):
    npad = flags.numel()
    dev = flags.device
    children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < P]
    # reduce: partial counts up the tree, each in the fewest bit planes that hold them exactly
    bufs = [torch.empty(npad // 8 * count_bits(_subtree_size(c, P)), dtype=torch.uint8, device=dev)
            for c in children]
    if children:
        with timer.coll(recv=bufs):
            _wait_all([dist.irecv(b, src=global_rank(group, c), group=group)
                       for c, b in zip(children, bufs)])
    with timer.pack():
        count = flags.to(count_dtype(P))
        for c, b in zip(children, bufs):
            count += _unpack_planes(b, count_bits(_subtree_size(c, P)), npad, count_dtype(P))
    if rank != 0:
        with timer.pack():
            up = _pack_planes(count, count_bits(_subtree_size(rank, P)))
        with timer.coll(sent=up):
            dist.send(up, dst=global_rank(group, (rank - 1) // 2), group=group)
        payload = torch.empty(_payload_bytes(P, aggregate, npad), dtype=torch.uint8, device=dev)
        with timer.coll(recv=payload):
            dist.recv(payload, src=global_rank(group, (rank - 1) // 2), group=group)
    else:
        with timer.pack():
            payload = _server_payload(count, P, aggregate, step)
    # broadcast: the server's payload down the same tree, forwarded unchanged
    if children:
        with timer.coll(sent=[payload] * len(children)):
            _wait_all([dist.isend(payload, dst=global_rank(group, c), group=group)
                       for c in children])
    if rank == 0:
        return count
    with timer.pack():
        return _decode_payload(payload, P, aggregate, npad)
