"""The matrix optimizers on the hybrid-sharding mesh (launched by tests/test_mesh_optim.py), 4 gloo
ranks, a stack of nn.Linear layers of shapes m > n, m < n and row counts that S does not divide
(33 rows: 17 + 16 at S = 2, 9 + 9 + 9 + 6 at S = 4), `fully_shard`ed over the shard axis as
trainer/parallel.py does, a few steps:

- the run at parallel.shard_size S equals the replicated run (S = 1, the world as the optimizer's
  group) on the same per-rank data within TOL after STEPS steps;
- every replica holds bit-identical parameters after every step;
- the bytes each rank sends on the shard axis (the optimizer's shard_stats) and on the replicate
  axis (its CommStats phases) equal the formulas in the optimizers' docstrings, counted from the
  collectives.

argv: optimizer name, S. Asserts and exits non-zero on failure; prints "checks passed".
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from optim.registry import build_optimizer  # noqa: E402
from trainer import parallel  # noqa: E402

STEPS = 4
TOL = 2e-5
"""Max |difference| of any parameter after STEPS steps at lr 0.02 between runs that differ in the fp32
reduction order of the gradient mean (FSDP's reduce-scatter in the shard group, then the mean across
replicas, instead of one allreduce) and, for Dion, of B Q and B^T P (row blocks summed over the
shard group): about 1e-7 relative per step, amplified by the orthonormalisation; a wrong row
block or owner moves a parameter by lr * scale ~ 1e-2, 500x this."""
DIMS = [(24, 40), (40, 33), (33, 64), (64, 20)]
"""(in, out) of each layer: weights (40, 24), (33, 40), (64, 33), (20, 64)."""


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


def run(name: str, S: int, options: dict, rank: int, world: int):
    model = Stack()
    par = parallel.make_mesh(S, world, torch.device("cpu"))
    if par.sharded:
        for layer in model.h:
            from torch.distributed.fsdp import fully_shard
            fully_shard(layer, mesh=par.shard_mesh)
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=par.shard_mesh)
        aliases = parallel.local_aliases(model)
        opt = build_optimizer(name, groups(model, aliases), comm_mode="fp32", optim_options=options,
                              group=par.replicate_group, shard_group=par.shard_group,
                              param_order=[aliases[id(p)] for p in model.parameters()])
        parallel.route_grads(model, aliases)
    else:
        opt = build_optimizer(name, groups(model), comm_mode="fp32", optim_options=options,
                              param_order=list(model.parameters()))
    gen = torch.Generator().manual_seed(100 + rank)
    shas, sent = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.randn(8, DIMS[0][0], generator=gen)
        model(x).square().mean().backward()
        before = opt.shard_stats.totals()["bytes_sent"] if hasattr(opt, "shard_stats") else 0
        rep_before = sum(opt.stats[ph].totals()["bytes_sent"] for ph in ("grad_sync", "update_sync"))
        opt.step()
        sent.append((opt.shard_stats.totals()["bytes_sent"] - before,
                     sum(opt.stats[ph].totals()["bytes_sent"] for ph in ("grad_sync", "update_sync")) - rep_before))
        full = [(p.full_tensor() if par.sharded else p).detach().clone() for p in model.parameters()]
        h = hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in full)).hexdigest()
        got = [None] * world
        dist.all_gather_object(got, h)
        assert len(set(got)) == 1, f"{name} S={S}: ranks differ after a step: {got}"
        shas.append(h)
    return full, opt, sent


def main() -> None:
    name, S = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    options = {"rank_fraction": 0.25} if name == "dion" else {}
    ref, _, _ = run(name, 1, options, rank, world)
    got, opt, sent = run(name, S, options, rank, world)
    err = max(float((a - b).abs().max()) for a, b in zip(ref, got))
    moved = max(float((a - b.detach()).abs().max()) for a, b in zip(ref, Stack().parameters()))
    assert err < TOL, f"{name} S={S}: max |S - replicated| = {err:.3g} >= {TOL}"
    # bytes counted from the collectives against the docstrings' formulas
    shard_bytes, rep_bytes = sent[-1]
    want_shard, want_rep = opt.mesh_bytes_per_step()
    assert (shard_bytes, rep_bytes) == (want_shard, want_rep), \
        f"{name} S={S} rank {rank}: sent {shard_bytes} B shard, {rep_bytes} B replicate; formula {want_shard}, {want_rep}"
    if rank == 0:
        print(f"mesh_optim {name} S={S}: max |diff| {err:.3g} (weights moved up to {moved:.3g}); "
              f"bytes/step shard {shard_bytes}, replicate {rep_bytes}")
    dist.barrier()
    if rank == 0:
        print("mesh_optim: checks passed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
