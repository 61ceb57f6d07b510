"""pbit's per-tensor Lp scale (Lion Cub §4.2 eq. 1) on the hybrid-sharding mesh: with every norm
quantizer (L1, L2, L_inf, L0, Lp at p = 0.5 and 3) the votes at parallel.shard_size S = 2 and 4 (two
replicas: 4 and 8 gloo ranks in tests/workers/pbit_mesh.py) equal a single-process simulation of the
unsharded run on the same inputs, and the whole-tensor M_p gathered from the shards equals the
whole tensor's within fp32 summation order (2e-6 relative; p = inf exactly)."""
from __future__ import annotations

import pytest

from tests.checks import Worker

MESH = {S: Worker("pbit_mesh.py", str(S), timeout=240) for S in (2, 4)}


@pytest.mark.parametrize("S,nproc,check", [pytest.param(S, *p.values, id=f"S{S}-{p.id}")
                                           for S in MESH for p in MESH[S].cases([2 * S])])
def test_pbit_votes_on_mesh_equal_unsharded(S, nproc, check) -> None:
    MESH[S].check(nproc, check)
