"""Training telemetry: gradient norms (global and per role) against torch's clip_grad_norm_, tokens
seen, log.wandb following $WANDB_MODE, and the CPU counterpart of peak memory."""
import json
import os
import subprocess
import sys

import pytest
import torch

import optim
from model import GPT, get_preset, param_roles
from tests.dist import ROOT
from trainer.config import load_config
from trainer.logger import resolve_wandb_mode, wandb_payload
from trainer.param_groups import param_groups


@pytest.mark.parametrize("mode,clip", [("fp32", 0.05), ("onebit", 0.0)])
def test_grad_norm_is_clip_grad_norm_total_per_role_and_global(mode, clip):
    torch.manual_seed(0)
    model = GPT(get_preset("debug", tie_embeddings=False))
    cfg = load_config(None, [f"optim.grad_clip={clip}"])
    opt = optim.build_optimizer("lion", param_groups(model, cfg.optim), betas=(0.9, 0.99), comm_mode=mode,
                                grad_clip=clip, param_order=list(model.parameters()))
    x = torch.randint(0, 50000, (2, 32))
    opt.zero_grad()
    model(x, x)[1].backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    # torch's reference on copies of the same gradients: its return value is the norm before clipping
    copies = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in grads.items()}
    for n, c in copies.items():
        c.grad = grads[n].clone()
    expected = torch.nn.utils.clip_grad_norm_(list(copies.values()), max_norm=1e9).item()
    report = opt.step()
    norms = report.grad_norms.tolist()
    assert len(norms) == len(opt.grad_norm_roles) + 1
    assert norms[-1] == pytest.approx(expected, rel=1e-5) and norms[-1] > 0
    roles = param_roles(model)
    for role, got in zip(opt.grad_norm_roles, norms):
        want = torch.nn.utils.get_total_norm([grads[n] for n, r in roles.items() if r == role]).item()
        assert got == pytest.approx(want, rel=1e-5), role
    assert set(opt.grad_norm_roles) == {"embedding", "head", "attn", "mlp", "norm"}
    if clip:  # clipping acted on what was measured: the clipped gradient has norm `clip`
        after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        assert expected > clip and after == pytest.approx(clip, rel=1e-4)
    payload = wandb_payload({"step": 1, "grad_norm": norms[-1], "grad_norm/attn": norms[0]})
    assert payload == {"grad_norm/global": norms[-1], "grad_norm/attn": norms[0]}


def test_wandb_mode_follows_the_environment_when_unset():
    assert resolve_wandb_mode("", {}) == "disabled"
    assert resolve_wandb_mode("", {"WANDB_MODE": "offline"}) == "offline"
    assert resolve_wandb_mode("", {"WANDB_MODE": "dryrun"}) == "offline"
    assert resolve_wandb_mode("", {"WANDB_MODE": "online"}) == "online"
    assert resolve_wandb_mode("disabled", {"WANDB_MODE": "offline"}) == "disabled"  # the config wins when set
    with pytest.raises(ValueError, match="WANDB_MODE='offlne' is not one of"):
        resolve_wandb_mode("", {"WANDB_MODE": "offlne"})
    assert load_config(ROOT / "configs/default.yaml").log.wandb == ""  # the default config leaves it to the env


def test_run_logs_grad_norm_tokens_and_memory_and_honours_wandb_mode(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", HOME=str(tmp_path), OMP_NUM_THREADS="1", WANDB_BASE_URL="http://127.0.0.1:9")
    proc = subprocess.run([sys.executable, "train.py", "configs/default.yaml", "model.preset=debug",
                           "data.batch_size=4", "data.seq_len=64", "train.eval_steps=2", "train.log_every=1",
                           "train.max_steps=3", f"train.out_dir={run}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((run / "wandb").glob("offline-run-*/*.wandb"))) == 1  # WANDB_MODE=offline was honoured
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "train_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["tokens"] for r in train] == [k * 4 * 64 for k in (1, 2, 3)]
    for r in train:
        assert r["grad_norm"] > 0 and r["peak_rss_gib"] > 0.05
        roles = [r[f"grad_norm/{role}"] for role in ("embedding", "attn", "mlp", "norm")]
        # one step per window: the global norm is the roles' norms combined
        assert r["grad_norm"] == pytest.approx(sum(v * v for v in roles) ** 0.5, rel=1e-6)
    assert "grad norm" in proc.stdout


@pytest.mark.slow
def test_model_compile_time_is_reported_apart_and_not_in_the_first_step(tmp_path):
    """train.compile=true: the compile is paid (and logged) before the first timed step; a compile or
    recompile inside step 1 would make it seconds against the ~0.1 s of the steps after it. The
    evaluation's forward (eval mode, no grad: another graph) is compiled then too: nothing recompiles
    after the compile line (torch's recompile log stays empty through the steps and the final eval)."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", "configs/default.yaml", "model.preset=debug",
                           "data.batch_size=2", "data.seq_len=32", "train.eval_steps=1", "train.log_every=1",
                           "train.max_steps=3", "train.compile=true", "log.wandb=disabled", f"train.out_dir={run}"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_LOGS": "recompiles",
                               "PYTHONUNBUFFERED": "1"})  # one stream in the order it was written
    assert proc.returncode == 0, proc.stdout[-3000:]
    after = proc.stdout[proc.stdout.index("torch.compile paid in"):]
    assert "Recompiling function" not in after, after[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in recs)  # the evaluation ran, on the graph compiled up front
    compiled = [r for r in recs if r.get("event") == "compile"]
    assert len(compiled) == 1 and compiled[0]["compile_s"] > 0.5 and "torch.compile paid in" in proc.stdout
    steps = [r["step_ms"] for r in recs if "train_loss" in r]
    assert len(steps) == 3 and steps[0] < 5 * max(steps[1:]), steps
    assert steps[0] < 1000 * compiled[0]["compile_s"] / 3, (steps, compiled)
