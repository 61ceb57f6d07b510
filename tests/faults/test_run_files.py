"""A run's own files of the wrong shape: comm.mode=auto's auto_mode.json. Valid JSON that is not a
decision (edited by hand, another program's file) stops the resumed run with one line naming the
file and the fix, exit 2, no traceback, before anything in the run directory is touched."""
from __future__ import annotations

import json

import pytest

from tests.faults.common import run1
from trainer.rundir import MARKER

BAD = {
    "a list": [1, 2],
    "no sections": {"variant": "lion_fp32", "mode": "fp32", "predicted_step_s": 0.1},
    "a step time as text": {"variant": "lion_fp32", "mode": "fp32", "sections": {}, "predicted_step_s": "fast"},
    "sections of lists": {"variant": "lion_fp32", "mode": "fp32", "sections": {"comm": []}, "predicted_step_s": 0.1},
}


@pytest.mark.parametrize("what", list(BAD))
def test_an_auto_mode_decision_of_the_wrong_shape_is_one_line_naming_the_file(tmp_path, what):
    out = tmp_path / "run"
    ckpt = out / "ckpt" / "step_000002"  # a checkpoint: the run resumes, so it reads the stored decision
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text("{}")
    (out / MARKER).write_text(json.dumps({"run_id": "run-0"}) + "\n")  # the trainer's directory
    decision = out / "auto_mode.json"
    decision.write_text(json.dumps(BAD[what]))
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    proc = run1(out, "comm.mode=auto", "comm.auto_allow=[fp32]", "train.resume=auto", "train.max_steps=4",
                "comm.kernels=eager")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert str(decision) in lines[0] and "comm.auto_remeasure=true" in lines[0], lines[0]
    assert "measuring links" not in proc.stdout
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing written or removed
    assert json.loads(decision.read_text()) == BAD[what]


@pytest.mark.parametrize("resume", ["never", "overwrite"])
def test_comm_mode_auto_refuses_a_run_directory_before_measuring(tmp_path, resume):
    """A directory the run will refuse (it exists under resume=never; overwrite would move a user's file) is
    refused before comm.mode=auto's measurements (seconds to minutes of them on a large model), not after."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    proc = run1(out, "comm.mode=auto", "comm.auto_allow=[fp32]", f"train.resume={resume}", "train.max_steps=4")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "measuring links" not in proc.stdout and "Traceback" not in proc.stderr, proc.stdout[-2000:]
    assert f"refuses {out}" in proc.stderr or "already exists and is not empty" in proc.stderr, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
