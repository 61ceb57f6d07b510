"""The divergence policies end: skip_step gives up after train.max_skipped_steps consecutive
skipped steps, and rollback gives up when the same step fails again after its batches were
skipped; both exit 3, keep the last good checkpoint and end the metrics with the diverged event."""
from __future__ import annotations

import torch

from bench.reproduce.framework import diverged_at
from tests.faults.common import records, run1
from trainer.state import DIVERGED_EVENT


def _good_checkpoints(run):
    for d in sorted((run / "ckpt").glob("step_*")):
        sd = torch.load(d / "model.pt", map_location="cpu", weights_only=True)
        assert all(torch.isfinite(t).all() for t in sd.values()), d
        yield int(d.name[5:])


def test_skip_step_stops_at_the_cap(tmp_path):
    run = tmp_path / "run"
    proc = run1(run, "optim.lr=1e3", "train.max_steps=60", "train.eval_every=0", "train.ckpt_every=1",
                "train.keep_ckpts=2", "train.on_nonfinite=skip_step", "train.max_skipped_steps=3")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "3 consecutive steps" in proc.stderr and "train.max_skipped_steps=3" in proc.stderr
    bad = [r["step"] for r in records(run) if r.get("event") == "nonfinite"]
    assert len(bad) >= 3 and bad[-3:] == list(range(bad[-1] - 2, bad[-1] + 1))
    assert not any("train_loss" in r and r["step"] > bad[-1] for r in records(run))  # nothing after the cap
    # the last record says the policy stopped the run (a launcher's exit code does not carry the 3)
    assert diverged_at(records(run)) == bad[-1] and records(run)[-1]["event"] == DIVERGED_EVENT
    good = list(_good_checkpoints(run))
    assert good and good[-1] < bad[-3]  # the last good checkpoint is kept


def test_rollback_stops_when_the_same_step_fails_again(tmp_path):
    run = tmp_path / "run"
    proc = run1(run, "optim.lr=1e3", "train.max_steps=60", "train.eval_every=0", "train.ckpt_every=1",
                "train.keep_ckpts=2", "train.on_nonfinite=rollback")
    assert proc.returncode == 3, proc.stderr[-2000:]
    bad = [r["step"] for r in records(run) if r.get("event") == "nonfinite"]
    assert len(bad) == 2 and bad[0] == bad[1], bad  # one rollback, then the same step failed again
    assert f"at step {bad[0]} again after a rollback that skipped its batches" in proc.stderr
    assert proc.stdout.count("rolled back") == 1
    assert list(_good_checkpoints(run))[-1] == bad[0] - 1
    assert diverged_at(records(run)) == bad[0]
