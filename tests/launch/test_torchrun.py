"""launch.torchrun: a config error under torchrun is one message and exit code 2, never torchrun's
ChildFailedError traceback, whether the launcher finds it before the ranks start or a rank finds it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _launch(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "train.py"), str(ROOT / "configs" / "default.yaml"), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_bad_key_is_one_message_and_exit_2_before_any_rank_starts(tmp_path):
    p = _launch("train.max_stpes=5", f"train.out_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "ChildFailedError" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.count("train.max_stpes: unknown key; did you mean train.max_steps?") == 1, p.stderr
    assert not (tmp_path / "run").exists()


def test_a_world_size_problem_is_found_before_launch(tmp_path):
    p = _launch("parallel.shard_size=4", f"train.out_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "parallel.shard_size: 4 does not divide the world size 2" in p.stderr and "Traceback" not in p.stderr


def test_an_error_a_rank_finds_keeps_its_exit_code_without_a_traceback(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("someone's file\n")
    p = _launch("model.preset=debug", f"train.out_dir={run}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "ChildFailedError" not in p.stderr, p.stderr[-3000:]
    assert f"run directory {run} already exists and is not empty" in p.stderr, p.stderr
    assert "launch.torchrun: rank" not in p.stderr  # exit code 2: the rank's own message stands alone
    assert "ChildFailedError report that follows" not in p.stderr
    assert (run / "notes.txt").read_text() == "someone's file\n"


def test_ctrl_c_to_the_launcher_checkpoints_and_is_one_line_with_exit_130(tmp_path):
    """A terminal's Ctrl-C reaches the launcher's process group (torchrun starts its ranks in sessions of
    their own): torchrun passes SIGINT to the ranks, which checkpoint and stop; the launcher then says so in
    one line, no SignalException traceback, and exits 130."""
    import signal
    import time

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc_per_node=2",
                             str(ROOT / "train.py"), str(ROOT / "configs" / "default.yaml"), "model.preset=debug",
                             "data.batch_size=2", "data.seq_len=32", "train.eval_every=0", "train.max_steps=100000",
                             f"train.out_dir={run}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "metrics.jsonl").exists():
            time.sleep(0.2)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the launcher's process group
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert "launch.torchrun: SIGINT received" in err
    assert (run / "ckpt" / "latest").is_file()


def test_plain_torchrun_names_the_launcher_that_avoids_its_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(ROOT / "train.py"), str(ROOT / "configs" / "default.yaml"), "train.max_stpes=5"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "train.max_stpes: unknown key" in p.stderr
    assert "`python -m launch.torchrun` takes the same options" in p.stderr, p.stderr[-3000:]


def test_help_anywhere_is_left_to_train_py():
    """train.py answers --help / --help-config wherever they stand; the launcher's check must not turn a
    help request after the config file into a config error."""
    from launch.torchrun import check_train_args
    assert check_train_args(["configs/default.yaml", "--help-config"], 2) == ""
    assert check_train_args(["configs/default.yaml", "train.max_steps=1", "-h"], 2) == ""
    assert "no_such_key" in check_train_args(["configs/default.yaml", "train.no_such_key=1"], 2)


def test_a_shard_group_wider_than_a_node_is_found_before_launch():
    """The ranks per node (--nproc_per_node) bound parallel.shard_size as the ranks' mesh does
    (trainer.parallel.make_mesh): 2 nodes x 4 ranks at S = 8 divides the world but not a node; with an
    elastic node count the world is unknown and the node still bounds it."""
    from torch.distributed.run import parse_args

    from launch.torchrun import _node_size, _world_size, check_train_args

    args = ["configs/default.yaml", "parallel.shard_size=8"]
    assert "parallel.shard_size: 8 does not divide the ranks per node (4)" in check_train_args(args, 8, 4)
    assert check_train_args(["configs/default.yaml", "parallel.shard_size=4"], 8, 4) == ""
    elastic = parse_args(["--nnodes=1:2", "--nproc_per_node=4", "train.py"])
    assert (_world_size(elastic), _node_size(elastic)) == (None, 4)
    assert "does not divide the ranks per node (4)" in check_train_args(args, None, 4)
    assert _node_size(parse_args(["--nproc_per_node=gpu", "train.py"])) is None


def test_the_launcher_passes_the_node_size_and_an_elastic_world_to_the_checks(monkeypatch, capsys):
    """main(): the ranks per node and an elastic --nnodes=MIN:MAX reach the config check, which refuses
    before torchrun runs (a shard group wider than a node; a mode whose state cannot move to fewer ranks,
    also among those comm.mode=auto may pick); a fixed node count accepts the latter."""
    import logging

    import torch.distributed.run as tdr
    from torch.distributed.run import parse_args

    from launch.torchrun import _world_may_change, main

    monkeypatch.setattr(tdr, "run", lambda args: pytest.fail("torchrun started"))
    train = str(ROOT / "train.py")
    cfg = str(ROOT / "configs" / "default.yaml")
    rdzv = ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"]
    assert main(["--nnodes=2", "--nproc_per_node=2", *rdzv, train, cfg, "parallel.shard_size=4"]) == 2
    assert "parallel.shard_size: 4 does not divide the ranks per node (2)" in capsys.readouterr().err
    assert main(["--nnodes=1:2", "--nproc_per_node=2", *rdzv, train, cfg, "comm.mode=loco"]) == 2
    err = capsys.readouterr().err
    assert "comm.mode=loco keeps per-rank exchange state" in err and "--nnodes=N, not a range" in err, err
    assert main(["--nnodes=1:2", "--nproc_per_node=2", *rdzv, train, cfg, "optim.name=lion", "comm.mode=auto",
                 "comm.auto_allow=[fp32,loco]"]) == 2
    assert "comm.mode=auto may pick loco (comm.auto_allow), which keeps" in capsys.readouterr().err
    monkeypatch.setattr(tdr, "run", lambda args: None)  # a fixed world: nothing to refuse, torchrun runs
    monkeypatch.setenv("LIONCUB_LAUNCHER", "")  # main() sets it for its ranks: undone after the test
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = log.level
    try:
        assert main(["--nnodes=2", "--nproc_per_node=2", *rdzv, train, cfg, "comm.mode=loco"]) == 0
    finally:
        log.setLevel(level)  # main() quiets torchrun's per-process lines
    assert [_world_may_change(parse_args([f"--nnodes={n}", "train.py"])) for n in ("1:1", "2", "1:2", "02:2")] == \
        [False, False, True, False]


def test_preflight_leaves_help_to_train_py(capsys):
    from launch.preflight import main

    assert main(["--world-may-change", "--fresh", "hint", "configs/default.yaml", "--help-config"]) == 0
    assert main(["--world", "2", "configs/default.yaml", "-h"]) == 0
    assert capsys.readouterr().err == ""
