"""The error-feedback family: onebit_adam, binsgdm and LoCo (comm.mode=loco under adamw / lion).

- tests/workers/ef_optim_dist.py at P = 2 and 4: every optimizer bitwise equal to a
  single-process simulation of the P workers (parameters, momenta, error states), all ranks
  identical, bytes = the declared formula every step, resume bit-exact;
- in process at P = 1: 1-bit Adam's warm-up is torch's AdamW step for step; error feedback is
  real (the accumulated applied update tracks the uncompressed one with it, drifts without it);
  LoCo's 8-bit error code; bad options are config errors naming the key;
- train.py end to end on 2 ranks (debug model, the shipped variant files): the loss falls, the
  parameters are identical, bytes per step are the formula, and a stopped binsgdm run resumes
  bit for bit.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import comm
from comm import Compressor
from model import GPT, get_preset
from optim import build_optimizer
from optim.sync.compressed import dequantize_error, quantize_error
from tests.checks import Worker
from tests.dist import ROOT, torchrun
from trainer.config import ConfigError, load_config, validate


EF_DIST = Worker("ef_optim_dist.py", timeout=240, when={"binsgdm_hierarchical_m2": lambda P: P % 2 == 0})


@pytest.mark.parametrize("nproc,check", EF_DIST.cases([2, 4]))
def test_against_p_worker_simulation(nproc: int, check: str) -> None:
    EF_DIST.check(nproc, check)


# ---- P = 1 --------------------------------------------------------------------------------------

def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))


def _groups(model: torch.nn.Module, lr: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "role": "mlp", "lr": lr, "weight_decay": 0.1},
            {"params": other, "role": "norm", "lr": lr, "weight_decay": 0.0}]


def test_onebit_adam_warmup_is_torch_adamw_at_p1() -> None:
    """Compression off (the warm-up) at P = 1: torch.optim.AdamW, bit for bit, with an lr schedule."""
    ours, ref = _model(), _model()
    opt = build_optimizer("onebit_adam", _groups(ours, 1e-2), betas=(0.9, 0.999), eps=1e-8,
                          comm_mode="compressed", optim_options={"freeze_step": 50})
    torch_opt = torch.optim.AdamW(_groups(ref, 1e-2), betas=(0.9, 0.999), eps=1e-8)
    X = torch.randn(64, 12, generator=torch.Generator().manual_seed(1))
    Y = torch.randn(64, 3, generator=torch.Generator().manual_seed(2))
    for t in range(1, 21):
        for model, o in ((ours, opt), (ref, torch_opt)):
            for g in o.param_groups:
                g["lr"] = 1e-2 * (1 - t / 40)
            o.zero_grad()
            torch.nn.functional.mse_loss(model(X), Y).backward()
            o.step()
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters())), t
    assert not opt.frozen and opt.steps_done == 20
    first = next(ref.parameters())
    assert not torch.equal(first, _model()[0].weight)  # it trained, so the match is not trivial


def test_onebit_adam_gradient_exchange_runs_on_the_optimizers_kernels() -> None:
    """The warm-up's fp32 gradient exchange carries the optimizer's wire kernels (comm.kernels: the one
    Kernels object of the run), like its compressed momentum exchange, not the context's default."""
    opt = build_optimizer("onebit_adam", _groups(_model(), 1e-2), betas=(0.9, 0.999), eps=1e-8,
                          comm_mode="compressed", optim_options={"freeze_step": 5}, kernels="auto")
    assert opt.kernel_set.setting == "auto"
    assert opt.grad_exchange.ctx.kernels is opt.kernel_set and opt.exchange.ctx.kernels is opt.kernel_set


def _fixed_stream(n: int, T: int) -> list[torch.Tensor]:
    """Gradients independent of the parameters: a fixed direction plus noise (so the exact
    accumulated update can be computed apart)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(n, generator=g) * 0.01
    return [a + torch.randn(n, generator=g) * 0.01 for _ in range(T)]


def _accumulated(name: str, error_feedback: bool, T: int) -> tuple[list[float], list[float]]:
    """Run `name` at P = 1 on a fixed gradient stream; return, at every step, |applied - exact|
    and |exact| of the updates accumulated since the freeze (1-bit Adam) / the start (BinSGDM),
    where exact = the same optimizer's update without compression."""
    n, lr = 4096, 1e-3
    p = torch.nn.Parameter(torch.zeros(n))
    mode = {"onebit_adam": ({"compressor": "scaled_sign"}, {"freeze_step": 5}),
            "binsgdm": ({"compressor": "binary_stochastic"}, {})}[name]
    opt = build_optimizer(name, [{"params": [p], "lr": lr, "weight_decay": 0.0}], betas=(0.9, 0.999),
                          comm_mode="compressed", comm_options=mode[0], optim_options=mode[1])
    stream = _fixed_stream(n, T)
    start, exact, gaps, sizes = None, torch.zeros(n, dtype=torch.float64), [], []
    m_ref = b_ref = None
    for t, g in enumerate(stream, 1):
        p.grad = g.clone()
        opt.step()
        if not error_feedback and opt.exchange.werr is not None:
            opt.exchange.werr.zero_()
            opt.exchange.serr.zero_()
        if name == "onebit_adam":
            if t == 5:                        # the freeze: exact 1-bit Adam continues from here
                start, m_ref = p.detach().clone(), opt.m_flat.clone()
                continue
            if t < 5:
                continue
            m_ref = 0.9 * m_ref + 0.1 * g
            exact += (m_ref / opt.denom).double()
        else:
            if start is None:
                start, m_ref, b_ref = torch.zeros(n), torch.zeros(n), torch.zeros(n)
            m_ref = 0.9 * m_ref + 0.1 * g
            b_ref = 0.9 * b_ref + 0.1 * g.abs()
            exact += (m_ref / b_ref).double()
        applied = (start - p.detach()).double() / lr
        gaps.append(float((applied - exact).norm()))
        sizes.append(float(exact.norm()))
    return gaps, sizes


@pytest.mark.parametrize("name", ["onebit_adam", "binsgdm"])
def test_error_feedback_is_real(name: str) -> None:
    """The accumulated applied update minus the uncompressed one equals the current errors (scaled),
    so with error feedback it stays small next to the accumulated update; zeroing the errors every
    step (no feedback) lets it drift. Measured (relative gap at 50 / 200 steps):
    1-bit Adam's scaled sign is biased: without feedback the gap is a constant 94% of the update
    (it grows linearly), with it 27% -> 14% and falling (the errors settle slowly: a sign code needs
    errors large enough to lift the block's mean |y| to its largest momenta);
    BinSGDM's Q is unbiased: without feedback the gap is a random walk (~sqrt(steps)), with it it
    stays at the size of the current errors (about 54 at every step count, 12x smaller at 200)."""
    T = 205
    with_ef, size = _accumulated(name, True, T)
    without, _ = _accumulated(name, False, T)
    k50, kT = 49, 199
    rel = lambda gaps, k: gaps[k] / size[k]  # noqa: E731
    print(f"{name}: |applied - exact| / |exact| at 50 / 200 steps: with EF {rel(with_ef, k50):.3f} / "
          f"{rel(with_ef, kT):.3f}, without {rel(without, k50):.3f} / {rel(without, kT):.3f}")
    assert without[kT] > 5 * with_ef[kT]
    if name == "onebit_adam":
        assert rel(without, k50) > 0.8 and rel(without, kT) > 0.8          # drift proportional to the steps
        assert rel(with_ef, kT) < 0.6 * rel(with_ef, k50) and rel(with_ef, kT) < 0.2
    else:
        assert without[kT] > 1.7 * without[k50]                              # a random walk
        assert with_ef[kT] < 1.2 * with_ef[k50] and rel(with_ef, kT) < 0.01  # bounded by the errors


def test_loco_error_code_is_8_bit_per_block() -> None:
    """quantize_error: codes in [-127, 127] with a fp32 scale max|e|/127 per block (the last one
    partial), half to even; dequantize_error inverts it to within half a step."""
    block = 16
    e = torch.randn(16 * 3 + 5, generator=torch.Generator().manual_seed(4))
    e[16:32] = 0.0                                            # an all-zero block: scale 0, codes 0
    q = torch.empty(e.numel(), dtype=torch.int8)
    s = torch.empty(4)
    quantize_error(e, block, q, s)
    for j in range(4):
        v = e[j * block:(j + 1) * block]
        assert s[j] == v.abs().max() / 127
        assert int(q[j * block:(j + 1) * block].abs().max()) == (127 if v.abs().max() > 0 else 0)
    back = torch.empty_like(e)
    dequantize_error(q, s, block, back)
    step = torch.repeat_interleave(s, block)[:e.numel()]
    assert torch.all((back - e).abs() <= step / 2 * (1 + 1e-5))
    # round half to even: 2.5 steps -> 2, 3.5 -> 4 (the block's max sets the step to 1/127 of it)
    h = torch.tensor([127.0, 2.5, 3.5, -2.5] + [0.0] * 12)
    q, s = torch.empty(16, dtype=torch.int8), torch.empty(1)
    quantize_error(h, 16, q, s)
    assert q[:4].tolist() == [127, 2, 4, -2] and float(s[0]) == 1.0


def test_loco_at_p1_compresses_and_compensates() -> None:
    """P = 1: the int4 code still applies (comm's contract) and LoCo's averaged error carries the
    rounding into the next calls: the running mean of the results approaches the input."""
    from optim import sync

    scheme = sync.get("loco")
    ex = scheme.build(scheme.options(block=64), sync.ExchangeContext(world_size=1, rank=0))
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    outs = [ex(x.clone(), t) for t in range(1, 41)]
    one = (outs[0] - x).abs().max()
    assert 0 < one <= x.abs().max() / 14 * (1 + 1e-6)       # half an int4 step, from the first call
    mean_err = (torch.stack(outs).mean(0) - x).abs().max()
    assert mean_err < one / 4, (float(mean_err), float(one))
    (st,) = ex.errors.values()
    assert st.wq.dtype == torch.int8 and st.calls == 40


# ---- configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,needle", [
    (["optim.name=onebit_adam", "comm.mode=compressed", "comm.compressor=twobit"],
     "comm.compressor: 'twobit' is not one of scaled_sign, binary_stochastic, int4"),
    (["optim.name=onebit_adam", "comm.mode=compressed", "optim.freeze_step=300"],
     "optim.freeze_step: 300 >= train.max_steps=300"),
    (["optim.name=onebit_adam", "comm.mode=compressed", "optim.freeze_step=0"], "optim.freeze_step: 0 must be >= 1"),
    (["optim.name=adamw", "comm.mode=compressed"], "optim.name=adamw needs a gradient-sync scheme"),
    (["optim.name=lion", "comm.mode=compressed"], "compressed works with optim.name=binsgdm or onebit_adam"),
    (["optim.name=onebit_adam", "comm.mode=loco"], "optim.name=onebit_adam needs an update-sync mean"),
    (["optim.name=binsgdm", "comm.mode=onebit"], "optim.name=binsgdm needs an update-sync mean"),
    (["optim.name=binsgdm", "comm.mode=compressed"], "optim.name=binsgdm quantizes m/b with BinSGDM's stochastic"),
    (["optim.name=onebit_adam", "comm.mode=compressed", "comm.compressor=binary_stochastic"],
     "optim.name=onebit_adam needs comm.compressor=scaled_sign"),
    (["optim.name=binsgdm", "comm.mode=compressed", "comm.compressor=binary_stochastic", "optim.t0=-2"],
     "optim.t0: -2 must be >= 0, or -1"),
    (["optim.name=onebit_adam", "comm.mode=compressed", "comm.scale=rms"], "comm.scale: 'rms' is not one of"),
    (["optim.name=onebit_adam", "comm.mode=compressed", "comm.block=12"],
     "comm.block: 12 must be a positive multiple of 8"),
    (["optim.name=adamw", "comm.mode=loco", "comm.block=0"], "comm.block: 0 must be a positive multiple of 8"),
    (["optim.name=adamw", "comm.mode=loco", "comm.err_beta=1.0"], "comm.err_beta: 1.0 must be in [0, 1)"),
    (["optim.name=adamw", "comm.mode=loco", "comm.reset_every=-1"], "comm.reset_every: -1 must be >= 0"),
    (["optim.name=adamw", "comm.mode=loco", "comm.compressor=int4"],
     "comm.compressor: not an option of comm.mode=loco (it belongs to compressed)"),
])
def test_bad_options_are_config_errors_naming_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value), str(e.value)


def test_world_size_checks_and_unexpressible_int4_overflow() -> None:
    cfg = load_config(None, ["optim.name=binsgdm", "comm.mode=compressed", "comm.compressor=binary_stochastic",
                             "comm.ef_node_size=4"])
    assert validate(cfg, world_size=8, raise_error=False) == []
    assert "comm.ef_node_size: 4 does not divide the world size 6" in validate(cfg, world_size=6, raise_error=False)[0]
    # int4 codes are fixed symmetric levels -7..7 per block, nothing sums in lanes: no level count to
    # overflow (unlike pbit), whatever the world size
    loco = load_config(None, ["optim.name=adamw", "comm.mode=loco"])
    assert all(validate(loco, world_size=P, raise_error=False) == [] for P in (1, 16, 128, 1024))


# ---- train.py end to end ---------------------------------------------------------------------------

TINY = ["model.preset=debug", "data.batch_size=4", "data.seq_len=64", "train.eval_steps=2", "train.log_every=1",
        "log.wandb=disabled", "optim.warmup_steps=0", "optim.lr=3e-3"]


def _train(tmp: Path, variant: str, run: str, *overrides: str) -> Path:
    cfg = tmp / f"{variant}.yaml"  # the shipped variant on the default config
    cfg.write_text(f"extends: [{ROOT / 'configs/default.yaml'}, {ROOT / 'configs/variants' / variant}.yaml]\n")
    out = tmp / run
    torchrun(2, ROOT / "train.py", str(cfg), *TINY, f"train.out_dir={out}", *overrides, timeout=240)
    return out


def _records(run: Path, key: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


def _bytes(variant: str, step: int, freeze: int) -> int:
    n = GPT(get_preset("debug")).num_params()
    if variant == "onebit_adam" and step <= freeze:
        return 4 * n                                       # AdamW warm-up: fp32 gradient allreduce
    kind = {"onebit_adam": "scaled_sign", "binsgdm": "binary_stochastic", "loco_adamw": "int4"}[variant]
    return comm.compressed_bytes(n, 2, Compressor(kind, block=2048))[0]


@pytest.mark.parametrize("variant", ["onebit_adam", "binsgdm", "loco_adamw"])
def test_train_end_to_end(tmp_path: Path, variant: str) -> None:
    steps, freeze = 16, 8
    extra = [f"optim.freeze_step={freeze}"] if variant == "onebit_adam" else []
    run = _train(tmp_path, variant, "run", f"train.max_steps={steps}", *extra)
    recs = _records(run, "train_loss")
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    losses = [r["train_loss"] for r in recs]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.8, losses
    assert [r["comm_bytes"] for r in recs] == [_bytes(variant, r["step"], freeze) for r in recs]
    final = _records(run, "params_identical")[-1]
    assert final["params_identical"] and len(final["param_sha256"]) == 2


@pytest.mark.slow
def test_onebit_adam_with_dead_elements_checkpoints_and_resumes_bit_exact(tmp_path: Path) -> None:
    """Untied embedding rows of tokens never seen in the warm-up have v = 0 at the freeze (frozen
    denominator inf: never moved). The checkpoint stores them finite (as 0) and a resume restores
    them: the run saves past the freeze and continues bit for bit."""
    args = ("model.tie_embeddings=false", "optim.freeze_step=2", "train.max_steps=6")
    straight = _train(tmp_path, "onebit_adam", "straight", *args)
    split = _train(tmp_path, "onebit_adam", "split", *args, "train.stop_after=4")
    state = torch.load(split / "ckpt" / "step_000004" / "rank_00000.pt", map_location="cpu", weights_only=False)
    denom = state["optimizer"]["frozen"]["denom"]
    assert torch.isfinite(denom).all() and int((denom == 0).sum()) > 1000  # dead rows, stored as 0
    _train(tmp_path, "onebit_adam", "split", *args, "train.resume=auto")
    a, b = _records(straight, "train_loss"), _records(split, "train_loss")
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    sha = [_records(r, "param_sha256")[-1]["param_sha256"] for r in (straight, split)]
    assert sha[0] == sha[1]


@pytest.mark.slow
def test_binsgdm_resume_is_bit_exact(tmp_path: Path) -> None:
    """Per-rank m, b, errors and generator states round-trip through the per-rank checkpoint."""
    straight = _train(tmp_path, "binsgdm", "straight", "train.max_steps=8")
    split = _train(tmp_path, "binsgdm", "split", "train.max_steps=8", "train.stop_after=4")
    assert _records(split, "train_loss")[-1]["step"] == 4
    _train(tmp_path, "binsgdm", "split", "train.max_steps=8", "train.resume=auto")
    a, b = _records(straight, "train_loss"), _records(split, "train_loss")
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    sha = [_records(r, "param_sha256")[-1]["param_sha256"] for r in (straight, split)]
    assert sha[0] == sha[1]
