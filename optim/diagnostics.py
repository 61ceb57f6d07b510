"""Diagnostics of update-sync Lion against exact (global) Lion, computed on demand.

All keys are fractions in [0, 1] (not percent), overall and per role ("diag/<name>/<role>"):
- diag/sign_match: sign(applied update) == sign(mean_i c_i), exact Lion's direction; both 0 counts
  as a match (Lion Cub Fig. 4).
- diag/sign_flip: the two signs are opposite; elements that either side maps to 0 are excluded
  from the numerator (not a flip), the denominator is all elements (Fig. 4).
- diag/tie_rate: fraction of elements whose sum over ranks of sign(c_i) is 0 (Table 3).
- diag/vote_table/exact_<e>_vote_<v>, e, v in {pos, zero, neg}: the 3x3 table of exact Lion's sign
  against the plain majority vote sign(sum_i sign(c_i)); the nine entries sum to 1.
- diag/momentum_spread: max over elements of the std across ranks (population, ddof 0) of the
  momentum, from allreduced means of m and m^2 in fp64 (Lion Cub Fig. 6, 17); identical momenta
  give exactly 0.
Histograms (Fig. 3): `c_local/<role>` holds up to 8192 evenly strided values of this rank's c_local
(fp32, CPU), for wandb.Histogram. Collectives go to `stats` (the optimizer's diag_stats) so the
trainer can book their bytes apart from the step's.
"""
from __future__ import annotations

import math

import torch

import comm

HIST_SAMPLES = 8192


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


@torch.no_grad()
def update_sync_diagnostics(c_flat: torch.Tensor, update: torch.Tensor, momenta: list[torch.Tensor],
                            role_ranges: dict[str, tuple[int, int]], *, world_size: int, group=None,
                            stats: "comm.CommStats | None" = None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Compare the applied `update` with exact Lion; `momenta` in the same order as the flat layout."""
    out: dict[str, float] = {}
    exact = torch.sign(comm.allreduce_mean(c_flat.to(torch.float32), wire_dtype=torch.float32, group=group,
                                           stats=stats)).to(torch.int8)
    applied = torch.sign(update).to(torch.int8)
    # sum of signs as an exact integer sum (a float mean could blur a tie)
    bits = 8 if 2 * world_size <= 255 else 16
    vote = torch.sign(comm.int_allreduce(torch.sign(c_flat).to(torch.int8), 1, bits, group=group,
                                         stats=stats)).to(torch.int8)
    # one pass per role: code = 9 (exact + 1) + 3 (applied + 1) + (vote + 1) in 0..26, counted by
    # bincount (uint8 bincount is ~10x faster than summing boolean masks)
    code = (exact + 1).mul_(9).add_((applied + 1).mul_(3)).add_(vote + 1).view(torch.uint8)
    hists_by_role = {role: torch.bincount(code[a:b], minlength=27).view(3, 3, 3).to(torch.float64)
                     for role, (a, b) in role_ranges.items()}
    names = ("neg", "zero", "pos")
    for role, h in [("", sum(hists_by_role.values()))] + [("/" + r, h) for r, h in hists_by_role.items()]:
        total = float(h.sum()) or 1.0
        out["diag/sign_match" + role] = float(h.diagonal(dim1=0, dim2=1).sum()) / total  # exact == applied
        out["diag/sign_flip" + role] = float(h[0, 2].sum() + h[2, 0].sum()) / total       # opposite signs
        out["diag/tie_rate" + role] = float(h[:, :, 1].sum()) / total                     # sum of signs == 0
        if role == "":
            table = h.sum(dim=1)  # (exact, vote)
            for e in range(3):
                for v in range(3):
                    out[f"diag/vote_table/exact_{names[e]}_vote_{names[v]}"] = float(table[e, v]) / total

    n = c_flat.numel()
    buf = torch.empty(2 * n, dtype=torch.float64, device=c_flat.device)
    torch.cat([x.reshape(-1) for x in momenta], out=buf[:n])
    torch.mul(buf[:n], buf[:n], out=buf[n:])
    moments = _sum_fp64(buf, world_size, group, stats).div_(world_size)
    mean, var = moments[:n], moments[n:]
    var.sub_(mean * mean).clamp_min_(0)  # E[m^2] - E[m]^2; the max of sqrt is sqrt of the max
    out["diag/momentum_spread"] = math.sqrt(float(var.max())) if n else 0.0
    for role, (a, b) in role_ranges.items():
        out[f"diag/momentum_spread/{role}"] = math.sqrt(float(var[a:b].max())) if b > a else 0.0

    hists = {}
    for role, (a, b) in role_ranges.items():
        seg = c_flat[a:b]
        stride = max(1, -(-seg.numel() // HIST_SAMPLES))
        hists[f"c_local/{role}"] = seg[::stride].detach().to(torch.float32).cpu()
    return out, hists
