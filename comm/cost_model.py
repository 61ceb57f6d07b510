"""Alpha-beta cost model of the aggregation schemes (Lion Cub Table 1, Fig. 2) and a calibration.

Every formula returns seconds for P ranks, N elements, b bits per element on the wire, latency
alpha (s per message) and inverse bandwidth beta (s per bit). Table 1 rows, as printed:

    parameter server, naive      2(P-1) alpha + 2 P N b beta
    parameter server, efficient  2 log2(P) alpha + 3 (P-1)/P N b beta
    direct allreduce             2 log2(P) alpha + 2 (P-1)/P N (log2(P)+1) beta
    1-bit compressed allreduce   (P-1 + log2 P) alpha + (1 + (P-1)/P) N beta

`direct_allreduce` takes b = the lane width actually used (int_allreduce's `bits`); b=None gives
the paper's log2(P)+1. `ring_allreduce` is the fp32 / bf16 gradient allreduce (b = 32 / 16)
with the bandwidth-optimal 2 (P-1)/P N b beta and a ring's 2 (P-1) alpha. With P = 1 nothing
moves and every cost is 0.

`ps_naive_packed` / `ps_tree_packed` model our ps_vote implementations (1-bit payloads up,
1-bit or count-plane payloads back, binary tree without pipelining); `predict` maps each comm/
mode to its formula.

`calibrate` fits alpha and beta on the live group from a message-size sweep of fp32 allreduce
against ring_allreduce's formula (least squares on the medians).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist


def _log2(P: int) -> float:
    return math.log2(P) if P > 1 else 0.0


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
    """SUM allreduce of b-bit packed lanes (Table 1 row 3; b=None: the paper's log2(P)+1)."""
    if P <= 1:
        return 0.0
    bits = _log2(P) + 1 if b is None else b
    return 2 * _log2(P) * alpha + 2 * (P - 1) / P * N * bits * beta


def onebit_allreduce(P: int, N: int, b: float, alpha: float, beta: float) -> float:
    """1-bit compressed allreduce: all-to-all + all-gather of packed signs (Table 1 row 4).
    b is accepted for a uniform signature and ignored (the payload is 1 bit per element)."""
    if P <= 1:
        return 0.0
    return (P - 1 + _log2(P)) * alpha + (1 + (P - 1) / P) * N * beta


def ring_allreduce(P: int, N: int, b: float, alpha: float, beta: float) -> float:
    """Bandwidth-optimal ring allreduce of N b-bit words (fp32: b=32, bf16: b=16)."""
    if P <= 1:
        return 0.0
    return 2 * (P - 1) * alpha + 2 * (P - 1) / P * N * b * beta


def hierarchical_onebit(P: int, N: int, b: float, alpha: float, beta: float,
                        node_size: int = 1) -> float:
    """BinSGDM §4 on one flat network: intra-node reduce-scatter of b-bit words, a 1-bit
    compressed allreduce of N/m elements across P/m nodes, intra-node all-gather of 1-bit."""
    if P <= 1:
        return 0.0
    m, k = node_size, P // node_size
    t = onebit_allreduce(k, N / m, 1, alpha, beta)
    if m > 1:
        t += (m - 1) * alpha + (m - 1) / m * N * b * beta  # reduce-scatter
        t += (m - 1) * alpha + (m - 1) / m * N * beta      # all-gather of packed bits
    return t


def _planes(c: int) -> int:
    return max(1, int(c).bit_length())  # ceil(log2(c + 1)) bits hold a count in [0, c]


def ps_naive_packed(P: int, N: int, alpha: float, beta: float, aggregate: str = "vote") -> float:
    """Our ps_vote(topology="naive") on links limited at each rank: the server's ingress carries
    P-1 one-bit payloads, then its egress P-1 result payloads (1 bit for vote, ceil(log2(P+1))
    for avg). Table 1's 2PNb counts the server's own payload too."""
    if P <= 1:
        return 0.0
    back = 1 if aggregate == "vote" else _planes(P)
    return 2 * (P - 1) * alpha + (P - 1) * N * (1 + back) * beta


def ps_tree_packed(P: int, N: int, alpha: float, beta: float, aggregate: str = "vote") -> float:
    """Our ps_vote(topology="tree"): heap-ordered binary tree; a parent receives its children's
    partial counts (ceil(log2(s+1)) planes for a subtree of s ranks) concurrently on its ingress
    after the slower child finished, then the result flows down with each parent sending to its
    children concurrently on its egress. Critical path in the alpha-beta model."""
    if P <= 1:
        return 0.0
    back = 1 if aggregate == "vote" else _planes(P)

    def size(r: int) -> int:
        return 0 if r >= P else 1 + size(2 * r + 1) + size(2 * r + 2)

    def up(r: int) -> float:  # time until r holds its subtree's count
        kids = [c for c in (2 * r + 1, 2 * r + 2) if c < P]
        if not kids:
            return 0.0
        return max(up(c) for c in kids) + alpha + sum(_planes(size(c)) for c in kids) * N * beta

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


def predict(mode: str, P: int, N: int, alpha: float, beta: float, bits: int | None = None,
            node_size: int = 1, aggregate: str = "vote") -> float:
    """Predicted seconds for one call of a comm/ mode.

    mode: fp32 | bf16 (allreduce_mean: ring_allreduce), int_allreduce (direct_allreduce with
    b = lane width `bits`, default 4), sign_vote_1bit (onebit_allreduce), ps_naive / ps_tree
    (ps_vote with `aggregate`: the packed-payload models of our implementation above, since
    Table 1's parameter-server rows assume b-bit words and a perfectly pipelined tree),
    hierarchical (hierarchical_onebit with `node_size`)."""
    if mode == "fp32":
        return ring_allreduce(P, N, 32, alpha, beta)
    if mode == "bf16":
        return ring_allreduce(P, N, 16, alpha, beta)
    if mode == "int_allreduce":
        return direct_allreduce(P, N, 4 if bits is None else bits, alpha, beta)
    if mode == "sign_vote_1bit":
        return onebit_allreduce(P, N, 1, alpha, beta)
    if mode == "ps_naive":
        return ps_naive_packed(P, N, alpha, beta, aggregate)
    if mode == "ps_tree":
        return ps_tree_packed(P, N, alpha, beta, aggregate)
    if mode == "hierarchical":
        return hierarchical_onebit(P, N, 32, alpha, beta, node_size)
    raise ValueError(f"predict: unknown mode {mode!r}; valid: fp32, bf16, int_allreduce, "
                     f"sign_vote_1bit, ps_naive, ps_tree, hierarchical")


def fit_alpha_beta(P: int, sizes_bytes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit (relative error) of t = 2(P-1) alpha + 2(P-1)/P * 8*bytes * beta, the
    ring allreduce; negative estimates (noise at tiny sizes) are clamped to 0."""
    if P <= 1:
        return 0.0, 0.0
    A = torch.tensor([[2.0 * (P - 1), 2.0 * (P - 1) / P * 8 * s] for s in sizes_bytes],
                     dtype=torch.float64)
    t = torch.tensor(list(seconds), dtype=torch.float64).unsqueeze(1)
    # relative residuals: sizes span decades, and absolute least squares would let the largest
    # message decide alpha on its own
    w = 1.0 / t.clamp_min(1e-9)
    sol = torch.linalg.lstsq(A * w, t * w).solution.squeeze(1)
    return max(float(sol[0]), 0.0), max(float(sol[1]), 0.0)


def calibrate(group=None, sizes: Sequence[int] = (1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 24),
              repeats: int = 5, verbose: bool = False) -> tuple[float, float]:
    """Measure (alpha [s], beta [s/bit]) on the live group: fp32 SUM allreduce of each byte size
    in `sizes`, median of `repeats` timed calls after a warm-up, fitted by fit_alpha_beta.

    Collective: every rank of the group must call it; all ranks return rank 0's fit. A world of
    one rank returns (0.0, 0.0). verbose=True prints measured vs model per size on rank 0."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0.0, 0.0
    P = dist.get_world_size(group)
    medians = []
    for size in sizes:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32)
        dist.all_reduce(buf, group=group)  # warm-up: connection set-up and allocation
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            times.append(time.perf_counter() - t0)
        medians.append(sorted(times)[len(times) // 2])
    alpha, beta = fit_alpha_beta(P, [max(1, s // 4) * 4 for s in sizes], medians)
    ab = torch.tensor([alpha, beta], dtype=torch.float64)
    dist.broadcast(ab, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    alpha, beta = float(ab[0]), float(ab[1])
    if verbose and dist.get_rank(group) == 0:
        print(f"calibrate: P={P} alpha={alpha * 1e6:.1f} us beta={beta * 1e9:.4f} ns/bit "
              f"({1 / beta / 1e9 if beta else float('inf'):.2f} Gbit/s)")
        for size, t in zip(sizes, medians):
            model = ring_allreduce(P, max(1, size // 4), 32, alpha, beta)
            print(f"  {size:>10d} B  measured {t * 1e3:9.3f} ms  model {model * 1e3:9.3f} ms")
    return alpha, beta


def main() -> None:
    """torchrun --standalone --nproc_per_node=4 -m comm.cost_model: calibrate and print the fit
    and the Table 1 predictions for N = 25M at the calibrated alpha, beta."""
    dist.init_process_group("gloo")
    P = dist.get_world_size()
    alpha, beta = calibrate(verbose=True)
    if dist.get_rank() == 0:
        N = 25_000_000
        for mode in ("fp32", "bf16", "int_allreduce", "sign_vote_1bit", "ps_naive", "ps_tree"):
            print(f"  predict {mode:15s} N={N}: {predict(mode, P, N, alpha, beta) * 1e3:9.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
