"""Observability: train.profile writes torch.profiler Chrome traces of the chosen
steps on every rank, train.memory_snapshot is CUDA-only (a config error on train.device=cpu, a stated
no-op without CUDA), and log.tensorboard writes the scalars wandb gets to a TensorBoard event file."""
from __future__ import annotations

import inspect
import json
import types
from pathlib import Path

import pytest
import torch

from tests.dist import ROOT, torchrun
from trainer import profiling
from trainer.config import ConfigError, load_config
from trainer.logger import RunLogger, wandb_payload

TINY = ["model.preset=debug", "data.batch_size=4", "data.seq_len=64", "train.eval_steps=2", "log.wandb=disabled"]


def _scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_profile_steps_parse_and_config_checks():
    assert profiling.parse_steps("5-7") == {5, 6, 7}
    assert profiling.parse_steps("5,9") == {5, 9} == profiling.parse_steps([5, 9])
    assert profiling.parse_steps(6) == {6} and profiling.parse_steps("") == set()
    assert profiling.parse_steps(["2-3", 8]) == {2, 3, 8}
    cfg = load_config(ROOT / "configs/default.yaml", ["train.profile=5-7", "log.tensorboard=true"])
    assert cfg.train.profile == "5-7" and cfg.log.tensorboard is True and cfg.train.memory_snapshot == 0
    for bad, msg in [("train.profile=7-5", "train.profile: '7-5': steps start at 1 and a range A-B needs A <= B"),
                     ("train.profile=x", "train.profile: 'x' is not a step (N) or range (A-B)"),
                     ("train.profile=400", "train.profile: step 400 is past train.max_steps=300"),
                     ("train.memory_snapshot=-1", "train.memory_snapshot: -1; give the step after which")]:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            load_config(ROOT / "configs/default.yaml", [bad])
    with pytest.raises(ConfigError, match="train.memory_snapshot: records the CUDA allocator, but train.device=cpu"):
        load_config(ROOT / "configs/default.yaml", ["train.memory_snapshot=2", "train.device=cpu"])


def test_step_hooks_trace_the_chosen_steps_and_skip_the_snapshot_without_cuda(tmp_path, capsys):
    cfg = load_config(ROOT / "configs/default.yaml", ["train.profile=2-3,5", "train.memory_snapshot=1"])
    info = types.SimpleNamespace(rank=1)
    said = []
    hooks = profiling.StepHooks(cfg, info, tmp_path, torch.device("cpu"), said.append)
    assert "train.memory_snapshot=1 records CUDA memory, but this run is on cpu; no snapshot is written" \
        in capsys.readouterr().err
    w = torch.randn(64, 64)
    for step in range(1, 7):
        hooks.before_step(step)
        (w @ w).sum()
        hooks.after_step(step)
    hooks.close(6)
    names = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert names == ["rank1.steps_2-3.pt.trace.json", "rank1.steps_5-5.pt.trace.json"], names
    events = json.loads((tmp_path / "profile" / names[0]).read_text())["traceEvents"]
    marks = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert marks == {"ProfilerStep#2", "ProfilerStep#3"}, marks
    assert any(e.get("name") == "aten::mm" for e in events)
    assert not (tmp_path / "memory").exists() and said == []  # only rank 0 announces the traces


def test_tensorboard_gets_the_wandb_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    log = RunLogger(tmp_path, True, "disabled", "p", "r", "", {"log": {"tensorboard": True}})
    recs = [{"step": s, "train_loss": 5.0 - s, "lr": 1e-3, "step_ms": 10.0 + s, "data_ms": 1.0, "fwdbwd_ms": 5.0,
             "coll_ms": 2.0, "pack_ms": 1.0, "opt_ms": 1.0, "comm_ms": 3.0, "comm_bytes": 1000 * s,
             "diag/sign_match": 0.9, "diag/sign_match/block/0": 0.8} for s in (1, 2)]
    for r in recs:
        log.log(r)
    log.close()
    got = _scalars(tmp_path / "tensorboard")
    want = {}
    for r in recs:
        for k, v in wandb_payload(r).items():
            want.setdefault(k, {})[r["step"]] = v
    assert set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k]), k
    assert "step_time_stacked_ms/5_+optimizer" in got and "diag_sign_match/block.0" in got


def test_a_two_rank_run_writes_tensorboard_scalars_equal_to_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    torchrun(2, ROOT / "train.py", str(ROOT / "configs/default.yaml"), *TINY, "train.max_steps=2",
             "train.log_every=1", "log.tensorboard=true", f"train.out_dir={run}")
    got = _scalars(run / "tensorboard")
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [r for r in recs if "train_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        for k, v in wandb_payload(r).items():
            assert got[k][r["step"]] == pytest.approx(v, rel=1e-6), k
    assert got["loss/val"][2] == pytest.approx(next(r["val_loss"] for r in recs if "val_loss" in r), rel=1e-6)


def test_a_two_rank_run_profiles_on_every_rank(tmp_path):
    import trainer.trainer as tr

    if "StepHooks" not in inspect.getsource(tr):
        pytest.skip("trainer.fit does not call trainer.profiling.StepHooks yet (the call site in trainer/trainer.py)")
    run = tmp_path / "run"
    torchrun(2, ROOT / "train.py", str(ROOT / "configs/default.yaml"), *TINY, "train.max_steps=3",
             "train.profile=2-3", f"train.out_dir={run}")
    names = sorted(p.name for p in (run / "profile").iterdir())
    assert names == ["rank0.steps_2-3.pt.trace.json", "rank1.steps_2-3.pt.trace.json"], names
    for n in names:
        events = json.loads((run / "profile" / n).read_text())["traceEvents"]
        assert {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")} == \
            {"ProfilerStep#2", "ProfilerStep#3"}
