"""optim/lion_cuda.py: Lion's fused step replayed as a CUDA graph (the candidate gpu-check's lionopt stage
times) steps to the bytes of FusedLionStep, with a schedule that changes lr every step and tensors that move."""
from __future__ import annotations

import pytest
import torch

from optim.lion import FusedLionStep
from optim.lion_cuda import GraphedLionStep

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (runs in make gpu-check)")


def test_graphed_step_refuses_a_device_without_cuda_graphs():
    with pytest.raises(ValueError, match="needs a CUDA device, not cpu; use optim.lion.FusedLionStep"):
        GraphedLionStep(FusedLionStep("cpu"))


def test_fused_step_inputs_make_momenta_and_one_row_per_group():
    ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn(3)
    state = {p: {} for p in ps}
    groups = [(dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99)), ps[:2]), (dict(lr=2e-3, weight_decay=0.1,
                                                                                 betas=(0.95, 0.98)), ps[2:])]
    p_in, g_in, m_in, rows, hyper = FusedLionStep.inputs(state, groups)
    assert rows == (0, 0, 1) and len(hyper) == 2 and hyper[0][0] == 1.0 and hyper[1][0] < 1.0
    assert all(m is state[p]["exp_avg"] and not m.any() for p, m in zip(ps, m_in))
    assert all(g is p.grad for p, g in zip(ps, g_in)) and not any(t.requires_grad for t in p_in)


def _state(seed: int, device: str):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in [(64, 33), (33,), (1000,)]]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen).to(device) * 1e-3
    return ps, {p: {} for p in ps}


@cuda
def test_cuda_graphed_step_equals_the_fused_step_bit_for_bit():
    (pa, sa), (pb, sb) = _state(0, "cuda"), _state(0, "cuda")
    fused, graphed = FusedLionStep("cuda"), GraphedLionStep(FusedLionStep("cuda"))
    for k in range(6):  # the schedule changes every step: the rows travel into the graph's tensor
        group = dict(lr=1e-3 / (k + 1), weight_decay=0.1, betas=(0.9, 0.99))
        fused(sa, [(group, pa)])
        graphed(sb, [(group, pb)])
    torch.cuda.synchronize()
    assert graphed.captures == 1
    for a, b in zip(pa, pb):
        assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))
        assert torch.equal(sa[a]["exp_avg"].view(torch.int32), sb[b]["exp_avg"].view(torch.int32))
    pc, sc = _state(1, "cuda")  # other tensors: stepped directly, then captured again
    for _ in range(3):
        graphed(sc, [(dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99)), pc)])
    assert graphed.captures == 2
