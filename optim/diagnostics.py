"""Diagnostics of update-sync optimizers against exact (global) Lion, computed on demand.

All values are fractions in [0, 1] (not percent). Each metric is reported overall
("diag/<metric>"), per role ("diag/<metric>/<role>": embedding, head, attn, mlp, norm; embedding
and head apart whenever they are untied), per parameter tensor ("diag/<metric>/tensor/<name>") and
per transformer block ("diag/<metric>/block/<i>"), so Lion Cub Fig. 6 / 17 can be drawn per layer.

- sign_match: sign(applied update) == sign(mean_i c_i), exact Lion's direction; both 0 counts as
  a match (Lion Cub Fig. 4).
- sign_flip: the two signs are opposite (+1 vs -1). Denominator: ALL elements of the tensor /
  role / model, including those either side maps to 0 (which are never counted as flips). Lion Cub
  Fig. 4's "excludes elements mapped to 0" is about the numerator; dividing by all elements makes
  sign_match + sign_flip + (elements where exactly one side is 0) = 1.
- tie_rate: fraction of elements whose sum over ranks of sign(c_i) is 0 (Table 3).
- vote_table/exact_<e>_vote_<v>, e, v in {neg, zero, pos}: the 3x3 table of exact Lion's sign
  against the plain majority vote sign(sum_i sign(c_i)); the nine entries sum to 1. Overall and per
  role ("diag/vote_table/<role>/exact_<e>_vote_<v>"), not per block or tensor: a model whose
  embedding dominates the element count needs the attn / mlp tables to compare with Table 3.
- momentum_spread: max over elements of the std across ranks (population, ddof 0) of the
  momentum, from allreduced sums of m and m^2 in fp64 (Lion Cub Fig. 6, 17); identical momenta
  give exactly 0. The optimizer base measures it after the step's momentum update and BEFORE a
  momentum sync of the same step; on a sync step it also reports
  "diag/momentum_spread_after_sync/..." (0 for the synced layers).
Histograms (Fig. 3): `c_local/<role>` holds up to 8192 evenly strided values of this rank's
c_local (fp32, CPU). Collectives are booked in the `stats` passed in (the optimizer's "diag"
phase), apart from the step's communication.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

import comm

HIST_SAMPLES = 8192
NAMES = ("neg", "zero", "pos")


def _sum_fp64(buf: torch.Tensor, world_size: int, group, stats: "comm.CommStats") -> torch.Tensor:
    """SUM-allreduce in fp64, booked in `stats`. comm.allreduce_mean only ships fp32/bf16, and fp32
    sums of m and m^2 would leave a rounding residue where all ranks agree (spread must be 0 there):
    in fp64 the sums of P <= 32 fp32 momenta and their squares are exact."""
    device = buf.device if buf.is_cuda else None
    with stats.call("momentum_moments[float64]", device) as timer:
        if world_size > 1:
            with timer.coll(sent=buf, recv=buf):
                torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.SUM, group=group)
    return buf


def _block_key(layer: str) -> str | None:
    """'block.3' -> 'block/3'; entries outside the transformer blocks have no block key."""
    return "block/" + layer.split(".", 1)[1] if layer.startswith("block.") else None


def _aggregate(per_entry: list[Any], entries: Sequence, combine) -> list[tuple[str, Any]]:
    """(suffix, combined value) overall, per role, per block and per tensor."""
    groups: dict[str, list] = {"": []}
    for e, v in zip(entries, per_entry):
        groups[""].append(v)
        groups.setdefault("/" + e.role, []).append(v)
        bk = _block_key(e.layer)
        if bk:
            groups.setdefault("/" + bk, []).append(v)
    out = [(k, combine(vs)) for k, vs in groups.items() if vs]
    out += [("/tensor/" + e.name, v) for e, v in zip(entries, per_entry)]
    return out


@torch.no_grad()
def vote_diagnostics(c_flat: torch.Tensor, update: torch.Tensor, layout, *, world_size: int, group=None,
                     stats: "comm.CommStats | None" = None,
                     shard_group=None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Compare the applied `update` (flat, role order) with exact Lion and the plain vote. With
    hybrid sharding (`shard_group`: the ranks holding the other shards; `group` the replicas) the
    per-tensor counts are summed over the shard group, so every rank reports the numbers of the
    whole tensors; the histograms sample this rank's shards."""
    stats = comm.CommStats() if stats is None else stats
    exact = torch.sign(comm.allreduce_mean(c_flat.to(torch.float32), wire_dtype=torch.float32, group=group,
                                           stats=stats)).to(torch.int8)
    applied = torch.sign(update).to(torch.int8)
    # sum of signs as an exact integer sum (a float mean could blur a tie)
    bits = 8 if 2 * world_size <= 255 else 16
    vote = torch.sign(comm.int_allreduce(torch.sign(c_flat).to(torch.int8), 1, bits, group=group,
                                         stats=stats)).to(torch.int8)
    # code = 9 (exact + 1) + 3 (applied + 1) + (vote + 1) in 0..26, counted per tensor by bincount
    # (uint8 bincount is ~10x faster than summing boolean masks)
    code = (exact + 1).mul_(9).add_((applied + 1).mul_(3)).add_(vote + 1).view(torch.uint8)
    entries = layout.entries
    hists = torch.stack([torch.bincount(code[e.offset:e.offset + e.numel], minlength=27)
                         for e in entries]).to(torch.float64)
    if shard_group is not None:
        _sum_fp64(hists, 2, shard_group, stats)  # exact: counts below 2^53
    hists = hists.view(-1, 3, 3, 3).cpu()
    out: dict[str, float] = {}
    for suffix, h in _aggregate(list(hists), entries, lambda hs: sum(hs)):
        total = float(h.sum()) or 1.0
        out["diag/sign_match" + suffix] = float(h.diagonal(dim1=0, dim2=1).sum()) / total  # exact == applied
        out["diag/sign_flip" + suffix] = float(h[0, 2].sum() + h[2, 0].sum()) / total       # opposite signs
        out["diag/tie_rate" + suffix] = float(h[:, :, 1].sum()) / total                     # sum of signs == 0
        if suffix == "" or suffix[1:] in layout.by_role:  # overall and per role (not per block / tensor)
            table = h.sum(dim=1)  # (exact, vote)
            for e in range(3):
                for v in range(3):
                    out[f"diag/vote_table{suffix}/exact_{NAMES[e]}_vote_{NAMES[v]}"] = float(table[e, v]) / total
    histograms = {}
    for role, entries in layout.by_role.items():
        seg = torch.cat([c_flat[e.offset:e.offset + e.numel] for e in entries]) if len(entries) > 1 else \
            c_flat[entries[0].offset:entries[0].offset + entries[0].numel]
        stride = max(1, comm.ceil_div(seg.numel(), HIST_SAMPLES))
        histograms[f"c_local/{role}"] = seg[::stride].detach().to(torch.float32).cpu()
    return out, histograms


@torch.no_grad()
def momentum_spread(momenta: list[tuple[Any, torch.Tensor]], *, world_size: int, group=None,
                    stats: "comm.CommStats | None" = None, prefix: str = "diag/momentum_spread",
                    shard_group=None) -> dict[str, float]:
    """Max over elements of the std across ranks of the momentum, overall, per role, per block and
    per tensor. `momenta` are (layout entry, momentum tensor) pairs; every rank passes the same
    entries in the same order (one fp64 SUM allreduce of [m, m^2]). With hybrid sharding the
    momenta are shards, `group` the replicas, and the per-tensor maxima are maxed over `shard_group`."""
    stats = comm.CommStats() if stats is None else stats
    if not momenta:
        return {}
    n = sum(m.numel() for _, m in momenta)
    buf = torch.empty(2 * n, dtype=torch.float64, device=momenta[0][1].device)
    torch.cat([m.reshape(-1) for _, m in momenta], out=buf[:n])
    torch.mul(buf[:n], buf[:n], out=buf[n:])
    moments = _sum_fp64(buf, world_size, group, stats).div_(world_size)
    mean, var = moments[:n], moments[n:]
    var.sub_(mean * mean).clamp_min_(0)  # E[m^2] - E[m]^2; the max of sqrt is sqrt of the max
    maxima, off = [], 0
    for _, m in momenta:
        k = m.numel()
        maxima.append(var[off:off + k].max() if k else var.new_zeros(()))
        off += k
    maxima = torch.stack(maxima)
    if shard_group is not None:
        device = maxima.device if maxima.is_cuda else None
        with stats.call("momentum_spread_max", device) as timer:
            with timer.coll(sent=maxima, recv=maxima):
                torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX, group=shard_group)
    per_entry = maxima.cpu().tolist()
    return {prefix + suffix: math.sqrt(v) for suffix, v in
            _aggregate(per_entry, [e for e, _ in momenta], max)}
