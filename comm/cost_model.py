"""Alpha-beta cost model of the aggregation schemes (Lion Cub Table 1, Fig. 2) and a calibration.

Every formula returns seconds for P ranks, N elements, b bits per element on the wire, latency
alpha (s per message) and inverse bandwidth beta (s per bit). With P = 1 nothing moves and every
cost is 0.

One latency model per collective, whichever row uses it (gloo and NCCL run rings):
    allreduce        2 (P-1) alpha   (reduce-scatter + all-gather)
    reduce-scatter     (P-1) alpha
    all-gather         (P-1) alpha
    all-to-all         (P-1) alpha
    point-to-point         1 alpha per message on the critical path
Lion Cub Table 1 prints 2 log2(P) alpha for the direct allreduce and log2(P) alpha for the
all-gather of the 1-bit allreduce (tree-style latency); here those rows use the ring latency of
the collective our implementation calls, so that two rows calling the same collective agree.
The bandwidth terms are Table 1's:

    parameter server, naive      2(P-1) alpha + 2 P N b beta
    parameter server, efficient  2 log2(P) alpha + 3 (P-1)/P N b beta   (tree gather/broadcast)
    direct allreduce             2(P-1) alpha + 2 (P-1)/P N b beta      (b = lane width; None: log2(P)+1)
    1-bit compressed allreduce   2(P-1) alpha + (1 + (P-1)/P) N beta    (all-to-all + all-gather)
    ring allreduce               2(P-1) alpha + 2 (P-1)/P N b beta      (fp32: b = 32, bf16: 16)

`ps_naive_packed` / `ps_tree_packed` model our comm.ps_vote implementations (packed payloads of
`up` bit planes to the server and `back` planes to the workers, binary tree without
pipelining). Which formula a communication mode uses, with which b, is declared by the mode's
entry in the sync-scheme registry (optim.sync): this module knows collectives, not modes.

Several nodes (`NodeLayout`, applied with `with node_layout(layout):`): P ranks on P/L nodes of L
contiguous ranks, one network port per node, a fast link inside a node. The (alpha, beta) a formula
receives is then the fit of a ring allreduce over all ranks: a ring in rank order crosses every
node's port once each way with a flat ring's per-hop volume, so ring collectives (allreduce,
reduce-scatter, all-gather) keep the flat formulas at that fit. What a ring does not see is
corrected where the collective crosses the ports differently: an all-to-all sends L (P-L)/P of its
buffer through each port (flat: (P-1)/P, so its bandwidth term x L(P-L)/(P-1)); a naive parameter
server receives P-L payloads on its port (flat: P-1); `hierarchical_onebit` with node_size = L runs
its intra-node phases at the layout's intra-node link and its vote at the inter-node one.

`calibrate` fits alpha and beta on the live group from a message-size sweep of fp32 allreduce
(1 KB .. 32 MB by default, min over calls) against ring_allreduce's formula: beta from the slope
of the large sizes, alpha from the latency-dominated small ones (fit_alpha_beta explains why).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import time
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ._groups import world


def _log2(P: int) -> float:
    return math.log2(P) if P > 1 else 0.0


# ---- several nodes: which link a collective crosses ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """world_size ranks on world_size / node_size nodes of node_size contiguous ranks, one network
    port per node. intra: (alpha, beta) of the ranks of one node; inter: (alpha, beta) of one rank
    per node, measured with all node_size such groups at once (they share the ports, as the
    cross-node phase of a hierarchical exchange does). None: not measured (the formulas that need
    it keep the flat model)."""
    world_size: int
    node_size: int
    intra: tuple[float, float] | None = None
    inter: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.node_size < 1 or self.world_size % self.node_size:
            raise ValueError(f"NodeLayout: node_size={self.node_size} must be >= 1 and divide world_size="
                             f"{self.world_size}")

    def spans_nodes(self, P: int) -> bool:
        """A collective over P ranks is one over the whole layout, and that has several nodes."""
        return P == self.world_size and 1 < self.node_size < P

    def all_to_all_factor(self) -> float:
        """Bytes through one node's port over a flat rank's bytes in an all-to-all of the world."""
        P, L = self.world_size, self.node_size
        return L * (P - L) / (P - 1)

    def server_factor(self) -> float:
        """Payloads through the server node's port over a flat server's in a naive gather/scatter."""
        P, L = self.world_size, self.node_size
        return (P - L) / (P - 1)


_LAYOUT: contextvars.ContextVar[NodeLayout | None] = contextvars.ContextVar("cost_model_layout", default=None)


@contextlib.contextmanager
def node_layout(layout: NodeLayout | None) -> Iterator[NodeLayout | None]:
    """The formulas evaluated inside this block model `layout` (None: one flat network)."""
    token = _LAYOUT.set(layout)
    try:
        yield layout
    finally:
        _LAYOUT.reset(token)


def current_layout() -> NodeLayout | None:
    return _LAYOUT.get()


def _spanning(P: int) -> NodeLayout | None:
    layout = _LAYOUT.get()
    return layout if layout is not None and layout.spans_nodes(P) else None


# ---- primitive collectives (bits on the wire per rank) --------------------------------------------
def allreduce_time(P: int, bits: float, alpha: float, beta: float) -> float:
    """Ring allreduce of a `bits`-bit buffer: 2(P-1) alpha + 2 (P-1)/P bits beta."""
    return 0.0 if P <= 1 else 2 * (P - 1) * alpha + 2 * (P - 1) / P * bits * beta


def reduce_scatter_time(P: int, bits: float, alpha: float, beta: float) -> float:
    """Ring reduce-scatter of a `bits`-bit input: (P-1) alpha + (P-1)/P bits beta."""
    return 0.0 if P <= 1 else (P - 1) * alpha + (P - 1) / P * bits * beta


def all_gather_time(P: int, bits: float, alpha: float, beta: float) -> float:
    """Ring all-gather into a `bits`-bit output: (P-1) alpha + (P-1)/P bits beta."""
    return 0.0 if P <= 1 else (P - 1) * alpha + (P - 1) / P * bits * beta


def all_to_all_time(P: int, bits: float, alpha: float, beta: float) -> float:
    """All-to-all of a `bits`-bit buffer (P chunks, one kept): (P-1) alpha + (P-1)/P bits beta;
    across the nodes of the active NodeLayout the bandwidth term x L(P-L)/(P-1) (module docstring)."""
    if P <= 1:
        return 0.0
    layout = _spanning(P)
    return (P - 1) * alpha + (P - 1) / P * bits * beta * (layout.all_to_all_factor() if layout else 1.0)


# ---- Lion Cub Table 1 rows --------------------------------------------------------------------------
def ps_naive(P: int, N: int, b: float, alpha: float, beta: float) -> float:
    """Parameter server, every worker to/from the server directly (Table 1 row 1)."""
    if P <= 1:
        return 0.0
    return 2 * (P - 1) * alpha + 2 * P * N * b * beta


def ps_efficient(P: int, N: int, b: float, alpha: float, beta: float) -> float:
    """Parameter server with tree/pipelined gather and broadcast (Table 1 row 2)."""
    if P <= 1:
        return 0.0
    return 2 * _log2(P) * alpha + 3 * (P - 1) / P * N * b * beta


def direct_allreduce(P: int, N: int, b: float | None, alpha: float, beta: float) -> float:
    """SUM allreduce of b-bit packed lanes (Table 1 row 3; b=None: the paper's log2(P)+1), with
    the ring allreduce's latency (the same collective as the gradient allreduce)."""
    bits = _log2(P) + 1 if b is None else b
    return allreduce_time(P, N * bits, alpha, beta)


def onebit_allreduce(P: int, N: int, b: float, alpha: float, beta: float) -> float:
    """1-bit compressed allreduce: all-to-all + all-gather of packed signs (Table 1 row 4).
    b is accepted for a uniform signature and ignored (the payload is 1 bit per element). Across
    the nodes of the active NodeLayout plus the bytes its all-to-all puts through a node's port
    beyond a flat rank's ((L(P-L) - (P-1))/P N bits)."""
    if P <= 1:
        return 0.0
    layout = _spanning(P)
    extra = (layout.all_to_all_factor() - 1) * (P - 1) / P if layout else 0.0
    return 2 * (P - 1) * alpha + (1 + (P - 1) / P + extra) * N * beta


def ring_allreduce(P: int, N: int, b: float, alpha: float, beta: float) -> float:
    """Bandwidth-optimal ring allreduce of N b-bit words (fp32: b=32, bf16: b=16)."""
    return allreduce_time(P, N * b, alpha, beta)


def hierarchical_onebit(P: int, N: int, b: float, alpha: float, beta: float,
                        node_size: int = 1) -> float:
    """BinSGDM §4 on one flat network: intra-node reduce-scatter of b-bit words, a 1-bit
    compressed allreduce of N/m elements across P/m nodes, intra-node all-gather of 1-bit. Under a
    NodeLayout of node_size ranks per node the intra-node phases run at its intra link and the
    vote at its inter link (where measured)."""
    if P <= 1:
        return 0.0
    m, k = node_size, P // node_size
    layout = _spanning(P)
    ai, bi = layout.intra if layout and layout.node_size == m and layout.intra else (alpha, beta)
    ax, bx = layout.inter if layout and layout.node_size == m and layout.inter else (alpha, beta)
    return (reduce_scatter_time(m, N * b, ai, bi) + onebit_allreduce(k, N / m, 1, ax, bx)
            + all_gather_time(m, N, ai, bi))


def ps_naive_packed(P: int, N: int, alpha: float, beta: float, up: int = 1, back: int = 1) -> float:
    """Our ps_vote(topology="naive") on links limited at each rank: the server's ingress carries
    P-1 payloads of `up` bits per element, then its egress P-1 result payloads of `back` bits
    (tie-broken vote: 1 and 1; exact eq. 5 sign: 2 and 2; avg: 1 and ceil(log2(P+1))). Table 1's
    2PNb counts the server's own payload too. Across the nodes of the active NodeLayout the
    server's port carries P-L payloads each way (its own node's arrive over the intra link)."""
    if P <= 1:
        return 0.0
    layout = _spanning(P)
    return 2 * (P - 1) * alpha + (P - 1) * N * (up + back) * beta * (layout.server_factor() if layout else 1.0)


def _planes(c: int) -> int:
    return max(1, int(c).bit_length())  # ceil(log2(c + 1)) bits hold a count in [0, c]


def ps_tree_packed(P: int, N: int, alpha: float, beta: float, unit: int = 1, back: int = 1) -> float:
    """Our ps_vote(topology="tree"): heap-ordered binary tree; a parent receives its children's
    partial sums (ceil(log2(unit*s+1)) planes for a subtree of s ranks, `unit` the largest value
    one rank sends) concurrently on its ingress after the slower child finished, then the result
    (`back` planes) flows down with each parent sending to its children concurrently on its
    egress. Critical path in the alpha-beta model; one flat network also under a NodeLayout (the
    tree's edges are not mapped onto the nodes' ports)."""
    if P <= 1:
        return 0.0

    def size(r: int) -> int:
        return 0 if r >= P else 1 + size(2 * r + 1) + size(2 * r + 2)

    def up(r: int) -> float:  # time until r holds its subtree's sum
        kids = [c for c in (2 * r + 1, 2 * r + 2) if c < P]
        if not kids:
            return 0.0
        return max(up(c) for c in kids) + alpha + sum(_planes(unit * size(c)) for c in kids) * N * beta

    def down(r: int) -> float:  # time from r holding the result until its whole subtree has it
        kids = [c for c in (2 * r + 1, 2 * r + 2) if c < P]
        if not kids:
            return 0.0
        return alpha + len(kids) * back * N * beta + max(down(c) for c in kids)

    return up(0) + down(0)


TABLE1: dict[str, Callable[..., float]] = {
    "ps_naive": ps_naive,
    "ps_efficient": ps_efficient,
    "direct_allreduce": direct_allreduce,
    "onebit_allreduce": onebit_allreduce,
    "ring_allreduce": ring_allreduce,
}


# ------------------------------------------------------------------------------------------------
# calibration: measure an fp32 allreduce size sweep, fit ring_allreduce's alpha and beta
# ------------------------------------------------------------------------------------------------

# 1 KB .. 32 MB. The top sizes must sit far above netsim's tbf bucket (128 KB at 1gbit,
# bench/netsim.py default_burst): the bucket's contents leave at line rate, so a message not much
# larger than the bucket measures faster than the link and would bias beta low. At 1gbit the whole
# default sweep takes ~2 s at P=2 and ~3 s at P=4 (the 16 MB and 32 MB points dominate).
DEFAULT_SIZES: tuple[int, ...] = (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22,
                                  1 << 24, 1 << 25)
BIG_MESSAGE_BYTES = 4 << 20   # sizes above this get at most BIG_REPEATS timed calls (time bound)
BIG_REPEATS = 3
LARGE_FRACTION = 1 / 16       # bandwidth regime: sizes >= LARGE_FRACTION * the largest size
LATENCY_SHARE = 0.5           # latency regime: sizes whose beta term is <= this share of the time
STATS = ("min", "median")


def _ring_features(P: int, size_bytes: float) -> tuple[float, float]:
    """(alpha coefficient, beta coefficient) of ring_allreduce for one fp32 message of size_bytes."""
    return 2.0 * (P - 1), 2.0 * (P - 1) / P * 8.0 * size_bytes


def fit_alpha_beta(P: int, sizes_bytes: Sequence[int], seconds: Sequence[float], *,
                   info: dict | None = None) -> tuple[float, float]:
    """Fit (alpha [s], beta [s/bit]) of t = 2(P-1) alpha + 2(P-1)/P * 8*bytes * beta (ring_allreduce)
    to one measured time per message size. beta is seconds per BIT (1gbit link: ~1e-9).

    Two regimes, because neither end of a sweep measures both parameters well:
    - beta is the slope of the large sizes (>= LARGE_FRACTION of the largest), ordinary least squares
      in absolute time with a free intercept. The intercept absorbs the constant that a token-bucket
      shaper subtracts (its bucket leaves at line rate, so every large message is ~bucket/rate
      faster than bytes/rate) and any per-call overhead, so neither biases the slope; small sizes,
      whose times are mostly CPU-load noise, have no say. With fewer than two distinct large sizes
      the slope is not identified and a joint fit over all sizes with 1/sqrt(t) row weights (noise
      variance growing with duration) gives beta, and alpha too when both come out non-negative.
    - alpha is the median over the latency-dominated sizes (beta term <= LATENCY_SHARE of the
      measured time; the smallest size when none is) of (t - beta term) / 2(P-1), clamped at 0.
    Finally beta is raised, if needed, so that the model is never faster than the measurement of
    the largest message: beta >= (t_L - 2(P-1) alpha) / (2(P-1)/P * 8 * bytes_L).
    If even the large sizes show no positive slope, beta = t_L / (beta coefficient of L) (the whole
    largest time as bandwidth) with alpha from the latency regime.

    info, if a dict, receives how the fit went: method, large / latency sizes, guard_raised.
    Returns (0.0, 0.0) for P <= 1."""
    if P <= 1:
        return 0.0, 0.0
    if len(sizes_bytes) != len(seconds):
        raise ValueError(f"fit_alpha_beta: {len(sizes_bytes)} sizes but {len(seconds)} times; "
                         f"pass one time per size")
    pts = sorted((int(s), float(t)) for s, t in zip(sizes_bytes, seconds))
    bad = [(s, t) for s, t in pts if s <= 0 or not (math.isfinite(t) and t > 0)]
    if bad:
        raise ValueError(f"fit_alpha_beta: sizes must be > 0 bytes and times finite and > 0 s, got "
                         f"(bytes, s) = {bad}; drop failed measurements before fitting")
    if len({s for s, _ in pts}) < 2:
        raise ValueError(f"fit_alpha_beta: need at least two distinct message sizes, got "
                         f"{sorted({s for s, _ in pts})}; sweep sizes from ~1 KB to well above the "
                         f"link's burst (e.g. comm.cost_model.DEFAULT_SIZES)")
    xa = 2.0 * (P - 1)
    xb = torch.tensor([_ring_features(P, s)[1] for s, _ in pts], dtype=torch.float64)
    t = torch.tensor([t for _, t in pts], dtype=torch.float64)
    s_max = pts[-1][0]
    large = [i for i, (s, _) in enumerate(pts) if s >= LARGE_FRACTION * s_max]
    alpha: float | None = None
    if len({pts[i][0] for i in large}) >= 2:
        method = "slope of the large sizes"
        xl, tl = xb[large], t[large]
        dx = xl - xl.mean()
        beta = float((dx * (tl - tl.mean())).sum() / (dx * dx).sum())
    else:
        method = "joint fit, 1/sqrt(t) weights"
        A = torch.stack([torch.full_like(xb, xa), xb], dim=1)
        w = t.rsqrt().unsqueeze(1)
        sol = torch.linalg.lstsq(A * w, t.unsqueeze(1) * w).solution.squeeze(1)
        beta = float(sol[1])
        if float(sol[0]) >= 0 and beta > 0:
            alpha = float(sol[0])
    if not (math.isfinite(beta) and beta > 0):
        method += "; no positive slope, beta from the largest size alone"
        beta = float(t[-1] / xb[-1])
    latency = [i for i in range(len(pts)) if beta * float(xb[i]) <= LATENCY_SHARE * float(t[i])]
    if alpha is None:
        use = latency or [0]
        per_size = sorted(max(0.0, float(t[i]) - beta * float(xb[i])) / xa for i in use)
        mid = len(per_size) // 2
        alpha = per_size[mid] if len(per_size) % 2 else 0.5 * (per_size[mid - 1] + per_size[mid])
        method += "; alpha from the latency sizes" if latency else "; alpha from the smallest size"
    floor = (float(t[-1]) - xa * alpha) / float(xb[-1])
    guard = floor > beta * (1 + 1e-9)  # not for rounding-level differences on exact data
    beta = max(beta, floor)
    if info is not None:
        info.update(method=method, large_sizes=[pts[i][0] for i in large],
                    latency_sizes=[pts[i][0] for i in latency], guard_raised=guard)
    return alpha, beta


def _repeats_for(size: int, repeats: int) -> int:
    return repeats if size <= BIG_MESSAGE_BYTES else min(repeats, BIG_REPEATS)


def measure_allreduce_seconds(sizes: Sequence[int], repeats: int = 5, group=None,
                              stat: str = "min") -> list[float]:
    """Seconds of one fp32 SUM allreduce (dist.all_reduce) per byte size in `sizes` on the live
    group: one warm-up call per size, then `repeats` timed calls (at most BIG_REPEATS above
    BIG_MESSAGE_BYTES, to bound the sweep's time), each started right after a barrier.

    A call's time is the maximum over ranks (the collective is done when its last rank is); the
    per-size value is the minimum over calls (stat="min", default) or their median
    (stat="median"). The minimum is the default because load from other processes only ever
    adds time to a call: on a shared, loaded machine the fastest call is the closest to what the
    link and the algorithm cost, while the median still carries the load of the moment.

    Collective: every rank of the group calls it with the same arguments; all ranks return the
    same list."""
    if stat not in STATS:
        raise ValueError(f"measure_allreduce_seconds: stat={stat!r}; valid: {', '.join(STATS)}")
    if repeats < 1:
        raise ValueError(f"measure_allreduce_seconds: repeats={repeats}; need at least 1 timed call")
    if any(int(s) <= 0 for s in sizes):
        raise ValueError(f"measure_allreduce_seconds: sizes must be positive byte counts, got {list(sizes)}")
    times = torch.full((len(sizes), repeats), -1.0, dtype=torch.float64)
    for k, size in enumerate(sizes):
        buf = torch.ones(max(1, int(size) // 4), dtype=torch.float32)
        dist.all_reduce(buf, group=group)  # warm-up: connection set-up and allocation
        for r in range(_repeats_for(int(size), repeats)):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            times[k, r] = time.perf_counter() - t0
        del buf
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    out = []
    for k, size in enumerate(sizes):
        row = times[k, :_repeats_for(int(size), repeats)]
        out.append(float(row.min()) if stat == "min" else float(row.median()))
    return out


def calibrate(group=None, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5,
              verbose: bool = False, *, stat: str = "min") -> tuple[float, float]:
    """Measure (alpha [s], beta [s/bit]) on the live group: measure_allreduce_seconds(sizes,
    repeats, stat) (fp32 SUM allreduce; min over calls by default), fitted by fit_alpha_beta
    (beta from the large sizes, alpha from the small ones). The largest size should be far above
    the link's burst/bucket (tbf: 128 KB at 1gbit); the default sweep goes to 32 MB.

    Collective: every rank of the group must call it; all ranks return the same fit. A world of
    one rank returns (0.0, 0.0). verbose=True prints measured vs model per size on rank 0."""
    if world(group)[0] == 1:
        return 0.0, 0.0
    if len({int(s) for s in sizes}) < 2:
        raise ValueError(f"calibrate: need at least two distinct sizes, got {list(sizes)}")
    P = world(group)[0]
    measured = measure_allreduce_seconds(sizes, repeats, group=group, stat=stat)
    nbytes = [max(1, int(s) // 4) * 4 for s in sizes]
    info: dict = {}
    alpha, beta = fit_alpha_beta(P, nbytes, measured, info=info)
    if verbose and dist.get_rank(group) == 0:
        print(f"calibrate: P={P} alpha={alpha * 1e6:.1f} us beta={beta * 1e9:.4f} ns/bit "
              f"({1 / beta / 1e9 if beta else float('inf'):.3f} Gbit/s) [{info['method']}"
              f"{'; raised to the largest size' if info['guard_raised'] else ''}; {stat} over calls]")
        print(f"  {'bytes':>10s} {'calls':>5s} {'measured ms':>12s} {'model ms':>10s} {'model/meas':>10s}  used for")
        for size, n, t in zip(sizes, nbytes, measured):
            model = ring_allreduce(P, n // 4, 32, alpha, beta)
            use = ("beta " if n in info["large_sizes"] else "") + ("alpha" if n in info["latency_sizes"] else "")
            print(f"  {size:>10d} {_repeats_for(int(size), repeats):>5d} {t * 1e3:12.3f} "
                  f"{model * 1e3:10.3f} {model / t:10.3f}  {use}")
    return alpha, beta


def main(argv: Sequence[str] | None = None) -> None:
    """Calibrate on the live group and print the fit, measured vs model per size, and the Table 1
    rows for N = 25M at the calibrated alpha, beta; --check-n N also times an fp32 allreduce
    of N elements (min over --check-repeats calls) against the model.

        torchrun --standalone --nproc_per_node=4 -m comm.cost_model
        python -m bench.netsim --nproc 2 --rate 1gbit -- python -m comm.cost_model --check-n 25000000
    """
    import argparse

    ap = argparse.ArgumentParser(prog="python -m comm.cost_model", description=main.__doc__)
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated bytes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stat", choices=STATS, default="min")
    ap.add_argument("--check-n", type=int, default=0, help="also time an fp32 allreduce of N elements")
    ap.add_argument("--check-repeats", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    dist.init_process_group("gloo")
    P = dist.get_world_size()
    t0 = time.perf_counter()
    alpha, beta = calibrate(sizes=sizes, repeats=args.repeats, verbose=True, stat=args.stat)
    if dist.get_rank() == 0:
        print(f"  calibration took {time.perf_counter() - t0:.1f} s")
        N = 25_000_000
        for name, f in TABLE1.items():
            print(f"  {name:17s} N={N} b=32: {f(P, N, 32, alpha, beta) * 1e3:9.2f} ms")
    if args.check_n > 0:
        (t,) = measure_allreduce_seconds([4 * args.check_n], args.check_repeats, stat=args.stat)
        if dist.get_rank() == 0:
            model = ring_allreduce(P, args.check_n, 32, alpha, beta)
            print(f"  check fp32 allreduce N={args.check_n}: measured {t * 1e3:.2f} ms ({args.stat} of "
                  f"{_repeats_for(4 * args.check_n, args.check_repeats)}), model {model * 1e3:.2f} ms, "
                  f"model/measured {model / t:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
