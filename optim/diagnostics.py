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

import torch

import comm

_SIGN_NAMES = {1: "pos", 0: "zero", -1: "neg"}
HIST_SAMPLES = 8192


def _fractions(flag: torch.Tensor, ranges: dict[str, tuple[int, int]], key: str, out: dict[str, float]) -> None:
    flag = flag.to(torch.float64)
    out[key] = float(flag.mean()) if flag.numel() else 0.0
    for role, (a, b) in ranges.items():
        out[f"{key}/{role}"] = float(flag[a:b].mean()) if b > a else 0.0


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
                                           stats=stats))
    applied = torch.sign(update.to(torch.float32))
    _fractions(exact == applied, role_ranges, "diag/sign_match", out)
    _fractions(exact * applied < 0, role_ranges, "diag/sign_flip", out)

    # sum of signs as an exact integer sum (a float mean could blur a tie)
    bits = 8 if 2 * world_size <= 255 else 16
    vote_sum = comm.int_allreduce(torch.sign(c_flat).to(torch.int8), 1, bits, group=group, stats=stats)
    _fractions(vote_sum == 0, role_ranges, "diag/tie_rate", out)
    vote = torch.sign(vote_sum).to(torch.float32)
    for e, en in _SIGN_NAMES.items():
        for v, vn in _SIGN_NAMES.items():
            out[f"diag/vote_table/exact_{en}_vote_{vn}"] = float(((exact == e) & (vote == v)).to(torch.float64).mean())

    m = torch.cat([x.reshape(-1).to(torch.float64) for x in momenta])
    moments = _sum_fp64(torch.cat([m, m * m]), world_size, group, stats) / world_size
    mean, mean_sq = moments[:m.numel()], moments[m.numel():]
    std = (mean_sq - mean * mean).clamp_min(0).sqrt()
    out["diag/momentum_spread"] = float(std.max()) if std.numel() else 0.0
    for role, (a, b) in role_ranges.items():
        out[f"diag/momentum_spread/{role}"] = float(std[a:b].max()) if b > a else 0.0

    hists = {}
    for role, (a, b) in role_ranges.items():
        seg = c_flat[a:b]
        stride = max(1, -(-seg.numel() // HIST_SAMPLES))
        hists[f"c_local/{role}"] = seg[::stride].detach().to(torch.float32).cpu()
    return out, hists
