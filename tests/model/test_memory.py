"""The memory model (model/memory.py): its parameter + gradient + optimizer-state prediction against
the tensors real steps leave behind, for several optimizers and modes on the debug and tiny
presets (replicated here; sharded meshes in tests/trainer/test_parallel.py), and the command line."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from model import GPT, resolve_config
from model.memory import estimate, local_numel, measure
from optim import build_optimizer
from tests.dist import ROOT
from trainer.config import load_config
from trainer.param_groups import param_groups

CASES = [("configs/variants/lioncub_1bit.yaml", []), ("configs/variants/adamw_fp32.yaml", []),
         ("configs/variants/loco_adamw.yaml", []), ("configs/variants/binsgdm.yaml", []),
         ("configs/variants/onebit_adam.yaml", ["optim.freeze_step=1"]), ("configs/variants/muon.yaml", [])]


def one_step(cfg) -> dict[str, int]:
    torch.manual_seed(0)
    model = GPT(resolve_config(vars(cfg.model)))
    o, c = cfg.optim, cfg.comm
    opt = build_optimizer(o.name, param_groups(model, o), betas=tuple(o.betas), eps=o.eps, comm_mode=c.mode,
                          comm_options=c.options, optim_options=o.options, grad_clip=o.grad_clip,
                          param_order=list(model.parameters()))
    for _ in range(2):  # 1-bit Adam's error buffers appear on its first compressed step, after freeze_step
        x = torch.randint(0, 1000, (2, 32))
        opt.zero_grad()
        model(x, x)[1].backward()
        opt.step()
    return measure(model, opt)


@pytest.mark.parametrize("preset,path,extra", [("debug", p, e) for p, e in CASES] + [("tiny", p, e) for p, e in CASES[:2]],
                         ids=[f"debug-{p.split('/')[-1][:-5]}" for p, _ in CASES] + ["tiny-lioncub_1bit", "tiny-adamw_fp32"])
def test_prediction_within_15_percent_of_measured(preset, path, extra) -> None:
    cfg = load_config(ROOT / path, [f"model.preset={preset}", *extra])
    got = one_step(cfg)
    mem = estimate(cfg, world=1, shard_size=1)
    assert mem.params == got["params"] and mem.grads == got["grads"]  # exact: fp32, one flat buffer
    assert abs(mem.model_state - got["model_state"]) <= 0.15 * got["model_state"], (mem, got)
    assert abs(mem.optim_state - got["optim_state"]) <= 0.15 * got["optim_state"], (mem, got)


def test_local_numel_follows_fsdp_chunks() -> None:
    assert [local_numel((10, 3), 4, i) for i in range(4)] == [9, 9, 9, 3]  # chunks of ceil(10/4) = 3 rows
    assert [local_numel((2,), 4, i) for i in range(4)] == [1, 1, 0, 0]
    assert sum(local_numel((50304, 64), 8, i) for i in range(8)) == 50304 * 64


def test_sharding_divides_model_state() -> None:
    cfg = load_config(ROOT / "configs/variants/lioncub_1bit.yaml", ["model.preset=gpt2-124m"])
    full, quarter = estimate(cfg, world=8, shard_size=1), estimate(cfg, world=8, shard_size=4)
    assert quarter.model_state <= 0.26 * full.model_state
    assert quarter.comm_buffers > 0 and quarter.activations == full.activations


def test_command_line(tmp_path) -> None:
    run = [sys.executable, "-m", "trainer.memory", "configs/variants/adamw_fp32.yaml", "model.preset=gpt-7b",
           "data.batch_size=1", "data.seq_len=2048"]
    out = subprocess.run(run + ["--world", "8", "--shard-size", "8"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "world 8, shard size 8" in out.stdout and ": fits" in out.stdout, out.stdout
    out = subprocess.run(run + ["--world", "8", "--shard-size", "1"], cwd=ROOT, capture_output=True, text=True)
    assert "does NOT fit" in out.stdout, out.stdout
    bad = subprocess.run(run + ["--world", "8", "--shard-size", "3"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--shard-size 3 must be >= 1 and divide --world 8" in bad.stderr


def test_a_run_train_py_refuses_is_refused_not_estimated(capsys) -> None:
    """What train.py would refuse at this world size and mesh is an error, not a 'fits' (the hierarchical
    vote runs on no mesh); comm.mode=auto says how to estimate its candidates."""
    from trainer.memory import main

    hier = str(ROOT / "configs/variants/lioncub_hier.yaml")
    assert main([hier, "model.preset=debug", "--world", "4"]) == 0
    assert ": fits" in capsys.readouterr().out
    assert main([hier, "model.preset=debug", "--world", "4", "--shard-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "comm.mode=hierarchical does not run across replicas" in err, err
    assert main([str(ROOT / "configs/default.yaml"), "comm.mode=auto", "--world", "4"]) == 2
    err = capsys.readouterr().err
    assert "comm.mode=auto picks its variant when the run starts; estimate the candidates with --variants" in err, err
    # --variants (what that advice runs): a refused variant is a row saying so, the others are estimated
    one = str(ROOT / "configs/variants/lioncub_1bit.yaml")
    assert main(["--variants", hier, one, "model.preset=debug", "--world", "4", "--shard-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "refused: train.py would not run it here:" in out and "comm.mode=hierarchical does not run across" in out
    assert re.search(r"^lioncub_hier +refused \(above\)$", out, re.M) and re.search(r"^lioncub_1bit +[\d.]+ GiB", out, re.M)
    assert main(["--variants", hier, "model.preset=debug", "--world", "4", "--shard-size", "2"]) == 2
    assert "would run none of the variants" in capsys.readouterr().err


def test_update_sync_buffer_is_the_wave_scratch_unless_overlap() -> None:
    """Lion Cub writes c over the gradient: the estimate counts its wave scratch (1/8 of the model
    here, at least 2M elements), and the whole fp32 vector only with comm.overlap (c made during
    backward, its own buffer); a gradient-sync run counts no such vector."""
    from optim import sync
    from optim.lioncub import c_buffer_elements

    def buffers(variant, *extra):
        cfg = load_config(ROOT / "configs" / "variants" / f"{variant}.yaml", ["model.preset=gpt2-124m", *extra])
        mem = estimate(cfg, 8)
        sent, recv = sync.get(cfg.comm.mode).bytes_per_call(cfg.comm.options, 8, mem.local_elements)
        return mem.comm_buffers - sent - recv, mem.local_elements

    scratch, n = buffers("lioncub_1bit")
    assert scratch == 4 * c_buffer_elements(n, separate=False) == 4 * (-(-(-(-n // 8)) // 64) * 64)
    assert buffers("lioncub_1bit", "comm.bucket_mb=25", "comm.overlap=true", "optim.grad_clip=0")[0] == 4 * n
    assert buffers("lion_fp32")[0] == 0
    assert buffers("binsgdm")[0] == 4 * n  # its m/b buffer is the whole vector


def test_command_line_convention(capsys) -> None:
    """util/cli.py's convention: overrides after a flag, several config files composing as train.py
    composes them, --variants printing one estimate per file and a comparison."""
    from trainer.memory import main

    size, variant = str(ROOT / "configs/gpt2_124m.yaml"), str(ROOT / "configs/variants/lioncub_1bit.yaml")
    assert main([size, "--world", "8", "data.batch_size=1", "--shard-size", "1", variant]) == 0
    out = capsys.readouterr().out
    assert "gpt2-124m | optim.name=lion comm.mode=onebit | world 8" in out and "batch 1 x" in out, out
    composed = estimate(load_config([size, variant], ["data.batch_size=1"]), 8, 1)
    assert f"{composed.local_elements:,} local elements" in out

    adamw = str(ROOT / "configs/variants/adamw_fp32.yaml")
    assert main([size, "--variants", adamw, variant, "data.batch_size=1", "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert "== adamw_fp32" in out and "== lioncub_1bit" in out and "optim.name=adamw comm.mode=fp32" in out
    table = {line.split()[0]: float(line.split()[3]) for line in out.splitlines()
             if line.startswith(("adamw_fp32 ", "lioncub_1bit "))}
    want = {n: estimate(load_config([size, f], ["data.batch_size=1"]), 8, 1).total / 2 ** 30
            for n, f in (("adamw_fp32", adamw), ("lioncub_1bit", variant))}
    assert table == pytest.approx(want, abs=0.006) and table["adamw_fp32"] > table["lioncub_1bit"]
    # names of configs/variants, as bench.advise and bench.time_to_loss take them
    assert main([size, "--variants", "adamw_fp32", "lioncub_1bit", "data.batch_size=1", "--world", "8"]) == 0
    named = {line.split()[0]: float(line.split()[3]) for line in capsys.readouterr().out.splitlines()
             if line.startswith(("adamw_fp32 ", "lioncub_1bit "))}
    assert named == table

    with pytest.raises(SystemExit) as e:
        main([size, "--world", "8", "data.batch_size"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "'data.batch_size': expected a config file" in err and err.count("\n") == 1


def test_a_local_update_scheme_s_buffer_is_its_largest_average_not_the_cycle_mean() -> None:
    """DiLoCo's bytes per call are its cycle's averaged over H inner steps, but a sync step holds the largest
    fragment's fp32 pseudo-gradient, result and wire buffers whole: the estimate does not shrink with H (a
    practitioner review: 0.23 GiB for H = 50 where AdamW's fp32 allreduce of the same model held 11.6 GiB)
    and Streaming DiLoCo's two fragments hold about half."""
    from optim import sync

    def comm(variant):
        cfg = load_config(ROOT / "configs" / "variants" / f"{variant}.yaml", ["model.preset=gpt2-124m"])
        mem = estimate(cfg, 16)
        return mem.comm_buffers, mem.local_elements, cfg

    h10, n, cfg = comm("diloco_h10")
    h50, _, _ = comm("diloco_h50")
    # fp32 pseudo-gradient and result (8 n) and the fp32 wire's sent and received (4 n each): the cycle's bytes
    # are H times bytes_per_call's average
    assert h10 == h50 == 16 * n and 16 * n > 8 * n + 9.9 * sum(sync.get("diloco").bytes_per_call(cfg.comm.options, 16, n))
    adamw, _, _ = comm("adamw_fp32")
    assert h10 >= adamw
    # Streaming DiLoCo: its largest fragment (the strided blocks plus the embedding and head, as the trainer's
    # fragments are cut; checked against trainer.comm_prediction.param_layout), not half the model
    streaming, _, scfg = comm("streaming_diloco")
    from model import GPT, resolve_config
    from optim.sync.diloco import fragment_numels, wire_bytes
    from trainer.comm_prediction import param_layout

    with torch.device("meta"):
        layout = param_layout(GPT(resolve_config(vars(scfg.model))))
    nf = max(fragment_numels(scfg.comm.options.diloco, layout))
    assert nf > n // 2 and streaming == 8 * nf + sum(wire_bytes(scfg.comm.options.diloco, 16, nf))
    assert sync.get("diloco").buffer_bytes(cfg.comm.options, 1, n) == 0   # one rank exchanges nothing
