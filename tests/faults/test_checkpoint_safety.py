"""No code from a checkpoint, no silent use of a damaged model.

A checkpoint file is a pickle; its sha256 in meta.json proves integrity, not origin (whoever can
write the file can update meta.json). Each crafted file here would create SENTINEL if any loader
let the pickle call code; every reader (resume, rollback, export, sample, eval) must refuse it,
name it, and fall back to the newest intact checkpoint, as for a garbled, truncated or
non-finite one.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.dist import torchrun
from tests.faults.common import cli, craft, garble, poison_model, records, run1


def _one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_crafted_rank_file_runs_nothing_on_resume_and_the_older_checkpoint_is_used(run_copy, tmp_path):
    sentinel = tmp_path / "pwned"
    craft(run_copy / "ckpt" / "step_000004", "rank_00000.pt", sentinel)
    proc = run1(run_copy, "train.max_steps=6", "train.ckpt_every=2", "train.eval_every=0", "train.resume=auto")
    assert not sentinel.exists()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped checkpoint step_000004:" in proc.stdout and "rank_00000.pt: refused to load" in proc.stdout
    assert "step_000002 at step 2" in proc.stdout


def test_crafted_files_everywhere_refuse_the_resume_in_one_line(run_copy, tmp_path):
    sentinel = tmp_path / "pwned"
    for step in ("step_000002", "step_000004"):
        craft(run_copy / "ckpt" / step, "model.pt", sentinel)
    proc = run1(run_copy, "train.max_steps=6", "train.resume=auto")
    assert not sentinel.exists()
    assert proc.returncode == 2
    line = _one_line(proc.stderr)
    assert "found no intact checkpoint" in line and "step_000004/model.pt: refused to load" in line


def test_crafted_checkpoint_runs_nothing_on_rollback(tmp_path):
    out, sentinel = tmp_path / "run", tmp_path / "pwned"
    proc = torchrun(1, "crafted_rollback.py", str(out), str(sentinel), timeout=240)
    assert not sentinel.exists()
    res = json.loads((out / "result.json").read_text())
    assert res["error"] is None and res["step"] == 7, res
    assert "skipped checkpoint step_000004:" in proc.stdout and "refused to load" in proc.stdout
    assert "rolled back: resumed from" in proc.stdout and "step_000002 at step 2" in proc.stdout
    assert [r["step"] for r in records(out) if r.get("event") == "nonfinite"] == [5]


READERS = {
    "export": lambda run, tmp: ("model.export", run, "--out", tmp / "hf"),
    "sample": lambda run, tmp: ("sample", run, "--prompt", "The", "--max-new-tokens", "2", "--device", "cpu"),
    "eval": lambda run, tmp: ("eval", "val", run, "--data", "builtin", "--batches", "1", "--batch-size", "1",
                              "--seq-len", "16", "--device", "cpu", "--json"),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_readers_refuse_a_crafted_model_and_fall_back(run_copy, tmp_path, reader):
    sentinel = tmp_path / "pwned"
    craft(run_copy / "ckpt" / "step_000004", "model.pt", sentinel)
    proc = cli(*READERS[reader](run_copy, tmp_path))
    assert not sentinel.exists()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped checkpoint step_000004:" in proc.stderr and "model.pt: refused to load" in proc.stderr
    assert f"using checkpoint {run_copy / 'ckpt' / 'step_000002'}" in proc.stderr
    # the checkpoint directory named directly: refused in one line, nothing run
    (tmp_path / "direct").mkdir()
    proc = cli(*READERS[reader](run_copy / "ckpt" / "step_000004", tmp_path / "direct"))
    assert not sentinel.exists()
    assert proc.returncode == 2
    assert "step_000004/model.pt: refused to load" in _one_line(proc.stderr)


@pytest.mark.parametrize("damage,reader", [("garble", "export"), ("truncate", "sample"), ("nonfinite", "eval"),
                                           ("missing", "export")])
def test_a_damaged_latest_model_makes_readers_fall_back_and_say_so(run_copy, tmp_path, damage, reader):
    latest = run_copy / "ckpt" / "step_000004"
    f = latest / "model.pt"
    if damage == "garble":
        garble(f)
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "nonfinite":
        poison_model(latest)
    else:
        f.unlink()
    proc = cli(*READERS[reader](run_copy, tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    why = {"garble": "is corrupt: sha256", "truncate": "is corrupt: sha256", "nonfinite": "holds non-finite values",
           "missing": "is missing"}[damage]
    assert f"skipped checkpoint step_000004: {f} {why}" in proc.stderr, proc.stderr
    assert f"using checkpoint {run_copy / 'ckpt' / 'step_000002'}" in proc.stderr
    if reader == "export":
        assert "(step 2)" in proc.stdout
        assert (tmp_path / "hf" / "model.safetensors").is_file()
    if reader == "eval":
        assert np.isfinite(json.loads(proc.stdout)["loss"])


def test_every_checkpoint_damaged_is_one_line_and_exit_2(run_copy, tmp_path):
    for step in ("step_000002", "step_000004"):
        f = run_copy / "ckpt" / step / "model.pt"
        f.write_bytes(f.read_bytes()[:1000])
    proc = cli(*READERS["export"](run_copy, tmp_path))
    assert proc.returncode == 2 and not (tmp_path / "hf").exists()
    line = _one_line(proc.stderr)
    assert "no intact checkpoint in" in line and "step_000002" in line and "step_000004" in line


def test_a_checkpoint_of_the_older_format_still_resumes(run_copy):
    """Before RNG state was stored as tensors, numpy's generator state was an ndarray in a tuple:
    the numpy-only allow-list reads it, and the resumed run goes on."""
    ckpt = run_copy / "ckpt" / "step_000004"
    state = torch.load(ckpt / "rank_00000.pt", map_location="cpu", weights_only=True)
    assert isinstance(state["rng"]["numpy"], dict) and isinstance(state["rng"]["numpy"]["keys"], torch.Tensor)
    np.random.seed(7)
    state["rng"]["numpy"] = np.random.get_state()  # the older layout
    torch.save(state, ckpt / "rank_00000.pt")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"]["rank_00000.pt"] = hashlib.sha256((ckpt / "rank_00000.pt").read_bytes()).hexdigest()
    (ckpt / "meta.json").write_text(json.dumps(meta))
    proc = run1(run_copy, "train.max_steps=5", "train.eval_every=0", "train.resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_000004 at step 4" in proc.stdout and "skipped" not in proc.stdout
