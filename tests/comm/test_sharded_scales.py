"""The whole-tensor M_p of Lion Cub eq. (1) from a tensor's shards (comm.quantize: segment_lp_partials,
combine_lp_partials; sharded_lp_means runs them across a group, tests/optim/test_pbit_mesh.py), and
the p-bit wire quantized with given means on every kernel implementation."""
from __future__ import annotations

import math

import pytest
import torch

from comm import kernels, native
from comm.quantize import combine_lp_partials, lp_mean, segment_lp_means, segment_lp_partials

PS = (0.0, 0.5, 1.0, 2.0, 3.0, math.inf)


def tensor(n: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    x[torch.rand(n, generator=g) < 0.1] = 0.0
    return x


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("cuts", [(500,), (1, 999), (300, 300, 700), (1000, 1000)])  # the last leaves a shard empty
def test_shards_combine_to_the_whole_tensors_mean(p, cuts) -> None:
    x = tensor()
    bounds = [0, *cuts, x.numel()]
    parts = torch.stack([segment_lp_partials(x[a:b], [(0, b - a)], p) for a, b in zip(bounds, bounds[1:])])
    got, want = combine_lp_partials(parts, p), lp_mean(x, p).double()
    if math.isinf(p):
        assert torch.equal(got.float(), lp_mean(x, p).reshape(1))
    # each within ~(log2(n) + 2) u of the exact M_p (n = 1000, u = 2^-24): ~1.4e-6 apart at most
    assert abs(float(got) - float(want)) <= 2e-6 * float(want), (p, cuts, float(got), float(want))


def test_empty_and_all_zero_tensors_get_zero() -> None:
    z = torch.zeros(6)
    for p in PS:
        parts = torch.stack([segment_lp_partials(z[:4], [(0, 4), (4, 0)], p),
                             segment_lp_partials(z[4:], [(0, 2), (2, 0)], p)])
        assert combine_lp_partials(parts, p).tolist() == [0.0, 0.0], p


IMPLS = ["eager"] + (["native"] if native.unavailable("cpu") is None else [])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("p", [1.0, math.inf, 0.0])
def test_quantize_pack_uses_the_means_it_is_given(impl, rounding, p) -> None:
    x = tensor(5000)
    segs = [(0, 3000), (3000, 1500), (4500, 500)]
    means = segment_lp_means(x, segs, p) * torch.tensor([1.7, 0.6, 3.0])  # not the local ones
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    want = kernels.wire_of(kernels.quantize_q(x, segs, 7, p, 2.0, rounding, gen(), means=means), 7, 4)
    got = kernels.quantize_pack(x, segs, 7, p, 2.0, 4, rounding, gen(), impl=impl, means=means)
    own = kernels.quantize_pack(x, segs, 7, p, 2.0, 4, rounding, gen(), impl=impl)
    assert torch.equal(got, want)
    assert not torch.equal(got, own)  # the given means were used


def test_the_collectives_call_torchs_current_gather_names_without_a_warning(tmp_path) -> None:
    """torch 2.13 deprecated all_gather_into_tensor / reduce_scatter_tensor (a FutureWarning on every call, on
    every rank): the product calls comm's all_gather_single / reduce_scatter_single, which are torch's new
    names where it has them. Checked in the source of the product's packages and by running the sharded
    M_p gather on a one-rank gloo group with warnings as errors."""
    import re
    import warnings
    from pathlib import Path

    import torch.distributed as dist

    import comm
    from comm.quantize import sharded_lp_means

    root = Path(__file__).parents[2]
    old = re.compile(r"\bdist\.(all_gather_into_tensor|reduce_scatter_tensor)\(")
    calls = [f"{f.relative_to(root)}:{n}" for pkg in ("comm", "optim", "trainer", "model", "data", "launch")
             for f in sorted((root / pkg).rglob("*.py")) for n, ln in enumerate(f.read_text().splitlines(), 1)
             if old.search(ln)]
    assert calls == [], f"deprecated collective names called at {calls}; call comm.all_gather_single / reduce_scatter_single"
    if hasattr(dist, "all_gather_single"):
        assert comm.all_gather_single is dist.all_gather_single
        assert comm.reduce_scatter_single is dist.reduce_scatter_single
    x = tensor()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = sharded_lp_means(x, [(0, 400), (400, 600)], 1.0, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    want = segment_lp_means(x, [(0, 400), (400, 600)], 1.0)
    assert torch.allclose(got, want, rtol=1e-6)
