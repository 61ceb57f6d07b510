"""A SIGTERM is acted on at the next step, whatever train.log_every is: the stop flag rides on the
step's guard collective. The run checkpoints, releases its lock and exits 0 well within a
launcher's grace period."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from tests.dist import ROOT, torchrun
from tests.faults.common import ENV, TINY


def test_sigterm_with_log_every_40_checkpoints_within_10_s(tmp_path):
    run = tmp_path / "run"
    args = [a for a in TINY if not a.startswith("train.log_every")]
    proc = subprocess.Popen([sys.executable, "train.py", "configs/default.yaml", *args, f"train.out_dir={run}",
                             "train.max_steps=100000", "train.log_every=40", "train.eval_every=0",
                             "train.ckpt_every=0"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        # the first train record (step 40): training runs, and the next log step is 40 steps away
        while time.time() < deadline and '"train_loss"' not in ((run / "metrics.jsonl").read_text()
                                                                if (run / "metrics.jsonl").exists() else ""):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.time() - t0
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert took < 10, took
    assert "stopping (signal 15)" in out
    meta = json.loads((run / "ckpt" / (run / "ckpt" / "latest").read_text().strip() / "meta.json").read_text())
    assert 40 <= meta["step"] < 80  # acted on before the next log step (80)
    assert not (run / ".lock").exists()


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    proc = torchrun(2, "stop_one_rank.py", str(out), "1", "3", timeout=240)
    res = json.loads((out / "result.json").read_text())
    assert res["stopped"] and res["steps"] == [3, 3] and res["identical"], res
    assert "stopping (a signal on another rank) at step 3" in proc.stdout  # rank 0 logs; rank 1 had the signal
    assert (out / "ckpt" / "latest").read_text().strip() == "step_000003"
