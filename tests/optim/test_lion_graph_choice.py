"""Which Lion step an optimizer builds (optim.lion.graphed_step_impl): the fused pass replayed as a CUDA
graph under comm.kernels=auto on a device that replays graphs, the plain fused pass under =compiled and
elsewhere; and a capture that fails costs one warning, not the step: the plain fused pass takes that
step and the rest. The device check and the graphed class are swapped for stand-ins, so this runs on
CPU (tests/launch/test_lion_graphed.py runs the real replay on a GPU)."""
from __future__ import annotations

import types
import warnings

import pytest
import torch

import optim
from comm import kernels as K
from optim import lion as L
from optim import lion_cuda

compiled = pytest.mark.skipif(K.compile_unavailable("cpu") is not None,
                              reason=f"no compiled kernels here: {K.compile_unavailable('cpu')}")


class StandIn:
    """In place of GraphedLionStep: the wrapped fused step's call; with `fail_at`, that call (0-based) raises
    as a failed capture does, before anything runs."""

    fail_at: int | None = None

    def __init__(self, fused) -> None:
        self.fused, self.calls = fused, 0

    def __call__(self, state, groups) -> None:
        if self.calls == self.fail_at:
            raise lion_cuda.GraphCaptureError("RuntimeError: operation not permitted when stream is capturing")
        self.fused(state, groups)
        self.calls += 1


@pytest.fixture
def graphs_here(monkeypatch):
    """This CPU replays 'graphs' (the stand-in) and the fused step runs under auto and compiled."""
    monkeypatch.setattr(L, "cuda_graphs_on", lambda device: True)
    monkeypatch.setattr(L, "fused_step_impl", lambda impl, device: K.resolve_impl(impl) in ("auto", "compiled"))
    monkeypatch.setattr(L, "GraphedLionStep", StandIn)
    monkeypatch.setattr(StandIn, "fail_at", None)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3, bias=False))


def _opt(net, kernels):
    groups = [dict(params=[net[0].weight, net[2].weight], weight_decay=0.5, lr=3e-3),
              dict(params=[net[0].bias], weight_decay=0.0, lr=3e-3)]
    return optim.build_optimizer("lion", groups, betas=(0.9, 0.99), eps=1e-8, comm_mode="fp32",
                                 kernels=kernels, grad_clip=0.0)


def _train(kernels, steps=6):
    net = _net()
    opt = _opt(net, kernels)
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        for g in opt.param_groups:  # a schedule: a new lr every step
            g["lr"] = 3e-3 / (t + 1)
        opt.zero_grad()
        net(torch.randn(8, 12, generator=gen)).square().mean().backward()
        opt.step()
    return net, opt


def test_graphed_step_impl_is_auto_on_a_cuda_device_only():
    assert not L.cuda_graphs_on("cpu") and L.cuda_graphs_on("cuda")
    for impl in ("compiled", "eager", "native"):
        assert not L.graphed_step_impl(impl, "cuda") and not L.graphed_step_impl(impl, "cpu")
    assert not L.graphed_step_impl("auto", "cpu")
    assert L.graphed_step_impl("auto", "cuda") == L.fused_step_impl("auto", "cuda")


def test_auto_on_a_graph_device_wraps_the_fused_step_and_compiled_does_not(graphs_here):
    opt = _opt(_net(), "auto")
    assert any("lion step: fused pass replayed as a CUDA graph, fma variant 'fma'" in s for s in opt.kernel_choices())
    step = opt._fused_step()
    assert isinstance(step, StandIn) and isinstance(step.fused, L.FusedLionStep) and step.fused.fma == "fma"
    assert any("replayed as a CUDA graph" in s for s in opt.kernel_choices())
    opt = _opt(_net(), "compiled")  # the way to turn the graph off
    assert type(opt._fused_step()) is L.FusedLionStep
    assert any("lion step: fused pass, fma variant" in s for s in opt.kernel_choices())


def test_auto_without_a_graph_device_keeps_the_plain_fused_step(graphs_here, monkeypatch):
    monkeypatch.setattr(L, "cuda_graphs_on", lambda device: False)
    opt = _opt(_net(), "auto")
    assert type(opt._fused_step()) is L.FusedLionStep
    assert not any("CUDA graph" in s for s in opt.kernel_choices())


@compiled
def test_a_failed_capture_warns_once_and_the_plain_fused_pass_takes_that_step_and_the_rest(graphs_here):
    StandIn.fail_at = 1  # GraphedLionStep captures at its second call
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net_a, opt_a = _train("auto")
    mine = [w for w in caught if "CUDA graph" in str(w.message)]
    assert len(mine) == 1 and issubclass(mine[0].category, RuntimeWarning)
    assert "capture failed (RuntimeError: operation not permitted" in str(mine[0].message)
    assert "continues with the uncaptured fused pass" in str(mine[0].message)
    assert type(opt_a._fused) is L.FusedLionStep and opt_a._fused.calls == 6
    assert not any("CUDA graph" in s for s in opt_a.kernel_choices())
    net_c, opt_c = _train("compiled")
    for p, q in zip(net_a.parameters(), net_c.parameters()):
        assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32))
        assert torch.equal(opt_a.momentum_of(p).view(torch.int32), opt_c.momentum_of(q).view(torch.int32))


def test_a_failed_capture_raises_graph_capture_error_and_gives_the_caller_its_stream_back(monkeypatch):
    """A capture_end that raises leaves the capture's side stream current (torch.cuda.graph's exit stops
    there); _capture makes the caller's stream current again and runs nothing outside the capture."""
    current, ran = ["the caller's stream"], []

    class FailingCapture:
        def __init__(self, graph, capture_error_mode):
            self.mode = capture_error_mode

        def __enter__(self):
            current[0] = "the capture's side stream"

        def __exit__(self, *exc):
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: current.__setitem__(0, stream))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", FailingCapture)
    step = object.__new__(lion_cuda.GraphedLionStep)
    step.device, step._hyper = torch.device("cuda"), None
    step.fused = types.SimpleNamespace(_run=lambda *a: ran.append(current[0]))
    with pytest.raises(lion_cuda.GraphCaptureError, match="RuntimeError: CUDA error: operation failed due to"):
        step._capture([], [], [])
    assert current[0] == "the caller's stream" and ran == ["the capture's side stream"]
