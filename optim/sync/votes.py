"""Update-sync schemes that aggregate per-rank signs: Lion Cub's 1-bit compressed allreduce,
Distributed Lion's parameter server, and the hierarchical 1-bit vote.

The input is every rank's local update direction c_i (Lion Cub Alg. 1, "c_local"); the result is
identical on every rank: a sign in {-1, 0, +1} per element as int8 (1 byte, not 4: the update
buffer of a sign), or, for the parameter server's "avg", the mean of the votes (float32).

Tie break (Lion Cub App. B.1, Fig. 10): a 1-bit payload cannot carry 0, so tb(x, t) maps x == 0
to +1 on odd t and -1 on even t; tie_break "alternate" passes the step number t, "plus" / "minus"
a fixed odd / even t (the naive variants of Fig. 10).

mask_zero_updates (Lion Cub App. B.1): a parameter ROW (index along dim 0 of a >= 2-D tensor; a
0-/1-D tensor is one row) whose c is exactly zero on every rank gets update exactly 0, as exact
Lion's sign(mean_i c_i) = 0 would give (the padded-vocabulary / never-seen-token rows). The
agreement costs one fp32 allreduce of one flag per row. Schemes whose result already carries
exact zeros (pbit with L >= 1, the exact parameter-server vote) spend no collective on it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import comm
from comm import cost_model, kernels
from comm.ps import AGGREGATES as PS_COMM_AGGREGATES, TOPOLOGIES as PS_TOPOLOGIES, count_bits, payload_planes, unit

from ..options import choice
from .registry import SIGN, UPDATE, Exchange, ExchangeContext, SchemeOptions, SyncScheme, register

TIE_BREAKS = ("alternate", "plus", "minus")
# config name -> comm.ps_vote aggregate: "vote" is Distributed Lion eq. 5 exactly (ternary, 0 on a
# tie); "vote_tiebreak" the 1-bit tie-broken server vote; "avg" Distributed Lion-Avg
PS_AGGREGATES = {"vote": "sign", "vote_tiebreak": "vote", "avg": "avg"}
assert set(PS_AGGREGATES.values()) == set(PS_COMM_AGGREGATES)


@dataclass
class VoteOptions(SchemeOptions):
    tie_break: str = "alternate"
    """How a zero becomes one bit: alternate (+1 on odd steps, -1 on even; Lion Cub App. B.1), plus or
    minus (the naive variants of Lion Cub Fig. 10)."""
    mask_zero_updates: bool = False
    """Do not move parameter rows whose local update is exactly zero on every rank (Lion Cub App. B.1);
    costs one fp32 flag per row on the wire where the vote itself cannot carry a zero."""

    def problems(self, world_size: int | None = None) -> list[str]:
        p: list[str] = []
        choice(p, self.key("tie_break"), self.tie_break, TIE_BREAKS)
        return p

    def tb_step(self, step: int) -> int:
        """The step number handed to comm's tie break."""
        return {"alternate": step, "plus": 1, "minus": 2}[self.tie_break]


def mask_rows_zero_everywhere(c: torch.Tensor, update: torch.Tensor, ctx: ExchangeContext) -> None:
    """Rows of `c` that are exactly 0 on every rank get update 0 (in place)."""
    segs, rows = ctx.segments_for(c.numel()), ctx.rows_for(c.numel())
    views = [(c[o:o + n].view(r, n // r if r else 0), update[o:o + n].view(r, n // r if r else 0))
             for (o, n), r in zip(segs, rows)]
    local = torch.cat([cv.eq(0).all(dim=1) for cv, _ in views]).to(torch.float32)
    # the mean of 0/1 flags is exactly 1.0 only when every rank sent 1
    everywhere = comm.allreduce_mean(local, wire_dtype=torch.float32, group=ctx.group, stats=ctx.stats) == 1.0
    start = 0
    for _, uv in views:
        r = uv.shape[0]
        uv.masked_fill_(everywhere[start:start + r].unsqueeze(1), 0)
        start += r


def _mask_bytes(o: VoteOptions, rows: int, needed: bool) -> int:
    return 4 * rows if (o.mask_zero_updates and needed) else 0


def _mask_time(o: VoteOptions, P: int, rows: int, alpha: float, beta: float, needed: bool) -> float:
    return cost_model.ring_allreduce(P, rows, 32, alpha, beta) if (o.mask_zero_updates and needed) else 0.0


class VoteExchange(Exchange):
    """Shared frame: aggregate, then mask rows that are zero everywhere if asked and needed."""

    exact_zeros = False  # True where the aggregate already maps an all-zero row to 0

    def __init__(self, options: VoteOptions, ctx: ExchangeContext) -> None:
        self.o, self.ctx = options, ctx

    def aggregate(self, c: torch.Tensor, step: int, ctx: ExchangeContext) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def __call__(self, c: torch.Tensor, step: int, ctx: ExchangeContext | None = None) -> torch.Tensor:
        """`ctx`: the context of a part of the vector (a bucket, ExchangeContext.restrict)."""
        ctx = ctx or self.ctx
        update = self.aggregate(c, step, ctx)
        if self.o.mask_zero_updates and not self.exact_zeros:
            mask_rows_zero_everywhere(c, update, ctx)
        return update


# ---- onebit: Lion Cub §3 ------------------------------------------------------------------------
@dataclass
class OneBitOptions(VoteOptions):
    pass


class OneBit(VoteExchange):
    """With compiled kernels the tie-broken signs are packed and the local majority counted by
    fused kernels (comm.kernels: byte-identical to comm's reference path)."""

    def aggregate(self, c, step, ctx):
        tb = self.o.tb_step(step)
        if ctx.world_size == 1 or kernels.resolve_impl(ctx.kernels) == "eager":
            return comm.sign_vote_1bit(c, tb, group=ctx.group, stats=ctx.stats)
        n = c.numel()
        dev = c.device if c.is_cuda else None
        with ctx.stats.timed_pack(device=dev):
            packed = kernels.sign_pack(c, tb, comm.ceil_div(n, 8 * ctx.world_size) * 8 * ctx.world_size,
                                       impl=ctx.kernels)
        out = comm.sign_vote_packed(packed, tb, group=ctx.group, stats=ctx.stats,
                                    local_majority=functools.partial(kernels.unpack_majority, impl=ctx.kernels))
        with ctx.stats.timed_pack(device=dev):
            return comm.unpack_signs(out, n)

    def warmup(self) -> float:
        if self.ctx.world_size == 1:
            return 0.0
        return kernels.warmup(self.ctx.device, world_sizes=(self.ctx.world_size,), impl=self.ctx.kernels,
                              layout=self.ctx.segments or None, agree=True, group=self.ctx.group)


def _onebit_bytes(o: OneBitOptions, P: int, n: int, rank: int, rows: int) -> tuple[int, int]:
    packed = comm.ceil_div(n, 8 * P) * P  # bytes of the padded packed signs
    m = _mask_bytes(o, rows, True)
    return packed + packed // P + m, 2 * packed + m


ONEBIT = register(SyncScheme(
    name="onebit", kind=UPDATE, result=SIGN, options=OneBitOptions,
    build=lambda o, ctx: OneBit(o, ctx), wire_bytes=_onebit_bytes,
    predict=lambda o, P, n, a, b, rows=1: cost_model.onebit_allreduce(P, n, 1, a, b) + _mask_time(o, P, rows, a, b, True),
    wire="1-bit signs: all-to-all, local majority vote, all-gather (Lion Cub §3)",
    help="Lion Cub 1-bit compressed allreduce of the local update signs (update sync)",
    bucketable=True))  # element-wise votes


# ---- ps: Distributed Lion Alg. 1 ------------------------------------------------------------------
@dataclass
class PSOptions(VoteOptions):
    ps_aggregate: str = "vote"
    """vote (Distributed Lion eq. 5 majority vote: ternary signs up, sign of the sum back, 0 on a tie; 2
    bits each way), vote_tiebreak (1-bit tie-broken signs up, tie-broken majority back) or avg
    (Distributed Lion-Avg: 1-bit votes up, their count back in ceil(log2(P+1)) bits)."""
    ps_topology: str = "naive"
    """naive (every worker talks to rank 0, the server) or tree (binary tree, partial sums up)."""

    def problems(self, world_size: int | None = None) -> list[str]:
        p = super().problems(world_size)
        choice(p, self.key("ps_aggregate"), self.ps_aggregate, PS_AGGREGATES)
        choice(p, self.key("ps_topology"), self.ps_topology, PS_TOPOLOGIES)
        return p


class ParameterServer(VoteExchange):
    def __init__(self, options: PSOptions, ctx: ExchangeContext) -> None:
        super().__init__(options, ctx)
        self.aggregate_name = PS_AGGREGATES[options.ps_aggregate]
        self.exact_zeros = self.aggregate_name == "sign"

    def aggregate(self, c, step, ctx):
        return comm.ps_vote(c, self.o.tb_step(step), aggregate=self.aggregate_name, topology=self.o.ps_topology,
                            group=ctx.group, stats=ctx.stats)  # int8 signs, or float32 mean votes


def _subtree(r: int, P: int) -> int:
    return 0 if r >= P else 1 + _subtree(2 * r + 1, P) + _subtree(2 * r + 2, P)


def _ps_bytes(o: PSOptions, P: int, n: int, rank: int, rows: int) -> tuple[int, int]:
    agg = PS_AGGREGATES[o.ps_aggregate]
    plane = comm.ceil_div(n, 8)
    up, back = payload_planes(P, agg)
    m = _mask_bytes(o, rows, agg != "sign")
    if o.ps_topology == "naive":
        if rank == 0:
            return (P - 1) * plane * back + m, (P - 1) * plane * up + m
        return plane * up + m, plane * back + m
    u = unit(agg)
    kids = [c for c in (2 * rank + 1, 2 * rank + 2) if c < P]
    sent = len(kids) * plane * back + (plane * count_bits(u * _subtree(rank, P)) if rank else 0)
    recv = sum(plane * count_bits(u * _subtree(c, P)) for c in kids) + (plane * back if rank else 0)
    return sent + m, recv + m


def _ps_predict(o: PSOptions, P: int, n: int, a: float, b: float, rows: int = 1) -> float:
    agg = PS_AGGREGATES[o.ps_aggregate]
    up, back = payload_planes(P, agg)
    t = (cost_model.ps_naive_packed(P, n, a, b, up=up, back=back) if o.ps_topology == "naive"
         else cost_model.ps_tree_packed(P, n, a, b, unit=unit(agg), back=back))
    return t + _mask_time(o, P, rows, a, b, agg != "sign")


PS = register(SyncScheme(
    name="ps", kind=UPDATE, result=SIGN, options=PSOptions,
    build=lambda o, ctx: ParameterServer(o, ctx), wire_bytes=_ps_bytes, predict=_ps_predict,
    wire="signs to a parameter server (rank 0) and the aggregate back (Distributed Lion Alg. 1, eq. 5)",
    help="Distributed Lion: per-rank signs aggregated by a parameter server (update sync)",
    bucketable=True))


# ---- hierarchical: BinSGDM §4 ---------------------------------------------------------------------
@dataclass
class HierarchicalOptions(VoteOptions):
    node_size: int = 0
    """Ranks per node (contiguous); 0 = LOCAL_WORLD_SIZE from the launcher."""

    def problems(self, world_size: int | None = None) -> list[str]:
        p = super().problems(world_size)
        if self.node_size < 0:
            p.append(f"{self.key('node_size')}: {self.node_size} must be >= 0 (0 = LOCAL_WORLD_SIZE)")
        elif world_size is not None and self.node_size and world_size % self.node_size:
            p.append(f"{self.key('node_size')}: {self.node_size} does not divide the world size {world_size}")
        return p


class Hierarchical(VoteExchange):
    def aggregate(self, c, step, ctx):
        # raw c: BinSGDM §4 sums in full precision inside a node, then votes 1 bit across nodes
        return comm.hierarchical_sign_vote(c, self.o.tb_step(step), node_size=self.o.node_size or None,
                                           group=ctx.group, stats=ctx.stats)


def _hier_bytes(o: HierarchicalOptions, P: int, n: int, rank: int, rows: int) -> tuple[int, int]:
    m = comm.resolve_node_size(o.node_size or None, P)
    k = P // m
    npad = comm.ceil_div(n, 8 * P) * 8 * P
    sent = recv = 0
    if m > 1:
        sent, recv = 4 * npad, 4 * npad // m  # fp32 reduce-scatter of c
        shard = npad // (8 * m)
    else:
        shard = npad // 8
    if k > 1:  # 1-bit vote of the shard across nodes: all-to-all + all-gather
        sent += shard + shard // k
        recv += 2 * shard
    if m > 1:  # all-gather of the packed result inside the node
        sent += shard
        recv += npad // 8
    mask = _mask_bytes(o, rows, True)
    return sent + mask, recv + mask


HIERARCHICAL = register(SyncScheme(
    name="hierarchical", kind=UPDATE, result=SIGN, options=HierarchicalOptions,
    build=lambda o, ctx: Hierarchical(o, ctx), wire_bytes=_hier_bytes,
    predict=lambda o, P, n, a, b, rows=1: (cost_model.hierarchical_onebit(
        P, n, 32, a, b, node_size=comm.resolve_node_size(o.node_size or None, P)) + _mask_time(o, P, rows, a, b, True)),
    wire="fp32 sums inside a node, 1-bit vote across nodes (BinSGDM §4)",
    help="hierarchical 1-bit vote: exact sums inside a node, 1-bit vote between nodes (update sync)",
    # with parallel.shard_size = ranks per node the mesh does its intra-node part (the gradient
    # mean inside the shard group) and comm.mode=onebit its vote across the replicas
    shards=False, bucketable=True))
