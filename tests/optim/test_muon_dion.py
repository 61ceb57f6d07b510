"""optim.muon and optim.dion: Muon at one rank against a float64 reference loop written here,
Dion at one rank bit for bit against dion_math.dion_step_ + torch's AdamW, checkpoint round trips,
config errors, bytes per step of the debug model, the distributed checks at P = 2 and 4
(tests/workers/muon_dion_dist.py) and train.py end to end on two ranks.

(Newton-Schulz against the SVD and Dion's math against float64 recomputations live in
tests/optim/test_orthogonal.py and tests/optim/test_dion_math.py.)
"""
from __future__ import annotations

import copy
import io
import math
import subprocess
import sys

import pytest
import torch

import optim
from model import MATRIX_ROLES, GPT, get_preset, param_roles
from optim.dion import Dion, matrix_seed
from optim.dion_math import dion_factor_rows, dion_step_, init_dion_q
from optim.muon import Muon
from tests.checks import Worker
from tests.dist import ROOT
from tests.trainer.test_trainer import records, train
from trainer.config import ConfigError, load_config

U32 = torch.finfo(torch.float32).eps / 2
BETAS, EPS, LR = (0.9, 0.95), 1e-8, 0.01
# name -> (shape, role, weight decay): tall, square and wide matrices, and the AdamW/Lion roles
PARAMS = {"emb.weight": ((12, 6), "embedding", 0.1), "attn.qkv": ((18, 6), "attn", 0.1),
          "attn.proj": ((6, 6), "attn", 0.1), "mlp.fc": ((16, 6), "mlp", 0.1), "mlp.proj": ((6, 8), "mlp", 0.1),
          "norm.weight": ((6,), "norm", 0.0), "head.weight": ((12, 6), "head", 0.1)}
MATRICES = [n for n, (_, role, _) in PARAMS.items() if role in ("attn", "mlp")]
SCALARS = [n for n in PARAMS if n not in MATRICES]


def init_params(dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for n, (s, _, _) in PARAMS.items()}


def grads(t: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + t)
    return {n: torch.randn(s, generator=g, dtype=torch.float64).float() for n, (s, _, _) in PARAMS.items()}


def make(name: str, opts: dict, clip: float = 0.0):
    params = {n: torch.nn.Parameter(x) for n, x in init_params().items()}
    groups = []
    for role in ("embedding", "head", "attn", "mlp", "norm"):
        names = [n for n, (_, r, _) in PARAMS.items() if r == role]
        groups.append({"params": [params[n] for n in names], "names": names, "role": role, "lr": LR, "lr_mult": 1.0,
                       "weight_decay": PARAMS[names[0]][2], "matrix": role in MATRIX_ROLES})
    opt = optim.build_optimizer(name, groups, betas=BETAS, eps=EPS, comm_mode="fp32", optim_options=opts,
                                grad_clip=clip, param_order=list(params.values()))
    return params, opt


def sched(t: int) -> float:
    return 1.0 - 0.15 * t  # the trainer rewrites group["lr"] every step: the matrix lr must follow


def run(params, opt, steps) -> None:
    for t in steps:
        for g in opt.param_groups:
            g["lr"] = LR * sched(t) * g["lr_mult"]
        for n, p in params.items():
            p.grad = grads(t)[n]
        opt.step()


# ---- Muon at one rank vs a reference loop -------------------------------------------------------------
NS = (3.4445, -4.7750, 2.0315)  # Muon's quintic coefficients, typed again: the reference imports nothing


def ns_reference(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    X = G / (G.norm() + 1e-7)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    a, b, c = NS
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


@pytest.mark.parametrize("opts", [dict(matrix_lr=0.05, nesterov=True, scale="shape", scalar_opt="adamw"),
                                  dict(matrix_lr=0.0, nesterov=False, scale="rms", scalar_opt="lion", momentum=0.9)])
def test_muon_matches_reference_loop(opts):
    """T steps with a changing lr. Reference in float64: momentum EMA, (Nesterov) direction, the
    Newton-Schulz map, scale, decoupled weight decay; AdamW (bias-corrected) or Lion for the rest.

    Tolerances. Momenta: the fp32 EMA rounds twice per step: 3 T u32 relative. Matrices: each
    Newton-Schulz iteration rounds with products of inner dimension K = max(m, n) (gamma_K relative)
    and the iteration map's slope is at most p'(0) = 3.4445, so 5 iterations stay within
    5 * 3.4445^5 * gamma_K of ||O|| = sqrt(min(m, n)); per step times lr * scale, T steps.
    AdamW: fp32's ~10 roundings of a direction bounded by K_t <= 3 (Cauchy-Schwarz) per step:
    20 u32 * 3 * lr per step, plus the update line's 4 u32 |X|. Lion: sign(c) agrees exactly (no
    element of c is within rounding of 0 for these gradients), so only the update line rounds."""
    T = 4
    beta, wd_m = opts.get("momentum", 0.95), 0.1
    params, opt = make("muon", opts)
    assert isinstance(opt, Muon)
    X = init_params(torch.float64)
    X0 = {n: x.clone() for n, x in X.items()}
    buf = {n: torch.zeros_like(X[n]) for n in MATRICES}
    m1 = {n: torch.zeros_like(X[n]) for n in SCALARS}
    m2 = {n: torch.zeros_like(X[n]) for n in SCALARS}
    tol = {n: 0.0 for n in PARAMS}
    for t in range(T):
        g = {n: x.double() for n, x in grads(t).items()}
        lr = LR * sched(t)
        matrix_lr = opts["matrix_lr"] * sched(t) if opts["matrix_lr"] else lr
        for n in MATRICES:
            m, k = PARAMS[n][0]
            buf[n] = beta * buf[n] + (1 - beta) * g[n]
            u = (1 - beta) * g[n] + beta * buf[n] if opts["nesterov"] else buf[n]
            scale = math.sqrt(max(1.0, m / k)) if opts["scale"] == "shape" else 0.2 * math.sqrt(max(m, k))
            X[n] = (1 - matrix_lr * wd_m) * X[n] - matrix_lr * scale * ns_reference(u)
            K = max(m, k)
            tol[n] += matrix_lr * scale * 5 * NS[0] ** 5 * K * U32 / (1 - K * U32) * math.sqrt(min(m, k)) \
                + 4 * U32 * X[n].norm().item()
        for n in SCALARS:
            wd = PARAMS[n][2]
            if opts["scalar_opt"] == "adamw":
                m1[n] = BETAS[0] * m1[n] + (1 - BETAS[0]) * g[n]
                m2[n] = BETAS[1] * m2[n] + (1 - BETAS[1]) * g[n] ** 2
                d = (m1[n] / (1 - BETAS[0] ** (t + 1))) / ((m2[n] / (1 - BETAS[1] ** (t + 1))).sqrt() + EPS)
                tol[n] += 20 * U32 * 3 * lr
            else:  # Lion with optim.betas
                d = torch.sign(BETAS[0] * m1[n] + (1 - BETAS[0]) * g[n])
                m1[n] = BETAS[1] * m1[n] + (1 - BETAS[1]) * g[n]
            X[n] = (1 - lr * wd) * X[n] - lr * d
            tol[n] += 4 * U32 * X[n].abs().max().item()
        run(params, opt, [t])
        for n in MATRICES:
            got = opt.state[params[n]]["momentum"].double()
            assert (got - buf[n]).norm() <= 3 * (t + 1) * U32 * buf[n].norm(), (n, t)
    for n in MATRICES:
        err = (params[n].detach().double() - X[n]).norm().item()
        assert err <= tol[n], (n, err, tol[n])
        assert tol[n] < 1e-2 * (X[n] - X0[n]).norm().item()  # the tolerance is far below the distance moved
    for n in SCALARS:
        err = (params[n].detach().double() - X[n]).abs().max().item()
        assert err <= tol[n], (n, err, tol[n])


@pytest.mark.parametrize("nesterov,scale", [(True, "shape"), (False, "rms")])
def test_muon_equals_torch_muon_in_fp32(monkeypatch, nesterov, scale):
    """Our Muon's matrix step against torch.optim.Muon on the same matrices (tall, square, wide),
    T steps with a changing lr. Conventions of the two: the same EMA momentum and Nesterov form,
    decoupled weight decay at the unscaled lr, and torch's adjust_lr_fn "original" /
    "match_rms_adamw" is our scale "shape" / "rms" (both multiply the lr of the update, not of the
    decay). torch's Newton-Schulz always casts to bfloat16; `Tensor.bfloat16` is patched to a float32
    copy here, so torch's own code runs in float32 (the CPU default of ours). The only rounding
    difference left is where the scale meets the lr (u * scale, then * lr, against lr * scale in
    one factor): a few u32 per element per step, so 1e-6 of the distance moved."""
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self, *a, **k: self.to(torch.float32, copy=True))
    shapes = {"attn.qkv": (48, 16), "attn.proj": (24, 24), "mlp.proj": (20, 56)}
    g0 = torch.Generator().manual_seed(11)
    init = {n: torch.randn(s, generator=g0) for n, s in shapes.items()}
    params = {n: torch.nn.Parameter(x.clone()) for n, x in init.items()}
    groups = [{"params": [params[n] for n in names], "names": names, "role": role, "lr": LR, "lr_mult": 1.0,
               "weight_decay": 0.1} for role, names in (("attn", ["attn.qkv", "attn.proj"]), ("mlp", ["mlp.proj"]))]
    matrix_lr = 0.03
    opt = optim.build_optimizer("muon", groups, betas=BETAS, eps=EPS, comm_mode="fp32",
                                optim_options={"matrix_lr": matrix_lr, "nesterov": nesterov, "scale": scale},
                                param_order=list(params.values()))
    theirs = {n: torch.nn.Parameter(x.clone()) for n, x in init.items()}
    ref = torch.optim.Muon(list(theirs.values()), lr=matrix_lr, weight_decay=0.1, momentum=0.95, nesterov=nesterov,
                           adjust_lr_fn="original" if scale == "shape" else "match_rms_adamw")
    for t in range(5):
        g = torch.Generator().manual_seed(100 + t)
        for n in shapes:
            params[n].grad = torch.randn(shapes[n], generator=g)
            theirs[n].grad = params[n].grad.clone()
        for group in opt.param_groups:
            group["lr"] = LR * sched(t)
        ref.param_groups[0]["lr"] = matrix_lr * sched(t)
        opt.step()
        ref.step()
        for n in shapes:
            moved = (theirs[n] - init[n]).norm().item()
            assert (params[n] - theirs[n]).norm().item() <= 1e-6 * moved, (n, t)
            assert torch.equal(opt.state[params[n]]["momentum"], ref.state[theirs[n]]["momentum_buffer"]), (n, t)


def test_muon_diagnostics_and_one_rank_bytes():
    params, opt = make("muon", {})
    for n, p in params.items():
        p.grad = grads(0)[n]
    report = opt.step(diagnose=True)
    d = report.diagnostics
    assert report.bytes_sent == 0 and opt.wire_bytes_per_step() == {"grad_sync": (0, 0)}  # one rank: no wire
    # an orthogonal update of an (m, n) matrix has element RMS 1/sqrt(max(m, n)); Newton-Schulz maps
    # every singular value into [0.68, 1.2] (optim.orthogonal), so the RMS lies in that band of it
    for n in MATRICES:
        m, k = PARAMS[n][0]
        exact = math.sqrt(max(1.0, m / k)) / math.sqrt(max(m, k))
        assert 0.68 * exact <= d[f"diag/muon_update_rms/tensor/{n}"] <= 1.2 * exact, (n, d)
    assert set(k for k in d if "/tensor/" not in k) >= {"diag/muon_update_rms", "diag/muon_update_rms/attn",
                                                        "diag/muon_update_rms/mlp"}


def test_dion_factor_exchange_runs_on_the_optimizers_kernels():
    """The P and R exchanges' context carries the optimizer's wire kernels (comm.kernels: the one
    Kernels object of the run), not the context's default setting."""
    params = {n: torch.nn.Parameter(x) for n, x in init_params().items()}
    groups = [{"params": [params[n] for n in PARAMS if PARAMS[n][1] == role], "role": role, "lr": LR,
               "lr_mult": 1.0, "weight_decay": 0.0, "matrix": role in MATRIX_ROLES}
              for role in ("embedding", "head", "attn", "mlp", "norm")]
    opt = optim.build_optimizer("dion", groups, betas=BETAS, eps=EPS, comm_mode="fp32",
                                optim_options={"rank_fraction": 0.5}, kernels="auto",
                                param_order=list(params.values()))
    assert opt.kernel_set.setting == "auto"
    assert opt.factor_exchange.ctx.kernels is opt.kernel_set and opt.exchange.ctx.kernels is opt.kernel_set
    # the per-rank random stream: derived from the run's seed and the rank like the base exchange's, not its copy
    assert opt.factor_exchange.ctx.seed not in (0, opt.exchange.ctx.seed)


# ---- Dion at one rank: bit for bit the math kernels ---------------------------------------------------
@pytest.mark.parametrize("opts", [{"rank_fraction": 0.5}, {"rank": 2, "mu": 0.9, "ortho": "cholesky_qr"},
                                  {"rank_fraction": 0.5, "transpose_wide": False}])
def test_dion_one_rank_equals_dion_step_and_adamw(opts):
    """At one rank the optimizer is dion_step_ (Alg. 1) on the matrices with Q seeded by name and
    lr = matrix_lr * schedule, and torch's AdamW on the rest: the same bits. mlp.proj (6, 8) is
    wide: Q is 6 x r by default (the step runs on its transpose), 8 x r with transpose_wide=False."""
    T, matrix_lr = 3, 0.03
    params, opt = make("dion", {"matrix_lr": matrix_lr, **opts})
    assert isinstance(opt, Dion)
    ref = {n: x.clone() for n, x in init_params().items()}
    rank = {n: opts.get("rank") or math.ceil(opts["rank_fraction"] * min(PARAMS[n][0])) for n in MATRICES}
    M = {n: torch.zeros_like(ref[n]) for n in MATRICES}
    tw = opts.get("transpose_wide", True)
    Q = {n: init_dion_q(dion_factor_rows(*PARAMS[n][0], tw)[1], rank[n], seed=matrix_seed(n)) for n in MATRICES}
    assert Q["mlp.proj"].shape[0] == (6 if tw else 8)
    adam_params = [torch.nn.Parameter(ref[n]) for n in SCALARS]
    adam = torch.optim.AdamW([{"params": [p], "weight_decay": PARAMS[n][2]} for n, p in zip(SCALARS, adam_params)],
                             lr=LR, betas=BETAS, eps=EPS, foreach=True)
    for t in range(T):
        g = grads(t)
        run(params, opt, [t])
        dion_step_([ref[n] for n in MATRICES], [g[n] for n in MATRICES], [M[n] for n in MATRICES],
                   [Q[n] for n in MATRICES], lr=matrix_lr * sched(t), mu=opts.get("mu", 0.95),
                   weight_decay=[PARAMS[n][2] for n in MATRICES], ortho=opts.get("ortho", "qr"), transpose_wide=tw)
        for p, n in zip(adam_params, SCALARS):
            p.grad = g[n]
        for group in adam.param_groups:
            group["lr"] = LR * sched(t)
        adam.step()
        for n in MATRICES:
            assert torch.equal(params[n], ref[n]), (n, t)
            assert torch.equal(opt.state[params[n]]["momentum"], M[n]) and torch.equal(opt.state[params[n]]["Q"], Q[n])
        for p, n in zip(adam_params, SCALARS):
            assert torch.equal(params[n], p), (n, t)


def test_dion_diagnostics_full_rank_and_low_rank():
    """rel_error = ||B - P R^T|| / ||B||: ~0 at full rank (P spans B's columns), and between 0 and 1 at
    rank 1, where it is at least the best rank-1 error (Eckart-Young) of B = G (the first step: M = 0).
    At full rank the diagnostic's cheap form ||B||^2 - 2 <B^T P, R> + ||R||^2 cancels: its rounding
    (P's orthogonality error O(m r u) and R's gamma_m, as in tests/optim/test_dion_math.py) leaves
    O(K u) ||B||^2 (K = max(m, n)), i.e. a floor of sqrt(10 K u32) relative (~1e-3 here)."""
    for opts in ({"rank_fraction": 1.0}, {"rank": 1}):
        params, opt = make("dion", opts)
        for n, p in params.items():
            p.grad = grads(0)[n]
        report = opt.step(diagnose=True)
        d = report.diagnostics
        for n in MATRICES:
            rel = d[f"diag/dion_rel_error/tensor/{n}"]
            B = grads(0)[n].double()
            s = torch.linalg.svdvals(B)
            if opts.get("rank_fraction") == 1.0:
                floor = math.sqrt(10 * max(PARAMS[n][0]) * U32)
                assert rel < floor and d[f"diag/dion_residual/tensor/{n}"] < floor * B.norm().item(), (n, rel)
            else:
                best = (s[1:].square().sum().sqrt() / s.square().sum().sqrt()).item()
                assert best * (1 - 1e-6) <= rel < 1, (n, rel, best)
                assert math.isclose(d[f"diag/dion_residual/tensor/{n}"], rel * B.norm().item(), rel_tol=1e-6)
        for role in ("attn", "mlp"):
            assert f"diag/dion_rel_error/{role}" in d and f"diag/dion_residual/{role}" in d
        assert report.phases["diag"]["bytes_sent"] == 0  # one rank


# ---- checkpoints ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,opts", [("muon", {"scalar_opt": "adamw"}), ("muon", {"scalar_opt": "lion"}),
                                       ("dion", {"scalar_opt": "adamw"}), ("dion", {"scalar_opt": "lion", "rank": 2})])
def test_state_dict_round_trip_is_bit_exact(name, opts):
    params, opt = make(name, opts, clip=1.0)
    run(params, opt, range(2))
    buf = io.BytesIO()
    torch.save({"params": {n: p.detach().clone() for n, p in params.items()}, "opt": opt.state_dict()}, buf)
    run(params, opt, range(2, 5))
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    twin, twin_opt = make(name, opts, clip=1.0)
    with torch.no_grad():
        for n, p in twin.items():
            p.copy_(saved["params"][n])
    twin_opt.load_state_dict(copy.deepcopy(saved["opt"]))
    run(twin, twin_opt, range(2, 5))
    for n in PARAMS:
        assert torch.equal(params[n], twin[n]), n
    assert ("inner" in saved["opt"]) == (opts["scalar_opt"] == "adamw")
    other, other_opt = make(name, {**opts, "scalar_opt": "lion" if opts["scalar_opt"] == "adamw" else "adamw"})
    with pytest.raises(ValueError, match="resume with the same optimizer"):
        other_opt.load_state_dict(copy.deepcopy(saved["opt"]))


def test_dion_checkpoint_of_the_other_orientation_is_refused():
    """A checkpoint's Q lies on the side its optim.transpose_wide put it (they differ on the wide
    mlp.proj only): resuming it with the other setting is a one-line error naming the fix, and with
    its own setting it loads."""
    params, opt = make("dion", {"transpose_wide": False})
    run(params, opt, range(1))
    saved = opt.state_dict()
    _, new_opt = make("dion", {})
    with pytest.raises(ValueError, match=r"Q of mlp.proj \(6, 8\) has shape \(8, 2\), this run expects "
                                         r"\(6, 2\) \(optim.transpose_wide=true\): it was saved with "
                                         r"optim.transpose_wide=false"):
        new_opt.load_state_dict(copy.deepcopy(saved))
    _, same = make("dion", {"transpose_wide": False})
    same.load_state_dict(copy.deepcopy(saved))


# ---- config errors ---------------------------------------------------------------------------------------
def test_config_errors_name_the_key_and_the_fix():
    for bad in ("0", "1.5", "-0.25"):
        with pytest.raises(ConfigError, match=rf"optim.rank_fraction: {bad}.* must lie in \(0, 1\]"):
            load_config(None, ["optim.name=dion", f"optim.rank_fraction={bad}"])
    with pytest.raises(ConfigError, match="optim.rank: -3 must be an int >= 1, or 0"):
        load_config(None, ["optim.name=dion", "optim.rank=-3"])
    for name in ("dion", "muon"):
        with pytest.raises(ConfigError, match=f"optim.name={name} needs .*: one of fp32, bf16"):
            load_config(None, [f"optim.name={name}", "comm.mode=onebit"])
    with pytest.raises(ConfigError, match="optim.scalar_opt: 'sgd' is not one of adamw, lion"):
        load_config(None, ["optim.name=muon", "optim.scalar_opt=sgd"])
    with pytest.raises(ConfigError, match=r"optim.rank_fraction: not an option of optim.name=muon \(it belongs to"):
        load_config(None, ["optim.name=muon", "optim.rank_fraction=0.5"])
    assert load_config(None, ["optim.name=dion", "optim.rank_fraction=1"]).optim.rank_fraction == 1.0
    # a rank larger than a matrix allows depends on the model: an error when the optimizer is built
    model = GPT(get_preset("debug"))
    from trainer.param_groups import param_groups
    groups = param_groups(model, load_config(None, ["optim.name=dion"]).optim)
    with pytest.raises(ValueError, match=r"optim.rank=65 exceeds min\(fan_out, fan_in\) of transformer.h.0.attn.qkv"
                                         r".*set optim.rank <= 64"):
        optim.build_optimizer("dion", groups, optim_options={"rank": 65})
    assert optim.build_optimizer("dion", groups, optim_options={"rank": 64}).ranks  # the largest legal rank


def test_cli_rank_too_large_is_a_config_error(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "configs/default.yaml", "model.preset=debug", "optim.name=dion",
                           "optim.rank=65", f"train.out_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "optim.rank=65 exceeds" in proc.stderr and "Traceback" not in proc.stderr


# ---- bytes per step: the debug model ---------------------------------------------------------------------
def debug_model_bytes(name: str, wire: int, rank_fraction: float = 0.25, clip: bool = True,
                      tie: bool = True) -> int:
    """Bytes one rank sends per step, from the debug model's shapes: Muon sends the whole gradient;
    Dion the non-matrix gradients (plus any matrix with (m + n) r >= m n), every matrix's P and R, and
    a 4-byte fp32 clipping norm."""
    model = GPT(get_preset("debug", tie_embeddings=tie))
    roles = param_roles(model)
    synced = factors = 0
    for n, p in model.named_parameters():
        if name == "dion" and roles[n] in ("attn", "mlp") and p.ndim == 2:
            m, k = p.shape
            r = math.ceil(rank_fraction * min(m, k))
            if (m + k) * r < m * k:
                factors += (m + k) * r
                continue
        synced += p.numel()
    return wire * (synced + factors) + (4 if name == "dion" and clip and factors else 0)


def test_debug_model_bytes_per_step():
    """The numbers (tied debug model: N = 3,326,272 parameters, of which 106,496 in the 8 hidden
    matrices (192, 64), (64, 64), (384, 64), (64, 192) x 2 layers; ranks 16 (1/4) and 4 (1/16), so
    (m + n) r = 17,408 (1/4) or 4,352 (1/16) elements per layer):
      muon  fp32 4 N = 13,305,088   bf16 2 N = 6,652,544
      dion  1/4  fp32 4 (N - 106,496) + 4 + 4 * 34,816 = 13,018,372   bf16 6,509,188
      dion  1/16 fp32 12,879,108 + 4 * 8,704 = 12,913,924             bf16 6,456,964
    The embedding (3.2M of 3.3M parameters) dominates this tiny model, so Dion saves little here."""
    got = {(n, w, rf): debug_model_bytes(n, w, rf) for n in ("muon", "dion") for w in (4, 2) for rf in (0.25, 0.0625)
           if n == "dion" or rf == 0.25}
    assert got == {("muon", 4, 0.25): 13_305_088, ("muon", 2, 0.25): 6_652_544,
                   ("dion", 4, 0.25): 13_018_372, ("dion", 2, 0.25): 6_509_188,
                   ("dion", 4, 0.0625): 12_913_924, ("dion", 2, 0.0625): 6_456_964}
    assert GPT(get_preset("debug")).num_params() * 4 == got[("muon", 4, 0.25)]
    # the optimizers' own formula (built on a meta-device model: shapes only) says the same
    from trainer.param_groups import param_groups
    for (name, wire, rf), expected in got.items():
        cfg = load_config(None, [f"optim.name={name}", f"comm.mode={'fp32' if wire == 4 else 'bf16'}"]
                          + ([f"optim.rank_fraction={rf}"] if name == "dion" else []))
        with torch.device("meta"):
            model = GPT(get_preset("debug"))
        opt = optim.build_optimizer(name, param_groups(model, cfg.optim), optim_options=cfg.optim.options,
                                    comm_mode=cfg.comm.mode, grad_clip=1.0)
        per_phase = opt.wire_bytes_per_step(world_size=2)
        assert sum(sent for sent, _ in per_phase.values()) == expected, (name, wire, rf, per_phase)
        assert opt.wire_bytes_per_step() == {k: (0, 0) for k in per_phase}  # this process: one rank


def test_dion_factor_calls_follow_the_orientation():
    """The two factor exchanges of a step, as the byte formula and the cost prediction see them: every
    P in one call, every R in the other. The debug model's (64, 192) MLP output matrices are wide, so
    by default their P is 192 x r and R 64 x r; with optim.transpose_wide=false the other way round.
    The total is (m + n) r per matrix either way."""
    from trainer.param_groups import param_groups
    with torch.device("meta"):
        model = GPT(get_preset("debug"))
    roles = param_roles(model)
    shapes = [tuple(p.shape) for n, p in model.named_parameters() if roles[n] in ("attn", "mlp") and p.ndim == 2]
    assert (64, 192) in shapes and (192, 64) in shapes
    for tw in (True, False):
        cfg = load_config(None, ["optim.name=dion", f"optim.transpose_wide={str(tw).lower()}"])
        opt = optim.build_optimizer("dion", param_groups(model, cfg.optim), optim_options=cfg.optim.options)
        calls = [n for phase, n, _ in opt._exchanged() if phase == "update_sync"]
        rank = {s: math.ceil(0.25 * min(s)) for s in shapes}
        if tw:
            assert calls == [sum(max(s) * rank[s] for s in shapes), sum(min(s) * rank[s] for s in shapes)]
        else:
            assert calls == [sum(s[0] * rank[s] for s in shapes), sum(s[1] * rank[s] for s in shapes)]
        assert sum(calls) == sum(sum(s) * rank[s] for s in shapes)


# ---- multi-process ---------------------------------------------------------------------------------------
MUON_DION_DIST = Worker("muon_dion_dist.py", timeout=300)


@pytest.mark.parametrize("nproc,check", MUON_DION_DIST.cases([2, 4]))
def test_distributed_dion_and_muon(nproc, check):
    MUON_DION_DIST.check(nproc, check)


@pytest.mark.parametrize("name", ["dion", "muon"])
def test_train_two_ranks_loss_falls_params_identical_bytes(tmp_path, name):
    train(2, tmp_path / "run", f"optim.name={name}", "comm.mode=fp32", "optim.lr=3e-3", "train.max_steps=10",
          "diag.every=5")
    steps = records(tmp_path / "run", "train_loss")
    assert [r["step"] for r in steps] == list(range(1, 11))
    losses = [r["train_loss"] for r in steps]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    final = records(tmp_path / "run", "params_identical")[-1]
    assert final["params_identical"] and len(final["param_sha256"]) == 2
    assert steps[-1]["comm_bytes"] == debug_model_bytes(name, 4)  # default.yaml clips (optim.grad_clip 1.0)
    key = "diag/dion_rel_error" if name == "dion" else "diag/muon_update_rms"
    diag = records(tmp_path / "run", key)
    assert [r["step"] for r in diag] == [5, 10] and all(0 < r[key] < 1 for r in diag)


@pytest.mark.slow
def test_dion_resume_through_the_trainer_is_bit_exact(tmp_path):
    mode = ["optim.name=dion", "comm.mode=bf16", "optim.rank_fraction=0.0625", "train.max_steps=6"]
    train(2, tmp_path / "straight", *mode)
    train(2, tmp_path / "split", *mode, "train.stop_after=3")
    train(2, tmp_path / "split", *mode, "train.resume=auto")
    a = records(tmp_path / "straight", "train_loss")
    b = records(tmp_path / "split", "train_loss")
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    assert b[-1]["comm_bytes"] == debug_model_bytes("dion", 2, 0.0625)


def test_the_groups_matrix_flag_decides_what_is_orthonormalized():
    """Muon orthonormalizes the parameters its groups flag as hidden matrices (the trainer's groups set
    `matrix` from model.MATRIX_ROLES), whatever the role is called; a group without the flag counts 2-D
    weights; 1-D parameters never count."""
    w, e, b = (torch.nn.Parameter(torch.randn(*s)) for s in ((6, 4), (10, 4), (6,)))

    def matrices(flag_w, flag_e):
        groups = [{"params": [w, b], "names": ["w", "b"], "role": "anything", "lr": LR, "weight_decay": 0.0},
                  {"params": [e], "names": ["e"], "role": "mlp", "lr": LR, "weight_decay": 0.0}]
        for g, flag in zip(groups, (flag_w, flag_e)):
            if flag is not None:
                g["matrix"] = flag
        opt = optim.build_optimizer("muon", groups, betas=BETAS, eps=EPS, comm_mode="fp32")
        return sorted(opt.layout.entries[k].name for k in opt.matrix_idx)

    assert matrices(True, False) == ["w"]  # a role named like a matrix role does not make it one
    assert matrices(False, True) == ["e"]
    assert matrices(None, None) == ["e", "w"]  # no flag: by shape, b (1-D) never
