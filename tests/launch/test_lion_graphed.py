"""optim/lion_cuda.py: Lion's fused step replayed as a CUDA graph (what Lion steps with under comm.kernels=auto
on CUDA) steps to the bytes of FusedLionStep, with a schedule that changes lr every step and tensors that move;
a Lion optimizer under auto equals one under comm.kernels=compiled (the plain pass), a failed capture included."""
from __future__ import annotations

import warnings

import pytest
import torch

import optim
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


def _train_lion(kernels: str, steps: int = 6, fail_capture: bool = False):
    """A Lion optimizer on CUDA (two groups, one without weight decay), lr changing every step; with
    `fail_capture` its graph's capture raises (as an operation a capture does not permit would)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(40, 33), torch.nn.Tanh(), torch.nn.Linear(33, 8, bias=False)).cuda()
    groups = [dict(params=[net[0].weight, net[2].weight], weight_decay=0.5, lr=3e-3),
              dict(params=[net[0].bias], weight_decay=0.0, lr=6e-3)]
    opt = optim.build_optimizer("lion", groups, betas=(0.9, 0.99), eps=1e-8, comm_mode="fp32", kernels=kernels,
                                grad_clip=0.0)
    opt._warmup_own_kernels()  # what the trainer's warm-up runs for it: the check that picks the fma variant
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        for g in opt.param_groups:
            g["lr"] = 3e-3 / (t + 1)
        opt.zero_grad()
        net(torch.randn(16, 40, generator=gen).cuda()).square().mean().backward()
        opt.step()
        if fail_capture and t == 0:
            run = opt._fused.fused._run

            def capture_fails(*args, run=run):
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("operation not permitted when stream is capturing")
                return run(*args)

            opt._fused.fused._run = capture_fails
    torch.cuda.synchronize()
    return net, opt


@cuda
def test_cuda_lion_auto_replays_the_graph_and_equals_compiled_bit_for_bit():
    net_a, opt_a = _train_lion("auto")
    net_c, opt_c = _train_lion("compiled")  # comm.kernels=compiled: the plain fused pass
    assert isinstance(opt_a._fused, GraphedLionStep) and opt_a._fused.captures == 1 and opt_a._fused.calls == 6
    assert type(opt_c._fused) is FusedLionStep
    assert any("lion step: fused pass replayed as a CUDA graph" in s for s in opt_a.kernel_choices())
    assert not any("CUDA graph" in s for s in opt_c.kernel_choices())
    for p, q in zip(net_a.parameters(), net_c.parameters()):
        assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32))
        assert torch.equal(opt_a.momentum_of(p).view(torch.int32), opt_c.momentum_of(q).view(torch.int32))


@cuda
def test_cuda_lion_auto_steps_on_the_plain_fused_pass_after_a_failed_capture():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net_a, opt_a = _train_lion("auto", fail_capture=True)
    mine = [w for w in caught if "CUDA graph capture failed" in str(w.message)]
    assert len(mine) == 1 and "uncaptured fused pass" in str(mine[0].message)
    assert type(opt_a._fused) is FusedLionStep and torch.cuda.current_stream() == torch.cuda.default_stream()
    net_c, opt_c = _train_lion("compiled")
    for p, q in zip(net_a.parameters(), net_c.parameters()):
        assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32))
        assert torch.equal(opt_a.momentum_of(p).view(torch.int32), opt_c.momentum_of(q).view(torch.int32))
