"""Distributed Lion's parameter-server aggregation (Distributed Lion Alg. 1, eq. 5), packed.

Group rank 0 plays the server (and is also a worker). Three aggregates:
- "sign"  Distributed Lion eq. 5 exactly (majority vote): each worker sends its ternary
          delta_i = sign(x_i) in {-1, 0, +1} as 2 bit planes (delta_i + 1 in [0, 2]); the server
          sums S = sum_i delta_i and sends back sign(S) in {-1, 0, +1}, again 2 bit planes. A tie
          (S == 0) gives 0 and an exact zero of every worker stays 0.
- "vote"  the tie-broken 1-bit form: workers send tb(x_i, step) as 1 bit, the server counts the
          "+" votes c and returns the majority tb(2c - P, step) as 1 bit (equal to
          sign_vote_1bit(x, step); Lion Cub's 1-bit variant of the vote).
- "avg"   Distributed Lion-Avg on tie-broken votes: 1 bit up, the count c back in
          ceil(log2(P+1)) bit planes, every rank forms the mean vote (2c - P) / P.

Topologies (Lion Cub Table 1, Fig. 2): "naive" = every worker talks to the server directly, so
the server's link carries P-1 payloads each way; "tree" = a binary tree over group ranks (heap
order: children of r are 2r+1 and 2r+2) — partial sums flow up (a subtree of s ranks sends its
sum of per-rank values in [0, u] as ceil(log2(s*u+1)) bit planes, the least that holds it
exactly; u = 1 for tie-broken flags, 2 for ternary signs), the result flows down.
Every topology gives the same result on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._groups import device_of, global_rank, world
from .packing import _lut, _pack_flags, ceil_div, unpack_signs
from .stats import CallTimer, CommStats, default_stats
from .vote import count_dtype, majority_flags, tb_flags

AGGREGATES = ("sign", "vote", "avg")
TOPOLOGIES = ("naive", "tree")


def count_bits(c: int) -> int:
    """Bits needed for a count in [0, c]: ceil(log2(c + 1))."""
    return max(1, int(c).bit_length())


def unit(aggregate: str) -> int:
    """Largest per-rank value a worker sends: 1 (tie-broken 0/1 flag) or 2 (ternary sign + 1)."""
    return 2 if aggregate == "sign" else 1


def payload_planes(P: int, aggregate: str) -> tuple[int, int]:
    """(bit planes a worker sends up, bit planes the server sends back) per element, naive topology."""
    up = count_bits(unit(aggregate))
    back = {"sign": 2, "vote": 1, "avg": count_bits(P)}[aggregate]
    return up, back


def _pack_planes(count: torch.Tensor, nb: int) -> torch.Tensor:
    """int counts[npad] (npad % 8 == 0) -> nb packed bit planes, least significant first."""
    if nb == 1:
        return _pack_flags(count.to(torch.uint8))
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
    """Parameter-server aggregation of per-rank signs, identical on every rank.

    vote: int8[n] of +-1, tb(2c - P, step) with c = number of ranks whose tb(x_i, step) is +1 —
    equal to sign_vote_1bit(x, step). avg: float32[n], (2c - P) / P, the mean of the tie-broken
    votes, no tie break. sign: int8[n] in {-1, 0, +1}, sign(sum_i sign(x_i)) — Distributed Lion
    eq. 5 majority vote with exact zeros and ties (`step` is unused)."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"ps_vote: aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"ps_vote: topology must be one of {TOPOLOGIES}, got {topology!r}")
    stats = default_stats() if stats is None else stats
    P, rank = world(group)
    n = x.numel()
    npad = ceil_div(n, 8) * 8
    with stats.call(f"ps_vote[{aggregate},{topology}]", device_of(x)) as timer:
        with timer.pack():
            if aggregate == "sign":
                vals = torch.zeros(npad, dtype=torch.uint8, device=x.device)
                vals[:n] = (torch.sign(x.reshape(-1)) + 1).to(torch.uint8)
            else:
                vals = tb_flags(x, step, npad)
        if P == 1:
            count = vals
        elif topology == "naive":
            count = _naive(vals, P, rank, aggregate, step, group, timer)
        else:
            count = _tree(vals, P, rank, aggregate, step, group, timer)
        with timer.pack():
            if isinstance(count, tuple):  # the server's payload, decoded to its final form
                return _final(count[0], P, aggregate, n, step, decoded=True)
            return _final(count, P, aggregate, n, step, decoded=False)


def _final(v: torch.Tensor, P: int, aggregate: str, n: int, step: int, decoded: bool) -> torch.Tensor:
    """The result from the server's total (decoded=False) or from its decoded payload."""
    if aggregate == "vote":
        if decoded:  # packed majority bits
            return unpack_signs(v, n)
        return majority_flags(v[:n], P, step).to(torch.int8) * 2 - 1
    if aggregate == "sign":
        if decoded:  # sign + 1 in [0, 2]
            return v[:n].to(torch.int8) - 1
        return torch.sign(v[:n].to(torch.int32) - P).to(torch.int8)  # sum_i (delta_i + 1) - P
    # (2c - P) / P, computed in float32 where every step is exact for P < 2**24
    return (v[:n].to(torch.float32) * 2 - P) / P


def _server_payload(total: torch.Tensor, P: int, aggregate: str, step: int) -> torch.Tensor:
    if aggregate == "vote":
        return _pack_flags(majority_flags(total, P, step).view(torch.uint8))
    if aggregate == "sign":
        return _pack_planes((torch.sign(total.to(torch.int32) - P) + 1).to(torch.uint8), 2)
    return _pack_planes(total, count_bits(P))


def _decode_payload(buf: torch.Tensor, P: int, aggregate: str, npad: int):
    """Server payload -> (packed majority,) for vote, (sign + 1,) for sign, the counts for avg."""
    if aggregate == "vote":
        return (buf,)
    if aggregate == "sign":
        return (_unpack_planes(buf, 2, npad, torch.uint8),)
    return _unpack_planes(buf, count_bits(P), npad, count_dtype(P))


def _payload_bytes(P: int, aggregate: str, npad: int) -> int:
    return npad // 8 * payload_planes(P, aggregate)[1]


def _naive(vals, P, rank, aggregate, step, group, timer: CallTimer):
    npad = vals.numel()
    dev = vals.device
    up = count_bits(unit(aggregate))
    acc = count_dtype(P * unit(aggregate))
    if rank == 0:
        bufs = [torch.empty(npad // 8 * up, dtype=torch.uint8, device=dev) for _ in range(P - 1)]
        with timer.coll(recv=bufs):
            _wait_all([dist.irecv(b, src=global_rank(group, r), group=group)
                       for r, b in zip(range(1, P), bufs)])
        with timer.pack():
            if up == 1:  # one lookup over all workers' flags at once
                recv = torch.cat(bufs)
                votes = torch.index_select(_lut(1, dev), 0, recv.to(torch.int32)).view(torch.uint8)
                total = votes.view(P - 1, npad).sum(dim=0, dtype=acc) + vals
            else:
                total = vals.to(acc)
                for b in bufs:
                    total += _unpack_planes(b, up, npad, acc)
            payload = _server_payload(total, P, aggregate, step)
        with timer.coll(sent=[payload] * (P - 1)):
            _wait_all([dist.isend(payload, dst=global_rank(group, r), group=group)
                       for r in range(1, P)])
        return total
    with timer.pack():
        packed = _pack_planes(vals, up)
    with timer.coll(sent=packed):
        dist.send(packed, dst=global_rank(group, 0), group=group)
    payload = torch.empty(_payload_bytes(P, aggregate, npad), dtype=torch.uint8, device=dev)
    with timer.coll(recv=payload):
        dist.recv(payload, src=global_rank(group, 0), group=group)
    with timer.pack():
        return _decode_payload(payload, P, aggregate, npad)


def _tree(vals, P, rank, aggregate, step, group, timer: CallTimer):
    npad = vals.numel()
    dev = vals.device
    u = unit(aggregate)
    acc = count_dtype(P * u)
    children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < P]
    # reduce: partial sums up the tree, each in the fewest bit planes that hold them exactly
    bufs = [torch.empty(npad // 8 * count_bits(u * _subtree_size(c, P)), dtype=torch.uint8, device=dev)
            for c in children]
    if children:
        with timer.coll(recv=bufs):
            _wait_all([dist.irecv(b, src=global_rank(group, c), group=group)
                       for c, b in zip(children, bufs)])
    with timer.pack():
        total = vals.to(acc)
        for c, b in zip(children, bufs):
            total += _unpack_planes(b, count_bits(u * _subtree_size(c, P)), npad, acc)
    if rank != 0:
        with timer.pack():
            up = _pack_planes(total, count_bits(u * _subtree_size(rank, P)))
        with timer.coll(sent=up):
            dist.send(up, dst=global_rank(group, (rank - 1) // 2), group=group)
        payload = torch.empty(_payload_bytes(P, aggregate, npad), dtype=torch.uint8, device=dev)
        with timer.coll(recv=payload):
            dist.recv(payload, src=global_rank(group, (rank - 1) // 2), group=group)
    else:
        with timer.pack():
            payload = _server_payload(total, P, aggregate, step)
    # broadcast: the server's payload down the same tree, forwarded unchanged
    if children:
        with timer.coll(sent=[payload] * len(children)):
            _wait_all([dist.isend(payload, dst=global_rank(group, c), group=group)
                       for c in children])
    if rank == 0:
        return total
    with timer.pack():
        return _decode_payload(payload, P, aggregate, npad)
