"""Lion's fused step (optim.lion.FusedLionStep): one compiled pass per tensor, the foreach kernels' bytes.

On CPU the compiled pass is checked byte for byte against the foreach kernels (the same numerics the
CUDA pass must have: an fma where ATen has one, every other product rounded). The CUDA tests run
where a GPU is visible (`make gpu-check` selects them with -k cuda)."""
from __future__ import annotations

import pytest
import torch

import optim
from comm import kernels as K
from optim import lion as L

compiled = pytest.mark.skipif(K.compile_unavailable("cpu") is not None,
                              reason=f"no compiled kernels here: {K.compile_unavailable('cpu')}")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (runs in make gpu-check)")


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32, device="cpu"):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(40, 33, device=device, dtype=dtype)
        self.b = torch.nn.Linear(33, 8, bias=False, device=device, dtype=dtype)
        self.norm = torch.nn.Parameter(torch.ones(33, device=device, dtype=dtype))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) * self.norm)

    def groups(self):
        return [dict(params=[self.a.weight, self.b.weight], weight_decay=0.5, lr=3e-3, lr_mult=1.0),
                dict(params=[self.a.bias, self.norm], weight_decay=0.0, lr=6e-3, lr_mult=2.0)]


def _train(kernels: str, device: str, steps: int = 6, dtype=torch.float32, warm: bool = False):
    net = Net(dtype, device)
    opt = optim.build_optimizer("lion", net.groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode="fp32",
                                kernels=kernels, grad_clip=0.0)
    if warm:  # what the trainer's warm-up runs for the optimizer: the check that picks the fma variant
        opt._warmup_own_kernels()
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        for g in opt.param_groups:  # a schedule: a new lr every step
            g["lr"] = 3e-3 * (1 - t / (2 * steps)) * g["lr_mult"]
        x = torch.randn(16, 40, generator=gen).to(device, dtype)
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    return net, opt


def _bits(ts):
    return [t.detach().view(torch.int32).clone() for t in ts]


@compiled
@pytest.mark.parametrize("fma", list(L.FMA_VARIANTS))
def test_fused_step_gives_the_foreach_bytes_on_cpu(fma):
    """Zeros, -0.0, subnormals, near-cancellations of b1*m + (1-b1)*g, a group without weight decay."""
    assert L.check_fused_step("cpu", fma) == []


@compiled
def test_the_float64_fma_is_correctly_rounded_where_float64_rounding_is_not():
    """Double-rounding traps (the float64 sum is a float32 midpoint, the exact value is not) and
    random values: _fma64 against inductor's fma op (std::fma on CPU), both compiled."""
    e, u, v = 2.0 ** -12, 1 + 2 ** -18, 1 - 2 ** -18
    gen = torch.Generator().manual_seed(9)
    a = torch.cat([torch.tensor([u * e, -u * e, -u * e, u * e]), torch.randn(3000, generator=gen) * 1e3])
    b = torch.cat([torch.tensor([v * e] * 4), torch.randn(3000, generator=gen) * 1e-3])
    c = torch.cat([torch.tensor([1 + 2 ** -23, 1 + 2 ** -23, -(1 + 2 ** -23), -(1 + 2 ** -23)]),
                   torch.randn(3000, generator=gen)])
    naive = (a.double() * b.double() + c.double()).float()
    f64, one = torch.compile(L._fma64), torch.compile(L._fma)
    want = one(a, b, c)
    assert (naive[:4] != want[:4]).all()  # the traps are traps
    assert torch.equal(f64(a, b, c), want)


@compiled
def test_lion_compiled_equals_eager_over_steps_and_never_recompiles():
    net_e, opt_e = _train("eager", "cpu")
    net_c, opt_c = _train("compiled", "cpu")
    assert opt_e._fused is None and isinstance(opt_c._fused, L.FusedLionStep)
    for a, b in zip(_bits(net_e.parameters()), _bits(net_c.parameters())):
        assert torch.equal(a, b)
    for p, q in zip(net_e.parameters(), net_c.parameters()):
        assert torch.equal(opt_e.momentum_of(p).view(torch.int32), opt_c.momentum_of(q).view(torch.int32))
    # new learning rates and weight decays reuse the compiled graph
    with torch.compiler.set_stance("fail_on_recompile"):
        for g in opt_c.param_groups:
            g["lr"], g["weight_decay"] = 1.234e-4, 0.25
        opt_c.step()


@compiled
def test_fused_step_refuses_what_it_cannot_take():
    net, _ = _train("eager", "cpu", steps=1, dtype=torch.bfloat16)
    assert "float32" in L.FusedLionStep.fits(list(net.parameters()))
    net, opt = _train("compiled", "cpu", steps=2, dtype=torch.bfloat16)  # steps on the foreach kernels
    assert opt._fused is None
    p = torch.nn.Parameter(torch.randn(4, 4).t())
    p.grad = torch.randn(4, 4)
    assert "contiguous" in L.FusedLionStep.fits([p])


def test_which_impl_fuses():
    assert not L.fused_step_impl("eager", "cpu") and not L.fused_step_impl("native", "cpu")
    assert not L.fused_step_impl("auto", "cpu")  # CPU keeps the foreach kernels (inductor's RSS)
    assert L.fused_step_impl("auto", "cuda") == (K.compile_unavailable("cuda") is None)


@cuda
def test_fused_step_gives_the_foreach_bytes_on_cuda():
    """The CUDA pass (Triton, fp fusion off, an explicit fma) against ATen's CUDA foreach kernels: the
    float64 fma always (no fma instruction, no flush to zero), inductor's fma op where its Triton fma
    keeps subnormals (the warm-up then prefers it). Both results are in the assertion's message."""
    found = {fma: L.check_fused_step("cuda", fma) for fma in L.FMA_VARIANTS}
    assert found["fma64"] == [], found
    print("fused Lion step on CUDA, differences per fma variant:", found)


@cuda
def test_lion_on_cuda_auto_fuses_and_equals_eager_and_itself():
    net_e, _ = _train("eager", "cuda")
    net_a, opt_a = _train("auto", "cuda", warm=True)
    net_b, _ = _train("auto", "cuda", warm=True)
    assert isinstance(opt_a._fused, L.GraphedLionStep)  # auto on CUDA: the fused pass replayed as a graph
    print("the warm-up picked fma variant", opt_a._fused.fused.fma)
    for a, b, c in zip(_bits(net_e.parameters()), _bits(net_a.parameters()), _bits(net_b.parameters())):
        assert torch.equal(b, c)  # every rank runs the same kernel: replicas agree bit for bit
        assert torch.equal(a, b)


def test_auto_steps_on_the_foreach_kernels_when_the_fused_step_does_not_compile(monkeypatch):
    """Under comm.kernels=auto a compiler failure at the first step is one warning, and the run (this step
    included) goes on with the foreach kernels: the same bytes as comm.kernels=eager."""
    monkeypatch.setattr(L, "fused_step_impl", lambda impl, device: impl == "auto")

    def broken(*a, **k):
        raise RuntimeError("backend compiler failed")

    monkeypatch.setattr(L.FusedLionStep, "_build", lambda self, rows: setattr(self, "_run", broken) or
                        setattr(self, "_rows", rows))
    with pytest.warns(RuntimeWarning, match="did not compile"):
        net_a, opt_a = _train("auto", "cpu")
    net_e, _ = _train("eager", "cpu")
    assert opt_a._fused is None
    for a, b in zip(_bits(net_e.parameters()), _bits(net_a.parameters())):
        assert torch.equal(a, b)


@compiled
def test_the_warm_up_keeps_the_first_fma_variant_that_gives_the_foreach_bytes(monkeypatch):
    real = L.check_fused_step
    monkeypatch.setattr(L, "check_fused_step", lambda device, fma="fma": ["p[2]"] if fma == "fma" else real(device, fma))
    net_c, opt_c = _train("compiled", "cpu", warm=True)
    assert opt_c._fused.fma == "fma64"
    net_e, _ = _train("eager", "cpu")
    for a, b in zip(_bits(net_e.parameters()), _bits(net_c.parameters())):
        assert torch.equal(a, b)
    monkeypatch.setattr(L, "check_fused_step", lambda device, fma="fma": [f"m[0] ({fma})"])
    with pytest.raises(RuntimeError, match=r"differs from the foreach kernels on cpu \(fma: m\[0\] \(fma\); fma64"):
        _train("compiled", "cpu", warm=True)
