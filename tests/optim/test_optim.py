"""Single-process tests of optim/: Lp quantizer vs eq. (1), levels rule, Lion vs a naive loop,
the registry's errors, world-size-1 update sync == Lion, zero-update masking, state round trips."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import optim
from optim import sync
from optim.quantize import lp_quantize

P_VALUES = [0.0, 0.5, 1.0, 2.0, math.inf, 3.0]


# ---- lp_quantize ---------------------------------------------------------------------------
def _eq1_reference(x: torch.Tensor, levels: int, p: float, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct transcription of Lion Cub eq. (1) in float64; returns (q, the value before rounding)."""
    a = x.double().abs()
    if math.isinf(p):
        m = a.max()
    elif p == 0:
        nz = a[a > 0]
        m = torch.exp(torch.log(nz).mean()) if nz.numel() else torch.tensor(0.0, dtype=torch.float64)
    else:
        m = (a ** p).mean() ** (1.0 / p)
    if m == 0:
        return torch.zeros_like(x, dtype=torch.int64), torch.zeros_like(x, dtype=torch.float64)
    y = levels / (clip * m) * x.double()
    return torch.clamp(torch.round(y), -levels, levels).long(), y


@pytest.mark.parametrize("p", P_VALUES)
def test_lp_quantize_matches_eq1_on_laplace(p):
    lap = torch.distributions.Laplace(0.0, 1e-3)
    for levels, clip, n in [(1, 2.0, 5000), (7, 2.0, 4096), (15, 1.0, 3000), (127, 2.0, 2048)]:
        torch.manual_seed(int(levels * 10 + clip))
        x = lap.sample((n,)).float()
        x[::17] = 0.0  # exact zeros must not move M_0 (geometric mean of the nonzero entries)
        q = lp_quantize(x, levels, p, clip=clip)
        ref, y = _eq1_reference(x, levels, p, clip)
        assert q.dtype == torch.int8 and q.shape == x.shape
        diff = q.long() != ref
        # fp32 vs fp64 scale may only disagree where y sits on a rounding boundary (k + 1/2)
        near_half = (y.abs() - y.abs().floor() - 0.5).abs() < 1e-4
        assert not (diff & ~near_half).any(), (p, levels, clip, int(diff.sum()))
        assert (q.long() - ref).abs().max() <= 1
        assert int(q.abs().max()) <= levels
        # the levels are actually used (not all zeros): a transcription bug would show here. Q_inf
        # rounds most Laplace values to 0 (Lion Cub §4.1), so there only the top level is checked
        if math.isinf(p):
            assert int(q.abs().max()) == round(levels / clip)
        else:
            assert (q != 0).float().mean() > (0.2 if levels > 1 else 0.02), (p, levels)


def test_lp_quantize_zero_input_and_classic_qinf():
    assert torch.equal(lp_quantize(torch.zeros(10), 5, 1.0), torch.zeros(10, dtype=torch.int8))
    assert torch.equal(lp_quantize(torch.zeros(10), 5, 0.0), torch.zeros(10, dtype=torch.int8))
    x = torch.tensor([-4.0, -1.0, 0.0, 0.5, 2.0])
    # Q_inf with clip 1 (Lion Cub §2): max |x| maps to the top level
    assert lp_quantize(x, 3, math.inf, clip=1.0).tolist() == [-3, -1, 0, 0, 2]  # 0.375 -> 0, 1.5 -> 2 (half even)
    # L1 with clip 2: M_1 = 7.5/5 = 1.5, scale = 3 / 3 = 1 -> round(x) clamped to 3
    assert lp_quantize(x, 3, 1.0).tolist() == [-3, -1, 0, 0, 2]
    assert lp_quantize(torch.tensor([3.0, -6.0, 0.0]), 2, 0.0, clip=1.0).tolist() == [1, -2, 0]  # M_0 = sqrt(18)


def test_lp_quantize_stochastic_is_unbiased_and_seeded():
    x = torch.linspace(-1, 1, 257)
    levels, p = 4, 2.0
    m = x.pow(2).mean().sqrt()
    y = (levels / (2.0 * m) * x).clamp(-levels, levels)
    gen = torch.Generator().manual_seed(3)
    draws = torch.stack([lp_quantize(x, levels, p, rounding="stochastic", generator=gen) for _ in range(2000)])
    assert ((draws.float() - y.floor()).ge(0) & (draws.float() - y.floor()).le(1)).all()  # floor or ceil only
    assert (draws.float().mean(0) - y).abs().max() < 0.06  # 2000 draws: std of the mean <= 0.011
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert torch.equal(lp_quantize(x, 4, 1.0, rounding="stochastic", generator=g1),
                       lp_quantize(x, 4, 1.0, rounding="stochastic", generator=g2))


def test_lp_quantize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="levels=0"):
        lp_quantize(torch.ones(3), 0, 1.0)
    with pytest.raises(ValueError, match="p=-1"):
        lp_quantize(torch.ones(3), 3, -1.0)
    with pytest.raises(ValueError, match="rounding='up'"):
        lp_quantize(torch.ones(3), 3, 1.0, rounding="up")


def test_levels_rule():
    # largest L with P * 2L <= 2**bits - 1 (capped at 127); where not even signs fit the options say so
    for bits in (1, 2, 4, 8, 16):
        for P in range(1, 40):
            opts = sync.get("pbit").options(bits=bits, quantizer="sign")
            if P > 2 ** bits - 1:
                assert any(f"comm.bits: {bits}-bit sign lanes hold at most" in q for q in opts.problems(P))
                continue
            assert opts.problems(P) == []
            L = sync.effective_levels(bits, P)
            assert L == min(127, max(l for l in range(0, 200) if P * 2 * l <= 2 ** bits - 1)), (bits, P)
    assert sync.effective_levels(4, 8) == 0   # Lion Cub 4-bit with 8 workers: signs only
    assert sync.effective_levels(8, 8) == 15
    assert sync.effective_levels(8, 8, levels=3) == 3  # set explicitly
    assert "comm.bits=8" in sync.get("pbit").options(bits=4).problems(16)[0]
    assert "comm.bits: 3 is not one of" in sync.get("pbit").options(bits=3).problems(2)[0]


# ---- Lion ------------------------------------------------------------------------------------
def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _groups(model, lr=0.01, wd=0.1):
    weights = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": weights, "names": [], "role": "mlp", "lr": lr, "weight_decay": wd, "lr_mult": 1.0},
            {"params": others, "names": [], "role": "norm", "lr": lr * 3, "weight_decay": 0.0, "lr_mult": 3.0}]


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def test_lion_matches_naive_reference_with_changing_lr():
    model, ref = _mlp(), _mlp()
    opt = optim.build_optimizer("lion", _groups(model), betas=(0.9, 0.95), eps=1e-8, comm_mode="fp32",
                                comm_options={})
    assert isinstance(opt, optim.Lion) and opt.scheme.kind == sync.GRADIENT
    ref_groups = _groups(ref)
    moms = {id(p): torch.zeros_like(p) for p in ref.parameters()}
    for step in range(8):
        scale = 1.0 - step / 10  # a schedule: the optimizer must read lr every step
        for g, rg in zip(opt.param_groups, ref_groups):
            g["lr"] = rg["lr"] = 0.01 * g["lr_mult"] * scale
        x, y = _batch(step)
        for m in (model, ref):
            m.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
        report = opt.step()
        with torch.no_grad():
            for rg in ref_groups:
                for p in rg["params"]:
                    m = moms[id(p)]
                    c = 0.9 * m + 0.1 * p.grad
                    p.mul_(1 - rg["lr"] * rg["weight_decay"])
                    p.sub_(rg["lr"] * torch.sign(c))
                    m.copy_(0.95 * m + 0.05 * p.grad)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
            torch.testing.assert_close(opt.state[p]["exp_avg"], moms[id(q)], rtol=1e-5, atol=1e-7)
    assert report.diagnostics == {} and report.step == 8 and report.bytes_sent == 0  # one process: no wire


def test_lion_leaves_frozen_params_alone_and_state_round_trip():
    model = _mlp()
    frozen = model[2].bias
    frozen.requires_grad_(False)  # frozen: not in the flat layout, never moved (not even weight decay)
    opt = optim.Lion(_groups(model), betas=(0.9, 0.99))
    before = frozen.detach().clone()
    unused = model[0].bias  # a trainable parameter without a gradient this step counts as g = 0
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if step == 2:
            unused.grad = None
        opt.step()
    assert torch.equal(frozen, before) and frozen not in opt.state
    assert unused.grad is not None and torch.equal(unused.grad, torch.zeros_like(unused))
    # round trip: continue from a saved state == continue directly
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    twin = _mlp(5)
    twin.load_state_dict(saved_model)
    twin[2].bias.requires_grad_(False)
    twin_opt = optim.Lion(_groups(twin), betas=(0.9, 0.99))
    twin_opt.load_state_dict(saved_opt)
    for step in range(3, 6):
        x, y = _batch(step)
        for m, o in ((model, opt), (twin, twin_opt)):
            m.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


# ---- registry ---------------------------------------------------------------------------------
def test_build_optimizer_registry_and_errors():
    model = _mlp()
    kw = dict(betas=(0.9, 0.99), eps=1e-8, comm_options={})
    with pytest.raises(ValueError, match=r"optim.name='sgd'.*adamw, lion"):
        optim.build_optimizer("sgd", _groups(model), comm_mode="fp32", **kw)
    with pytest.raises(ValueError, match=r"comm.mode='2bit'.*onebit"):
        optim.build_optimizer("lion", _groups(model), comm_mode="2bit", **kw)
    with pytest.raises(ValueError, match="optim.name=adamw needs a gradient-sync scheme: one of fp32, bf16"):
        optim.build_optimizer("adamw", _groups(model), comm_mode="onebit", **kw)
    with pytest.raises(ValueError, match=r"unknown comm options \['bitz'\]"):
        optim.build_optimizer("lion", _groups(model), comm_mode="pbit", comm_options={"bitz": 4})
    with pytest.raises(ValueError, match="momentum sync applies to update-sync modes"):
        optim.build_optimizer("lion", _groups(model), comm_mode="fp32", momentum_sync={"every": 10, "layers": ["head"]})
    with pytest.raises(ValueError, match=r"selects no parameter.*\['mlp', 'norm'\]"):
        optim.build_optimizer("lion", _groups(model), comm_mode="onebit", momentum_sync={"every": 10, "layers": ["head"]})
    with pytest.raises(ValueError, match="comm.quantizer: 'l3' is not one of"):
        optim.build_optimizer("lion", _groups(model), comm_mode="pbit", comm_options={"quantizer": "l3"})
    with pytest.raises(ValueError, match="comm.tie_break: 'random' is not one of"):
        optim.build_optimizer("lion", _groups(model), comm_mode="onebit", comm_options={"tie_break": "random"})
    with pytest.raises(ValueError, match="comm.levels: 3 levels x 1 ranks overflow 2-bit lanes"):
        optim.build_optimizer("lion", _groups(model), comm_mode="pbit", comm_options={"bits": 2, "levels": 3})
    adamw = optim.build_optimizer("adamw", _groups(model), comm_mode="bf16", **kw)
    assert isinstance(adamw, optim.AdamW) and adamw.scheme.kind == sync.GRADIENT
    assert adamw.inner.defaults["foreach"] is True and not adamw.inner.defaults["fused"]
    assert adamw.param_groups[1]["lr_mult"] == 3.0
    x, y = _batch(0)
    ((model(x) - y) ** 2).mean().backward()
    report = adamw.step(diagnose=True)  # gradient sync: momenta identical by construction, no diagnostics
    assert report.diagnostics == {} and report.histograms == {}
    # the trainer's MomentumSyncConfig convention: stop 0 = never stops
    synced = optim.build_optimizer("lion", _groups(model), comm_mode="onebit",
                                   momentum_sync={"every": 5, "layers": ["mlp"], "start": 0, "stop": 0})
    assert synced.momentum_sync.due(10**6) and not synced.momentum_sync.due(10**6 + 1)
    lion = optim.build_optimizer("lion", _groups(model), comm_mode="pbit", comm_options={"bits": 8, "quantizer": "l1"})
    assert lion.scheme.kind == sync.UPDATE and lion.exchange.levels == 127
    # the trainer's defaults: levels -1 = auto
    auto = optim.build_optimizer("lion", _groups(model), comm_mode="pbit",
                                 comm_options={"bits": 4, "quantizer": "l1", "levels": -1})
    assert auto.exchange.levels == 7


# ---- update sync at world size 1 (no process group: comm/ treats it as one rank) ----------------
EXACT_SIGN_MODES = [("onebit", {"tie_break": "alternate"}), ("onebit", {"tie_break": "minus"}),
                    ("ps", {"ps_aggregate": "vote"}), ("ps", {"ps_aggregate": "vote_tiebreak"}),
                    ("ps", {"ps_aggregate": "avg", "ps_topology": "tree"}),
                    ("pbit", {"bits": 8, "quantizer": "sign"}), ("pbit", {"bits": 1, "quantizer": "sign"}),
                    ("pbit", {"bits": 16, "quantizer": "sign", "levels": 1}), ("hierarchical", {})]


class _EmbNet(torch.nn.Module):
    """Token embedding with rows 12..15 never used (the padded-vocabulary case of Lion Cub App. B.1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)))

    def groups(self, lr=0.02):
        return [{"params": [self.emb.weight], "names": ["emb.weight"], "role": "embedding", "lr": lr,
                 "weight_decay": 0.5, "lr_mult": 1.0},
                {"params": [self.head.weight, self.head.bias], "names": ["head.weight", "head.bias"],
                 "role": "head", "lr": lr, "weight_decay": 0.0, "lr_mult": 1.0}]


def _emb_batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 12, (256,), generator=g)  # every used token appears in every batch
    return x, (3 * x + 1) % 12


@pytest.mark.parametrize("mode,opts", EXACT_SIGN_MODES)
def test_world1_update_sync_equals_lion_and_masking(mode, opts):
    nets = [_EmbNet() for _ in range(3)]
    lion = optim.build_optimizer("lion", nets[0].groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode="fp32",
                                 comm_options={})
    masked = optim.build_optimizer("lion", nets[1].groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode=mode,
                                   comm_options={**opts, "mask_zero_updates": True})
    unmasked = optim.build_optimizer("lion", nets[2].groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode=mode,
                                     comm_options={**opts, "mask_zero_updates": False})
    for step in range(6):
        x, y = _emb_batch(step)
        for net, opt in zip(nets, (lion, masked, unmasked)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        for p, q in zip(nets[0].parameters(), nets[1].parameters()):
            assert torch.equal(p, q), (mode, opts, step)
        # unmasked: identical except (possibly) the never-seen rows, which do not touch the loss
        assert torch.equal(nets[0].emb.weight[:12], nets[2].emb.weight[:12])
        assert torch.equal(nets[0].head.weight, nets[2].head.weight)
    # without the mask, a 1-bit vote (and pbit signs in 0/1 lanes, L = 0) moves the never-seen rows
    # (tie break of 0); ternary signs (levels 1) send exact zeros and need no mask
    unused_a, unused_c = nets[0].emb.weight[12:], nets[2].emb.weight[12:]
    sends_zero = unmasked.exchange.exact_zeros  # pbit with L >= 1, the exact parameter-server vote
    assert torch.equal(unused_a, unused_c) == sends_zero, (mode, opts)


def test_distributed_lion_state_round_trip_with_stochastic_rounding():
    def make():
        net = _EmbNet()
        opt = optim.build_optimizer("lion", net.groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode="pbit",
                                    comm_options={"bits": 4, "quantizer": "l1", "rounding": "stochastic"})
        return net, opt

    def run(net, opt, steps):
        for step in steps:
            x, y = _emb_batch(step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

    net, opt = make()
    run(net, opt, range(3))
    saved_net, saved_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved_opt["comm"]["step"] == 3
    run(net, opt, range(3, 7))
    twin, twin_opt = make()
    twin.load_state_dict(saved_net)
    twin_opt.load_state_dict(saved_opt)
    run(twin, twin_opt, range(3, 7))
    for p, q in zip(net.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    # the RNG is part of the state: a fresh generator would round differently
    fresh, fresh_opt = make()
    fresh.load_state_dict(saved_net)
    sd = copy.deepcopy(saved_opt)
    sd["comm"]["exchange"]["rng_state"] = torch.Generator().manual_seed(123).get_state()
    fresh_opt.load_state_dict(sd)
    run(fresh, fresh_opt, range(3, 7))
    assert any(not torch.equal(p, q) for p, q in zip(net.parameters(), fresh.parameters()))


def test_automatic_levels_follow_the_design_rule():
    net = _EmbNet()

    def levels(**opts):
        return optim.build_optimizer("lion", net.groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode="pbit",
                                     comm_options=opts).exchange.levels

    assert levels(bits=4, quantizer="sign") == 7  # largest L with 1 * 2L <= 15 (ternary signs)
    assert levels(bits=4, quantizer="sign", levels=0) == 0  # the paper's 4-bit: only +-1 in 0/1 lanes
    assert levels(bits=8, quantizer="l1") == 127  # capped by int8 votes
    with pytest.raises(ValueError, match="leave no quantization level for comm.quantizer=l1"):
        levels(bits=1, quantizer="l1")  # no level fits: an error naming the fix, not a silent fallback to signs


class _WideNet(torch.nn.Module):
    """Tensors of odd sizes, larger than the CPU kernels' parallel grain (32768), in two groups."""

    def __init__(self, device) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(1001, 67)
        self.mid = torch.nn.Linear(67, 67)
        self.head = torch.nn.Linear(67, 1001)
        self.to(device)

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(torch.tanh(self.emb(idx)))))

    def groups(self, lr=0.01):
        return [{"params": [self.emb.weight, self.mid.weight], "names": ["emb.weight", "mid.weight"], "role": "embedding",
                 "lr": lr, "weight_decay": 0.5, "lr_mult": 1.0, "betas": (0.9, 0.99)},
                {"params": [self.mid.bias, self.head.weight, self.head.bias], "role": "head", "lr": lr,
                 "weight_decay": 0.0, "lr_mult": 1.0, "betas": (0.95, 0.98),
                 "names": ["mid.bias", "head.weight", "head.bias"]}]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("mode,opts", [("onebit", {"tie_break": "alternate"}), ("pbit", {"bits": 8, "quantizer": "l1"}),
                                       ("pbit", {"bits": 4, "quantizer": "l2"})])
@pytest.mark.parametrize("threads", [1, 2])
def test_update_sync_c_over_the_gradient_is_exact(device, mode, opts, threads, monkeypatch):
    """c written over the gradient wave by wave (the default: no c buffer of the model's size; small
    waves here, so tensors are cut into pieces and pieces of several tensors share a wave, with the
    CPU kernels' threads splitting each piece) against a separate c kept between steps and one made
    per step and freed: the same parameters and momenta, bit for bit, in buckets too."""
    from optim import lioncub

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    monkeypatch.setattr(lioncub, "SCRATCH_MIN", 4096)
    monkeypatch.setattr(lioncub, "SCRATCH_PARTS", 1000)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        nets = [_WideNet(device) for _ in range(4)]
        kw = dict(betas=(0.9, 0.99), eps=1e-8, comm_mode=mode)
        opts_ = [optim.build_optimizer("lion", net.groups(), comm_options=dict(opts), **kw) for net in nets[:3]]
        opts_.append(optim.build_optimizer("lion", nets[3].groups(), comm_options=dict(opts), bucket_mb=0.1, **kw))
        assert [o.c_in_grad for o in opts_] == [True] * 4
        assert opts_[0].scratch.numel() == 4096 < opts_[0].layout.numel
        assert len(opts_[3]._buckets.buckets) > 1
        for o, keep in ((opts_[1], True), (opts_[2], False)):  # the separate-c path (what comm.overlap runs)
            o.c_in_grad, o.keep_c = False, keep
        for step in range(5):
            x = torch.randint(0, 1001, (64,), generator=torch.Generator().manual_seed(step)).to(device)
            cs = []
            for net, opt in zip(nets, opts_):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x), (7 * x + 3) % 1001).backward()
                opt.step()
            assert opts_[1]._c is not None and opts_[2]._c is None  # kept / released after the step
            for net in nets[1:]:
                for p, q in zip(nets[0].parameters(), net.parameters()):
                    assert torch.equal(p, q), (mode, step)
            for net, o in zip(nets[1:], opts_[1:]):
                for p, q in zip(nets[0].parameters(), net.parameters()):
                    assert torch.equal(opts_[0].momentum_of(p), o.momentum_of(q)), (mode, step)
    finally:
        torch.set_num_threads(before)


def test_c_over_the_gradient_leaves_c_in_the_gradient_buffer():
    """After a step the gradient buffer holds c = b1*m_old + (1-b1)*g (what the diagnostics read), and
    the step allocated no c buffer."""
    from optim.lion import lion_direction

    net = _EmbNet()
    opt = optim.build_optimizer("lion", net.groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode="onebit")
    for step in range(2):
        opt.zero_grad()
        x, y = _emb_batch(step)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        g = [p.grad.clone() for p in net.parameters()]
        m = [opt.momentum_of(p).clone() if opt.momentum_of(p) is not None else torch.zeros_like(p)
             for p in net.parameters()]
        opt.step()
        for p, c in zip(net.parameters(), lion_direction(m, g, 0.9)):  # Lion's own c, bit for bit
            assert torch.equal(p.grad, c), step
        assert opt._c is None


# ---- the base's pieces (optim/base.py composes layout, overlap, accounting, guard) -----------------
def test_base_decides_by_scheme_capabilities_not_kind_names():
    """optim/base.py compares no scheme `kind` (nor sync.GRADIENT / sync.UPDATE): what the base
    does per kind is its strategy's (optim.strategy), the rest the scheme's capabilities (phase)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(optim.base.__file__).read_text())
    offending = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and sub.attr in ("kind", "GRADIENT", "UPDATE")) or \
                        (isinstance(sub, ast.Constant) and sub.value in (sync.GRADIENT, sync.UPDATE)):
                    offending.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not offending, "optim/base.py branches on scheme kind names:\n" + "\n".join(offending)


def test_guard_word_lanes_and_a_step_that_sees_nan():
    """One int32 carries the non-finite count (bits 0-15) and the stop count (16 up): lanes stay
    apart when summed over ranks; a NaN gradient skips the update and says so."""
    from optim.guard import STOP_SHIFT, Verdict, decode, encode

    words = [encode(torch.tensor(bad), stop) for bad, stop in [(True, False), (False, True), (True, True)]]
    total = int(torch.stack(words).sum())
    assert total == 2 + (2 << STOP_SHIFT)
    assert decode(total) == Verdict(nonfinite=True, stop=True)
    assert decode(3 << STOP_SHIFT) == Verdict(nonfinite=False, stop=True)
    assert decode(1) == Verdict(nonfinite=True, stop=False)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = optim.Lion([{"params": [w]}], lr=1e-2)
    before = w.detach().clone()
    w.grad = torch.full((4, 3), float("nan"))
    rep = opt.step(loss_finite=True, stop=True)
    assert rep.nonfinite and rep.stop and opt.steps_done == 0 and torch.equal(w.detach(), before)
    opt.zero_grad()
    w.grad = torch.ones(4, 3)
    rep = opt.step(loss_finite=True)
    assert not rep.nonfinite and not rep.stop and opt.steps_done == 1 and not torch.equal(w.detach(), before)


def test_clipping_uses_the_reported_global_norm():
    """The clip factor comes from `_grad_norms`' global norm (one pass over the gradient, however its
    buffer is laid out): that norm is torch's clip_grad_norm_ total norm to rounding, and after the
    clip the gradient's norm is grad_clip."""
    net = _WideNet("cpu")
    opt = optim.build_optimizer("lion", net.groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode="onebit", grad_clip=0.25)
    x = torch.randint(0, 1001, (64,), generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(net(x), (7 * x + 3) % 1001).backward()
    ref = [p.grad.clone() for p in net.parameters()]
    total = torch.nn.utils.get_total_norm(ref)
    norms = opt._grad_norms()
    assert total > 0.25 and torch.allclose(norms[-1], total, rtol=1e-6)
    opt._clip_(norms[-1])
    clipped = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])
    assert torch.allclose(clipped, torch.tensor(0.25), rtol=1e-5)
    for p, g in zip(net.parameters(), ref):
        torch.testing.assert_close(p.grad, g * (0.25 / (total + 1e-6)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode,opts", [("onebit", {"tie_break": "alternate"}), ("pbit", {"bits": 8, "quantizer": "l1"}),
                                       ("pbit", {"bits": 4, "quantizer": "sign"})])
@pytest.mark.parametrize("kernels", ["auto", "native"])
def test_a_lion_cub_step_allocates_no_buffer_of_the_models_size(mode, opts, kernels, monkeypatch):
    """Peak memory: a Lion Cub step (after the first, which makes the momenta and the wave scratch)
    allocates no float buffer of the model's size (4 bytes per parameter): c is written over the
    gradient, the exchange's buffers are int8 / packed, the sign quantizer makes no float sign of
    c, and L1's quantization works in pieces (its |c| for M_1 is that of the tensors of one size:
    here emb and head, just under the whole model). comm.kernels=auto with the eager kernels (what
    auto keeps without a measurement, as compiled is patched away) and with the native kernels; the
    separate c of comm.overlap's path is 4 bytes per parameter, and this measurement sees it."""
    from comm import kernels as K
    from comm import native
    from tests.comm.test_kernels import _allocations

    if kernels == "native" and native.unavailable("cpu") is not None:
        pytest.skip(f"no native kernels: {native.unavailable('cpu')}")
    monkeypatch.setattr(K, "use_compiled", lambda *a, **k: False)
    net = _WideNet("cpu")
    opt = optim.build_optimizer("lion", net.groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode=mode,
                                comm_options=dict(opts), kernels=kernels)
    n = opt.layout.numel

    def step(k):
        opt.zero_grad()
        x = torch.randint(0, 1001, (64,), generator=torch.Generator().manual_seed(k))
        torch.nn.functional.cross_entropy(net(x), (7 * x + 3) % 1001).backward()
        return lambda: opt.step()

    step(0)()
    big = [b for b in _allocations(step(1)) if b >= 4 * n]
    assert not big, (mode, opts, big, n)
    opt.c_in_grad, opt.keep_c = False, False  # the separate c, made per step
    assert max(_allocations(step(2))) >= 4 * n


def test_c_over_the_gradient_in_buckets_keeps_every_momentum():
    """An empty tensor lies at the end of the bucket-ordered layout, where no bucket holds it: it still
    gets its momentum (checkpoints and momentum sync expect one per parameter)."""
    net = _EmbNet()
    empty = torch.nn.Parameter(torch.empty(0))
    groups = net.groups()
    groups[0]["params"] = [empty, *groups[0]["params"]]
    groups[0]["names"] = ["empty", *groups[0]["names"]]
    opt = optim.build_optimizer("lion", groups, betas=(0.9, 0.99), eps=1e-8, comm_mode="onebit", bucket_mb=0.0001,
                                param_order=[empty, *net.parameters()])
    assert opt.c_in_grad and len(opt._buckets.buckets) > 1
    x, y = _emb_batch(0)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    assert opt.momentum_of(empty) is not None and all(opt.momentum_of(p) is not None for p in net.parameters())
