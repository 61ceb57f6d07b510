"""Muon and Dion on the hybrid-sharding mesh (parallel.shard_size > 1): 4 gloo ranks in
tests/workers/mesh_optim.py, a stack of nn.Linear layers (m > n, m < n, m = n, rows that S does not
divide; Dion at rank 1/4, and at 0.7 where four matrices have (m + n) r >= m n and sync their
gradient instead of their factors; Dion's tall and square weights sharded on their columns, the
side of Q; and with optim.transpose_wide=false): equal to the replicated run within fp32 tolerance,
replicas bit-identical, bytes per axis counted from the collectives equal to the optimizers' formulas
and to Dion Table 1's (m + 1) r (m <= n) plus (m' - m) r where P lies on the longer side m' / Muon's
gather-scatter from the shapes, diagnostics equal to the unsharded values, exact resume, the
placements each optimizer asked for; and (slow) Muon and Dion resuming from the trainer's sharded
checkpoints, on the same mesh exactly and on other meshes (Dion S = 2 -> 4 and -> 1 within fp32
tolerance of the uninterrupted run)."""
from __future__ import annotations

import pytest

from tests.checks import Worker


# one launch per (optimizer, S[, rank fraction]), one item per check of tests/workers/mesh_optim.py
MESH = {"-".join(args): Worker("mesh_optim.py", *args, timeout=180)
        for args in (("muon", "2"), ("muon", "4"), ("dion", "2"), ("dion", "4"), ("dion", "2", "0.7"),
                          ("dion", "2", "0.25", "false"))}


@pytest.mark.parametrize("run,check", [pytest.param(run, check, id=f"{run}-{check}") for run, w in MESH.items()
                                       for _, check in (p.values for p in w.cases([4]))])
def test_matrix_optimizer_on_mesh_equals_replicated(run, check) -> None:
    MESH[run].check(4, check)


MESH_CKPT = Worker("mesh_ckpt.py", "{tmp}/runs", timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,check", MESH_CKPT.cases([4]))
def test_sharded_checkpoint_resumes_muon_and_dion_exactly(nproc, check) -> None:
    MESH_CKPT.check(nproc, check)
