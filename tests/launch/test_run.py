"""launch/run.sh: the command it prints and runs, its argument checks, and one real 2-rank run."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_SH = ROOT / "launch" / "run.sh"


def _run(*args: str, timeout: float = 30, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "WANDB_MODE": "disabled", **env}
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
    return subprocess.run(["bash", str(RUN_SH), *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)


def test_dry_run_prints_the_torchrun_command(tmp_path):
    p = _run(DRY_RUN="1", OMP_NUM_THREADS=None, NPROC=None, LOG_RANK=None)
    assert p.returncode == 0, p.stderr
    cores = os.cpu_count() or 1
    line = p.stdout.strip()
    # defaults: 2 ranks, configs/default.yaml, the cores split between the ranks
    assert line.startswith(f"+ OMP_NUM_THREADS={max(1, cores // 2)} "), line
    assert "-m launch.torchrun --standalone --nproc_per_node=2 " in line
    assert line.endswith(f"{ROOT}/train.py configs/default.yaml"), line
    assert "--local-ranks-filter" not in line

    p = _run("configs/default.yaml", "train.max_steps=7", "optim.name=adamw", DRY_RUN="1", NPROC="3",
             LOG_RANK="2", OMP_NUM_THREADS="5")
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip()
    assert line.startswith("+ OMP_NUM_THREADS=5 ") and "--nproc_per_node=3 --max-restarts=0 --tee 3 --local-ranks-filter 2 " in line
    assert line.endswith("configs/default.yaml train.max_steps=7 optim.name=adamw"), line

    # elastic restarts: torchrun's --max-restarts, and every (re)start resumes
    new = tmp_path / "new"
    p = _run("configs/default.yaml", "train.max_steps=7", f"train.out_dir={new}", DRY_RUN="1", MAX_RESTARTS="3")
    line = p.stdout.strip()
    assert "--max-restarts=3 " in line and line.endswith(f"train.out_dir={new} train.resume=auto"), line
    # ... of a new run: a run directory that holds a run is refused first, as train.resume=never would
    (new / "metrics.jsonl").parent.mkdir()
    (new / "metrics.jsonl").write_text("{}\n")
    p = _run("configs/default.yaml", f"train.out_dir={new}", DRY_RUN="1", MAX_RESTARTS="3")
    assert p.returncode == 2 and not p.stdout, p.stdout
    assert f"run directory {new} already exists and is not empty; pass train.resume=auto to continue it" in p.stderr
    p = _run("configs/default.yaml", "train.resume=overwrite", DRY_RUN="1", MAX_RESTARTS="2")
    assert p.stdout.strip().endswith("train.resume=overwrite")  # an explicit choice is kept
    assert _run(DRY_RUN="1", MAX_RESTARTS="-1").returncode == 2

    # overrides without a config path go to the default config
    p = _run("train.max_steps=7", DRY_RUN="1")
    assert p.stdout.strip().endswith("train.py configs/default.yaml train.max_steps=7"), p.stdout


def test_bad_arguments_are_explained():
    p = _run(DRY_RUN="1", NPROC="two")
    assert p.returncode == 2 and "NPROC must be a positive integer, got 'two'" in p.stderr
    p = _run(DRY_RUN="1", NPROC="2", LOG_RANK="2")
    assert p.returncode == 2 and "LOG_RANK must be a rank in 0..1, got '2'" in p.stderr
    p = _run("configs/nope.yaml", DRY_RUN="1")
    assert p.returncode == 2 and "config file 'configs/nope.yaml' not found" in p.stderr


def test_two_ranks_train_and_only_log_rank_is_shown(tmp_path):
    run = tmp_path / "run"
    p = _run("configs/default.yaml", "model.preset=debug", "data.batch_size=4", "data.seq_len=64",
             "train.eval_steps=2", "train.max_steps=2", "train.log_every=1", f"train.out_dir={run}", "log.wandb=disabled",
             NPROC="2", LOG_RANK="1", OMP_NUM_THREADS="1", timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert [r["step"] for r in recs if "train_loss" in r] == [1, 2]
    # rank 0 prints the run banner; with LOG_RANK=1 torchrun keeps it off the console
    assert "gloo world 2" not in p.stdout + p.stderr
    assert "--local-ranks-filter 1" in p.stdout


def test_a_config_error_is_one_line_and_exit_2(tmp_path):
    p = _run("configs/default.yaml", "train.max_stpes=3", f"train.out_dir={tmp_path / 'run'}", NPROC="2",
             OMP_NUM_THREADS="1", timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "train.max_stpes: unknown key; did you mean train.max_steps?" in p.stderr
