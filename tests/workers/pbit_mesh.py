"""pbit's Lp scale on the hybrid-sharding mesh (launched by tests/optim/test_pbit_mesh.py): the votes of
the p-bit exchange with every norm quantizer at parallel.shard_size S equal S = 1's on the same
per-replica inputs.

The world is R = P * S gloo ranks, P = 2 replicas. Every replica i has a local update c_i of five
tensors (an embedding-like one whose rows differ in magnitude by orders, a plain matrix, rows that S
does not divide, a 3-element vector that leaves a shard empty at S = 4, exact zeros); a rank holds
FSDP2's dim-0 chunk of each (torch.chunk: ceil(rows / S) rows, the last ones shorter or empty),
builds Distributed Lion on pbit as build_optimizer does on the mesh (group = the replicate group,
shard_group = the shard group) and calls its exchange on its shards. The reference is a
single-process simulation of the P replicas on whole tensors: comm.kernels.quantize_q per replica
(each tensor its own M_p, eq. 1), the sum over replicas, its sign.

- votes_equal_unsharded: the votes of every rank's rows equal the reference's, except where some
  replica's scaled value y = L x / (clip M_p) lies within VOTE_RTOL |y| of a rounding midpoint
  (none differed in these inputs; the counts are printed); with L_inf bit for bit;
- whole_tensor_means: comm.quantize.sharded_lp_means on the shards equals segment_lp_means of the
  whole tensors within MEAN_RTOL (p = inf exactly).

argv: S. Nearest rounding only: stochastic rounding draws its uniforms along the local vector, so
its draws differ with the layout by design.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from comm import kernels  # noqa: E402
from comm.quantize import segment_lp_means  # noqa: E402
from optim.registry import build_optimizer  # noqa: E402
from optim.sync.pbit import effective_levels  # noqa: E402
from trainer import parallel  # noqa: E402

REPLICAS = 2
BITS, CLIP = 8, 2.0
SHAPES = {"emb": (50, 16), "w": (33, 24), "bias": (7,), "norm": (3,), "head": (20, 12)}
# quantizer options -> p
QUANTIZERS = {"l1": ({"quantizer": "l1"}, 1.0), "l2": ({"quantizer": "l2"}, 2.0),
              "linf": ({"quantizer": "linf"}, math.inf), "l0": ({"quantizer": "l0"}, 0.0),
              "lp0.5": ({"quantizer": "lp", "p": 0.5}, 0.5), "lp3": ({"quantizer": "lp", "p": 3.0}, 3.0)}
MEAN_RTOL = 2e-6
"""|M_p(S) - M_p(1)| / M_p(1): the whole tensor's M_p from the shards' fp32 partials (combined in
float64) against one fp32 reduction of the whole tensor, each within about (log2(d) + 2) u of the
exact value (pairwise summation of |x|^p >= 0 and a few correctly rounded ops; d <= 800, u = 2^-24:
at most ~1.4e-6 apart); measured here 1.9e-7 (S = 2) and 3.8e-7 (S = 4). p = inf: a max of maxima,
exact."""
VOTE_RTOL = MEAN_RTOL + 2 * torch.finfo(torch.float32).eps
"""A vote may differ only where a replica's y = L x / (clip M_p) is within VOTE_RTOL |y| of a
midpoint k + 1/2 (y scales with 1 / M_p; the multiplication rounds once more)."""


def inputs(replica: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + replica)
    out = {}
    for name, shape in SHAPES.items():
        x = torch.randn(shape, generator=g)
        if name == "emb":  # per-row magnitudes spread over orders (rare and frequent tokens)
            x *= torch.exp(2.0 * torch.randn(shape[0], 1, generator=g))
        if name == "head":  # rows never seen: exactly zero (L0 counts nonzeros only)
            x[::3] = 0.0
        x[torch.rand(shape, generator=g) < 0.05] = 0.0
        out[name] = x
    return out


def local_chunk(x: torch.Tensor, S: int, index: int) -> torch.Tensor:
    """FSDP2's Shard(0) local tensor: torch.chunk's piece `index`, empty past the last piece."""
    pieces = torch.chunk(x, S, dim=0)
    return pieces[index] if index < len(pieces) else x.new_empty((0, *x.shape[1:]))


def reference_votes(p: float, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sign of the sum over replicas of quantize_q on whole tensors, where a vote may flip)."""
    total, fragile = None, None
    segs, off = [], 0
    for shape in SHAPES.values():
        n = math.prod(shape)
        segs.append((off, n))
        off += n
    for i in range(REPLICAS):
        c = torch.cat([t.reshape(-1) for t in inputs(i).values()])
        q = kernels.quantize_q(c, segs, levels, p, CLIP).to(torch.int32)
        means = segment_lp_means(c, segs, p).double()
        y = torch.cat([c[o:o + n].double() * (levels / (CLIP * float(means[k]))) if float(means[k]) > 0
                       else torch.zeros(n, dtype=torch.float64) for k, (o, n) in enumerate(segs)])
        near = ((y.abs() - y.abs().floor()) - 0.5).abs() <= VOTE_RTOL * y.abs()
        total = q if total is None else total + q
        fragile = near if fragile is None else fragile | near
    return total.sign().to(torch.int8), fragile


def whole_offsets() -> dict[str, int]:
    out, off = {}, 0
    for name, shape in SHAPES.items():
        out[name] = off
        off += math.prod(shape)
    return out


CHECKS = ("votes_equal_unsharded", "whole_tensor_means")


def main(checks) -> None:
    S = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == REPLICAS * S, f"launch {REPLICAS * S} ranks for S={S}"
    par = parallel.make_mesh(S, world, torch.device("cpu"))
    replica, shard = rank // S, rank % S
    full = inputs(replica)
    local = {n: local_chunk(t, S, shard) for n, t in full.items()}
    params = [torch.nn.Parameter(t.clone()) for t in local.values()]
    c = torch.cat([t.reshape(-1) for t in local.values()])
    # which elements of the whole vector this rank holds, in its local order
    offs = whole_offsets()
    index = torch.cat([offs[n] + torch.arange(math.prod(full[n].shape)).view(full[n].shape).chunk(S, 0)[shard]
                       .reshape(-1) if shard < len(torch.chunk(full[n], S, 0)) else torch.zeros(0, dtype=torch.int64)
                       for n in SHAPES])
    levels = effective_levels(BITS, REPLICAS)

    checks.begin("votes_equal_unsharded")
    fragile_total, report = 0, []
    for q, (opts, p) in QUANTIZERS.items():
        groups = [{"params": params, "names": list(SHAPES), "role": "mlp", "lr": 0.01, "weight_decay": 0.0,
                   "lr_mult": 1.0}]
        opt = build_optimizer("lion", groups, comm_mode="pbit", comm_options={"bits": BITS, "clip": CLIP, **opts},
                              group=par.replicate_group, shard_group=par.shard_group, param_order=params)
        assert opt.layout.segments == [(int(o), int(n)) for o, n in
                                       zip(torch.tensor([0] + [t.numel() for t in local.values()]).cumsum(0)[:-1],
                                           [t.numel() for t in local.values()])], opt.layout.segments
        got = opt.exchange(c.clone(), 1)
        want, fragile = reference_votes(p, levels)
        want, fragile = want[index], fragile[index]
        bad = got != want
        if math.isinf(p):  # a max of maxima is exact: the same M_p, the same votes, bit for bit
            fragile = torch.zeros_like(fragile)
        fragile_total += int(fragile.sum())
        assert not bool((bad & ~fragile).any()), \
            f"S={S} quantizer {q}: votes differ from the unsharded run at {int(bad.sum())} of {bad.numel()} elements " \
            f"of rank {rank} ({int((bad & ~fragile).sum())} away from a rounding midpoint)"
        report.append(int(bad.sum()))
    flips = [None] * world
    dist.all_gather_object(flips, (fragile_total, report))

    checks.begin("whole_tensor_means")
    from comm.quantize import sharded_lp_means
    whole = [(o, math.prod(s)) for o, s in zip(offs.values(), SHAPES.values())]
    local_segs = opt.layout.segments
    cw = torch.cat([t.reshape(-1) for t in full.values()])
    worst = 0.0
    for q, (_, p) in QUANTIZERS.items():
        got = sharded_lp_means(c, local_segs, p, par.shard_group)
        want = segment_lp_means(cw, whole, p)
        assert got.dtype == want.dtype == torch.float32
        if math.isinf(p):
            assert torch.equal(got, want), (q, got, want)
        rel = float(((got.double() - want.double()).abs() / want.double().clamp_min(1e-30)).max())
        assert rel <= MEAN_RTOL, f"S={S} {q}: whole-tensor M_p from the shards off by {rel:.3g} relative > {MEAN_RTOL}"
        worst = max(worst, rel)
    worsts = [None] * world
    dist.all_gather_object(worsts, worst)
    if rank == 0:
        print(f"pbit_mesh S={S} P={REPLICAS}: votes equal to S=1 for {', '.join(QUANTIZERS)} "
              f"(votes that differ, all ranks: {sum(sum(r) for _, r in flips)}; elements within VOTE_RTOL of a "
              f"midpoint: {sum(f for f, _ in flips)}); whole-tensor M_p max rel diff "
              f"{max(worsts):.3g}", flush=True)
    checks.end()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _checks import Checks  # tests/workers/ is the script's directory
    checks = Checks(CHECKS)
    checks.guard(main, checks)
