"""The matrix optimizers on the hybrid-sharding mesh (launched by tests/optim/test_mesh_optim.py), 4 gloo
ranks, a stack of nn.Linear layers of shapes m > n, m < n, m = n and row counts that S does not divide
(33 rows: 17 + 16 at S = 2, 9 + 9 + 9 + 6 at S = 4), `fully_shard`ed over the shard axis as
trainer/parallel.py does, each parameter on the dimension its optimizer declares (optim.shard_dims:
Muon dim 0; Dion the side of Q: dim 1 of the tall and square weights, dim 0 of the wide ones and of
the (64, 33) one, whose 33 columns FSDP2 cannot split evenly), a few steps:

- the run at parallel.shard_size S equals the replicated run (S = 1, the world as the optimizer's
  group) on the same per-rank data within TOL after STEPS steps;
- every replica holds bit-identical parameters after every step;
- the bytes each rank sends on the shard axis (the optimizer's shard_stats) and on the replicate
  axis (its CommStats phases) equal the formulas in the optimizers' docstrings, counted from the
  collectives.

argv: optimizer name, S[, Dion's rank fraction (0.7: three matrices where (m + n) r >= m n, whose
gradients are synced instead of their factors, and one low-rank)[, Dion's optim.transpose_wide (true /
false)]]. Each step is a named check
(CHECKS; tests/workers/_checks.py records its outcome).
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from optim.registry import build_optimizer, shard_dims  # noqa: E402
from trainer import parallel  # noqa: E402

STEPS = 4
TOL = 2e-5
"""Max |difference| of any parameter after STEPS steps at lr 0.02 between runs that differ in the fp32
reduction order of the gradient mean (FSDP's reduce-scatter in the shard group, then the mean across
replicas, instead of one allreduce) and, for Dion, of B Q and B^T P (row blocks summed over the
shard group): about 1e-7 relative per step, amplified by the orthonormalisation; a wrong row
block or owner moves a parameter by lr * scale ~ 1e-2, 500x this."""
DIMS = [(24, 40), (40, 33), (33, 64), (64, 24), (24, 24)]
"""(in, out) of each layer: weights (40, 24), (33, 40), (64, 33), (24, 64), (24, 24). With these shapes
and data the replicated run in fp32 stays within 1e-5 of itself in fp64 at both ranks (a shape whose
r-th and (r+1)-th singular values nearly coincide, e.g. a last layer (20, 20) at rank 0.7, moves its
rank-r subspace by 1e-4 on fp32 rounding alone, whatever the mesh)."""
DIAG_RTOL = 1e-3
"""Dion's residual diagnostics come from ||B||^2 - 2 <B^T P, R> + ||R||^2 (float64 sums of fp32
products): relative 1e-3 where they are large (~0.5 of ||B|| at rank 1/4), plus DIAG_FLOOR ||B||, the
formula's resolution sqrt(max(m, n) u) ~ 1e-3 (dion.Dion._diagnostics), where they are small."""
DIAG_FLOOR = 3e-3


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.h = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in DIMS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.h:
            x = torch.tanh(layer(x))
        return x


def groups(model: torch.nn.Module, aliases: dict | None = None) -> list[dict]:
    named = list(model.named_parameters())
    pick = (lambda p: aliases[id(p)]) if aliases else (lambda p: p)
    return [{"params": [pick(p) for _, p in named], "names": [n for n, _ in named], "role": "mlp", "lr": 0.02,
             "weight_decay": 0.01, "lr_mult": 1.0}]


DTYPE = torch.float32


def build(name: str, S: int, options: dict, world: int, model: torch.nn.Module | None = None):
    model = model if model is not None else Stack().to(DTYPE)
    par = parallel.make_mesh(S, world, torch.device("cpu"))
    if par.sharded:
        from torch.distributed.fsdp import fully_shard

        from torch.distributed.tensor import Shard

        if not hasattr(model, "reshard"):  # not yet sharded
            dims = shard_dims(name, options, groups(model), S)
            for m in (*model.h, model):
                fully_shard(m, mesh=par.shard_mesh, shard_placement_fn=lambda p: Shard(dims[id(p)]))
        aliases = parallel.local_aliases(model)
        opt = build_optimizer(name, groups(model, aliases), comm_mode="fp32", optim_options=options,
                              group=par.replicate_group, shard_group=par.shard_group,
                              param_order=[aliases[id(p)] for p in model.parameters()],
                              shard_dims=parallel.local_dims(model, aliases))
        parallel.route_grads(model, aliases)
    else:
        opt = build_optimizer(name, groups(model), comm_mode="fp32", optim_options=options,
                              param_order=list(model.parameters()))
    return model, opt, par


def whole(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a row block `t` of parameter p (a DTensor when sharded)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return t.detach().clone()
    return DTensor.from_local(t.detach(), device_mesh=p.device_mesh, placements=p.placements, run_check=False,
                              shape=p.shape, stride=p.stride()).full_tensor().detach()


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [whole(p.to_local() if hasattr(p, "to_local") else p, p) for p in model.parameters()]


def train(name: str, model, opt, gen: torch.Generator, steps: int, world: int, diagnose_last: bool = False):
    """`steps` steps; returns (bytes sent per axis in the last step, the last step's diagnostics,
    the expected Dion residuals {name: (res^2, ||B||^2) of this rank's B} of the last step)."""
    entries = {e.name: e for e in opt.layout.entries}
    named = dict(model.named_parameters())
    expected = {}
    for k in range(steps):
        opt.zero_grad()
        x = torch.randn(8, DIMS[0][0], generator=gen, dtype=DTYPE)
        model(x).square().mean().backward()
        diag = diagnose_last and k == steps - 1
        if diag and name == "dion":  # B = M + G per matrix, this rank's (its replica's), before the step
            pre = {n: whole(opt.state[e.param]["momentum"], named[n]) if e.param in opt.state else None
                   for n, e in entries.items() if e.param.ndim == 2}
        before = opt.shard_stats.totals()["bytes_sent"]
        rep_before = sum(opt.stats[ph].totals()["bytes_sent"] for ph in ("grad_sync", "update_sync"))
        report = opt.step(diagnose=diag)
        sent = (opt.shard_stats.totals()["bytes_sent"] - before,
                sum(opt.stats[ph].totals()["bytes_sent"] for ph in ("grad_sync", "update_sync")) - rep_before)
        h = hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in full_params(model))).hexdigest()
        got = [None] * world
        dist.all_gather_object(got, h)
        assert len(set(got)) == 1, f"{name}: ranks differ after a step: {got}"
        if diag and name == "dion":  # P R^T = (B - M_after) / (1 - mu): the residual B - P R^T exactly
            mu = opt.options.mu
            for n, M in pre.items():
                # B = M + G with G as step() used it: the replicas' mean where the gradient is synced
                # (matrices with (m + n) r >= m n), this rank's otherwise (no clipping here)
                G = whole(entries[n].param.grad, named[n])
                B = G if M is None else M + G
                after = whole(opt.state[entries[n].param]["momentum"], named[n])
                res = B - (B - after) / (1.0 - mu)
                expected[n] = (float(res.double().square().sum()), float(B.double().square().sum()))
    return sent, report.diagnostics, expected


def check_diagnostics(name: str, diag: dict, expected: dict, world: int, label: str) -> None:
    if name != "dion":
        return
    every = [None] * world
    dist.all_gather_object(every, expected)  # the mean over ranks = the mean over replicas
    for n in expected:
        res = sum(e[n][0] for e in every) / world
        b = sum(e[n][1] for e in every) / world
        got_res, got_rel = diag[f"diag/dion_residual/tensor/{n}"], diag[f"diag/dion_rel_error/tensor/{n}"]
        want_res, want_rel = res ** 0.5, (res / b) ** 0.5
        floor = DIAG_FLOOR * b ** 0.5  # the cheap formula's resolution, in units of ||B||
        assert abs(got_res - want_res) <= DIAG_RTOL * want_res + floor and \
            abs(got_rel - want_rel) <= DIAG_RTOL * want_rel + DIAG_FLOOR, \
            f"{label} {n}: residual {got_res:.6g} / rel {got_rel:.6g}, formed explicitly {want_res:.6g} / {want_rel:.6g}"


def table1(opt, S: int, shard_index: int) -> tuple[int, int, int]:
    """Bytes per step from the papers' formulas and the shapes alone (not the optimizer's own
    formula), and the part of them above Dion Table 1's row. Dion: per matrix whose Q side FSDP2
    can shard, Table 1's (m + 1) r on the shard axis with m <= n the shorter side, plus (m' - m) r
    where P lies on the longer side m' (the partial P summed there has m' rows: by default a wide
    matrix runs on its transpose, so P is on the longer side of every non-square matrix; with
    optim.transpose_wide=false on fan_out, the shorter side of the wide ones), and across replicas
    P whole and this rank's rows of R; where it cannot (a tall or square matrix whose fan_in S does
    not divide), the all-gathered P (ceil(m / S) r) and the summed R (n r); per rank (every rank
    sends the same). Muon: 2 (S - 1) ceil(m / S) n words summed over the shard group. Plus the
    mean-allreduce of the local flat gradient (Muon) or of the non-matrix gradients (Dion) across
    replicas. Returns (shard-axis bytes, replicate-axis bytes, shard-axis bytes above Table 1)."""
    from optim.dion_math import dion_rank

    R = dist.get_world_size(opt.group) if opt.group is not None else 1
    W = DTYPE.itemsize  # fp32 words
    shard, rep, excess = 0, 0, 0
    muon = opt.options.__class__.__name__ == "MuonOptions"
    mats = [e for e in opt.layout.entries if e.param.ndim == 2]
    for (i, o), e in zip(DIMS, mats):
        m, n = o, i
        if muon:
            shard += 2 * (S - 1) * -(-m // S) * n * W
            continue
        r = dion_rank(m, n, rank_fraction=opt.options.rank_fraction)
        transposed = opt.options.transpose_wide and m < n  # P = B^T Q on fan_in
        p_side, q_side = (n, m) if transposed else (m, n)
        q_sharded = transposed or n % S == 0
        if q_sharded:
            c = -(-q_side // S)
            local_q = max(0, min(c, q_side - shard_index * c))
            shard += (min(m, n) + 1) * r * W  # Dion Table 1: (m + 1) r, m <= n
            excess += (p_side - min(m, n)) * r * W
            factors = p_side * r + local_q * r
        else:  # rows of P (m >= n) sharded, Q whole
            c = -(-m // S)
            local_p = max(0, min(c, m - shard_index * c))
            shard += (c + n) * r * W
            factors = local_p * r + n * r
        # replicas: P and R of a low-rank matrix, the local gradient of one that is not ((m + n) r >= m n)
        rep += (factors if (m + n) * r < m * n else e.param.numel()) * W * (R > 1)
    vec = sum(e.numel for e in opt.layout.entries if e.param.ndim == 1 or muon)
    rep += vec * W * (R > 1)
    return shard + excess, rep, excess


CHECKS = ("replicated_diagnostics", "equals_replicated", "sharded_diagnostics", "bytes", "resume", "placements")


def main(checks) -> None:
    name, S = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    options = {"rank_fraction": float(sys.argv[3]) if len(sys.argv) > 3 else 0.25} if name == "dion" else {}
    if name == "dion" and len(sys.argv) > 4:  # optim.transpose_wide
        options["transpose_wide"] = {"true": True, "false": False}[sys.argv[4]]

    checks.begin("replicated_diagnostics")
    model, opt, _ = build(name, 1, options, world)
    _, ref_diag, expected = train(name, model, opt, torch.Generator().manual_seed(100 + rank), STEPS, world, True)
    check_diagnostics(name, ref_diag, expected, world, "replicated")
    checks.begin("equals_replicated")
    ref = full_params(model)
    model, opt, par = build(name, S, options, world)
    gen = torch.Generator().manual_seed(100 + rank)
    (shard_bytes, rep_bytes), diag, expected = train(name, model, opt, gen, STEPS, world, True)
    got = full_params(model)
    err = max(float((a - b).abs().max()) for a, b in zip(ref, got))
    moved = max(float((a - b.detach().to(DTYPE)).abs().max()) for a, b in zip(ref, Stack().parameters()))
    assert err < TOL, f"{name} S={S}: max |S - replicated| = {err:.3g} >= {TOL}; per parameter " + \
        ", ".join(f"{n} {float((a - b).abs().max()):.2g}" for (n, _), a, b in zip(model.named_parameters(), ref, got))
    checks.begin("sharded_diagnostics")
    # diagnostics reduced over the shards: the whole matrices' values
    check_diagnostics(name, diag, expected, world, f"S={S}")
    if name == "muon":
        keys = [k for k in ref_diag if k.startswith("diag/muon_update_rms")]
        assert keys and all(abs(diag[k] - ref_diag[k]) <= 1e-5 * ref_diag[k] for k in keys), \
            {k: (diag[k], ref_diag[k]) for k in keys}
    checks.begin("bytes")
    # bytes counted from the collectives against the optimizer's formula and against the papers'
    assert (shard_bytes, rep_bytes) == opt.mesh_bytes_per_step(), \
        f"{name} S={S} rank {rank}: sent {shard_bytes} B shard, {rep_bytes} B replicate; formula {opt.mesh_bytes_per_step()}"
    group_shard = torch.tensor([shard_bytes])
    dist.all_reduce(group_shard, group=par.shard_group)
    want_shard, want_rep, excess = table1(opt, S, dist.get_rank(par.shard_group))
    if name == "dion":  # every rank sends the same on the shard axis
        assert shard_bytes == want_shard, (shard_bytes, want_shard)
        # above Table 1 exactly where P lies on a matrix's longer side: the wide weights (24, 40) and
        # (24, 64) (fan_out, fan_in) by default, none of them with transpose_wide=false; the tall ones
        # whose Q side (fan_in) S divides, (40, 24) always; (64, 33) takes the fallback
        from optim.dion_math import dion_rank
        r_of = lambda o, i: dion_rank(o, i, rank_fraction=options["rank_fraction"])  # noqa: E731
        wide = sum((i - o) * r_of(o, i) * 4 for i, o in DIMS if o < i) if options.get("transpose_wide", True) else 0
        tall = sum((o - i) * r_of(o, i) * 4 for i, o in DIMS if o > i and i % S == 0)
        assert excess == wide + tall > 0, (excess, wide, tall)
    else:
        assert int(group_shard) == want_shard, (int(group_shard), want_shard)
    assert rep_bytes == want_rep, (rep_bytes, want_rep)
    checks.begin("resume")
    # exact resume at the same mesh: a fresh optimizer loading the state continues bit for bit
    import copy
    saved = copy.deepcopy(opt.state_dict())
    params = [p.to_local().detach().clone() for p in model.parameters()]
    state = gen.get_state()
    train(name, model, opt, gen, 2, world)
    straight = full_params(model)
    with torch.no_grad():
        for p, t in zip(model.parameters(), params):
            p.to_local().copy_(t)
    model, opt, _ = build(name, S, options, world, model)
    opt.load_state_dict(saved)
    gen.set_state(state)
    train(name, model, opt, gen, 2, world)
    assert all(torch.equal(a, b) for a, b in zip(straight, full_params(model))), f"{name} S={S}: resume differs"
    checks.begin("placements")
    aliases = parallel.local_aliases(model)
    kwargs = dict(comm_mode="fp32", optim_options=options, group=par.replicate_group, shard_group=par.shard_group,
                  param_order=[aliases[id(p)] for p in model.parameters()])
    if name == "muon":  # dim-0 shards only: told of another placement, it refuses
        try:
            build_optimizer(name, groups(model, aliases), shard_dims={id(a): 1 for a in aliases.values()}, **kwargs)
            raise AssertionError("Muon was built on dim-1 shards")
        except ValueError as e:
            assert "runs on dim-0 shards only" in str(e), e
    if name == "dion":  # Dion must be told the placements it asked for
        try:
            build_optimizer(name, groups(model, aliases), **kwargs)
            raise AssertionError("Dion was built on a sharded model without its placements")
        except ValueError as e:
            assert "pass shard_dims" in str(e), e
        if S == 2:  # told dim 0 everywhere, it finds a tall matrix's columns read as rows
            try:
                build_optimizer(name, groups(model, aliases), shard_dims={id(a): 0 for a in aliases.values()}, **kwargs)
                raise AssertionError("Dion was built on placements it did not ask for")
            except RuntimeError as e:
                assert "is sharded on dim 0, but this optimizer shards it on dim 1" in str(e), e
    if rank == 0:
        print(f"mesh_optim {name} S={S}: max |diff| {err:.3g} (weights moved up to {moved:.3g}); "
              f"bytes/step shard {shard_bytes}, replicate {rep_bytes}; diagnostics and resume match")
    checks.end()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _checks import Checks  # tests/workers/ is the script's directory
    checks = Checks(CHECKS)
    checks.guard(main, checks)
