"""Muon and Dion on the hybrid-sharding mesh (parallel.shard_size > 1): 4 gloo ranks in
tests/workers/mesh_optim.py, a stack of nn.Linear layers (m > n, m < n, m = n, rows that S does not
divide; Dion at rank 1/4, and at 0.7 where four matrices have (m + n) r >= m n and sync their
gradient instead of their factors; Dion's tall and square weights sharded on their columns, the
side of Q): equal to the replicated run within fp32 tolerance, replicas bit-identical, bytes per axis
counted from the collectives equal to the optimizers' formulas and to Dion Table 1 / Muon's
gather-scatter from the shapes, diagnostics equal to the unsharded values, exact resume; and
(slow) Muon and Dion resuming from the trainer's sharded checkpoints, on the same mesh exactly and
on other meshes (Dion S = 2 -> 4 and -> 1 within fp32 tolerance of the uninterrupted run)."""
from __future__ import annotations

import pytest

from tests.dist import torchrun


@pytest.mark.parametrize("name,S,extra", [("muon", 2, []), ("muon", 4, []), ("dion", 2, []), ("dion", 4, []),
                                          ("dion", 2, ["0.7"])])
def test_matrix_optimizer_on_mesh_equals_replicated(name, S, extra) -> None:
    proc = torchrun(4, "mesh_optim.py", name, str(S), *extra, timeout=180)
    assert "mesh_optim: checks passed" in proc.stdout, proc.stdout + proc.stderr
    print(proc.stdout)


@pytest.mark.slow
def test_sharded_checkpoint_resumes_muon_and_dion_exactly(tmp_path) -> None:
    proc = torchrun(4, "mesh_ckpt.py", str(tmp_path / "runs"), timeout=300)
    assert "mesh_ckpt: checks passed" in proc.stdout, proc.stdout + proc.stderr
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("dion S=2 ->")))
