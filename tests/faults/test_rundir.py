"""Overwrite and delete only what we made: the trainer's run directories (marker .lioncub_run)
and data.prepare's datasets (a manifest of ours, shards with valid headers)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from data.prepare import PrepareError, prepare_text
from tests.faults.common import records, run1


def snapshot(d: Path) -> dict[str, bytes]:
    """Every file under `d` (relative path -> bytes), directories as empty markers."""
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(d.rglob("*"))}


def project(d: Path) -> Path:
    d.mkdir()
    (d / "config.yaml").write_text("name: my project\n")
    (d / ".git").mkdir()
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / "src").mkdir()
    (d / "src" / "main.py").write_text("print('precious')\n")
    return d


@pytest.mark.parametrize("mode", ["overwrite", "auto"])
def test_a_foreign_directory_keeps_every_byte(tmp_path, mode):
    d = project(tmp_path / "proj")
    before = snapshot(d)
    proc = run1(d, "train.max_steps=2", f"train.resume={mode}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"train.resume={mode} refuses" in proc.stderr and "holds no .lioncub_run marker" in proc.stderr
    assert ".git" in proc.stderr and "src" in proc.stderr and "Traceback" not in proc.stderr
    assert snapshot(d) == before


def test_overwrite_names_entries_it_did_not_write_and_keeps_them(run_copy):
    (run_copy / "notes.txt").write_text("mine")
    (run_copy / "ckpt" / "best.pt").write_bytes(b"keep me")
    (run_copy / "ckpt" / "step_000004" / "evals").mkdir()  # inside a checkpoint: moved aside, then deleted
    (run_copy / "ckpt" / "step_000004" / "evals" / "hellaswag.json").write_text("{}")
    # a user's backup copy of a step: its meta.json lists its files, but the trainer never names a step so
    shutil.copytree(run_copy / "ckpt" / "step_000002", run_copy / "ckpt" / "step_000002_keep")
    before = snapshot(run_copy)
    proc = run1(run_copy, "train.max_steps=2", "train.resume=overwrite")
    assert proc.returncode == 2
    assert ("entries the trainer did not write: ckpt/best.pt, ckpt/step_000002_keep, "
            "ckpt/step_000004/evals/hellaswag.json, notes.txt" in proc.stderr), proc.stderr[-2000:]
    assert snapshot(run_copy) == before


def test_overwrite_names_a_users_file_in_the_writers_directories(run_copy):
    """tensorboard/, profile/, memory/ and wandb/ are the trainer's by name, not their contents: the
    names their writers give pass, a user's file among them is named and the run refused."""
    ours = {"tensorboard/events.out.tfevents.1764374108.host.4242.0": b"tb",
            "profile/rank1.steps_3-4.pt.trace.json": b"{}", "memory/rank0.pickle": b"snap",
            "wandb/offline-run-20261129_003508-run-45b6678adf07/files/config.yaml": b"wandb's",
            "wandb/debug.log": b"log", "wandb/debug-internal.log": b"log"}
    for name, data in ours.items():
        (run_copy / name).parent.mkdir(parents=True, exist_ok=True)
        (run_copy / name).write_bytes(data)
    (run_copy / "wandb" / "latest-run").symlink_to("offline-run-20261129_003508-run-45b6678adf07")
    mine = ["memory/notes.md", "profile/analysis.ipynb", "tensorboard/my_plot.png", "wandb/sweeps/grid.yaml"]
    for name in mine:
        (run_copy / name).parent.mkdir(parents=True, exist_ok=True)
        (run_copy / name).write_text("mine")
    before = snapshot(run_copy)
    proc = run1(run_copy, "train.max_steps=2", "train.resume=overwrite")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("entries the trainer did not write: memory/notes.md, profile/analysis.ipynb, tensorboard/my_plot.png, "
            "wandb/sweeps; nothing was touched" in proc.stderr), proc.stderr[-2000:]
    assert snapshot(run_copy) == before
    for name in mine:  # only the writers' own left: replaced
        (run_copy / name).unlink()
    (run_copy / "wandb" / "sweeps").rmdir()
    proc = run1(run_copy, "train.max_steps=2", "train.eval_every=0", "train.resume=overwrite")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (run_copy / "tensorboard").exists() and not (run_copy / "wandb").exists()


def test_a_fallback_past_a_step_holding_a_users_file_sets_it_aside_before_saving_that_step_again(run_copy):
    """resume=auto refuses to load a step directory holding a file its meta.json does not list and falls
    back to the one before; when training reaches that step again its new save must not delete the file."""
    step4 = run_copy / "ckpt" / "step_000004"
    (step4 / "notes.txt").write_text("lr looked too high here")
    old = snapshot(step4)
    proc = run1(run_copy, "train.max_steps=4", "train.ckpt_every=2", "train.eval_every=0", "train.resume=auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipped checkpoint step_000004" in proc.stdout + proc.stderr
    kept = run_copy / "ckpt" / "kept_step_000004"
    assert snapshot(kept) == old    # every byte, the user's file and the old save's
    assert "holds files no save wrote (notes.txt); saving step 4 again, it was moved to kept_step_000004/" in proc.stdout
    assert sorted(p.name for p in step4.iterdir()) == ["meta.json", "model.pt", "rank_00000.pt"]


def test_a_step_directory_whose_meta_cannot_be_read_is_judged_by_the_saves_names(run_copy):
    """A damaged meta.json lists nothing: the save's own names (model.pt, rank files, DCP shards) are
    still the trainer's, anything else is not."""
    from trainer.checkpoint import foreign_in_step

    step = run_copy / "ckpt" / "step_000004"
    assert foreign_in_step(step) == []
    (step / "meta.json").write_text("{not json")
    (step / "model").mkdir()
    for name in ("model/__0_0.distcp", "model/.metadata", "rank_00003.pt", "plot.png", "model/extra.txt"):
        (step / name).write_bytes(b"x")
    assert foreign_in_step(step) == ["model/extra.txt", "plot.png"]
    (step / "meta.json").write_text('{"step": 4, "world_size": 1}')  # an older version's: no "files"
    assert foreign_in_step(step) == ["model/extra.txt", "plot.png"]


def test_a_replaced_run_is_moved_aside_until_the_new_runs_first_checkpoint(run_copy):
    old_model = (run_copy / "ckpt" / "step_000004" / "model.pt").read_bytes()
    old_id = json.loads((run_copy / ".lioncub_run").read_text())["run_id"]
    # the new run diverges before its first checkpoint: the replaced run is still there, intact
    proc = run1(run_copy, "train.max_steps=40", "optim.lr=1e3", "train.ckpt_every=0", "train.resume=overwrite")
    assert proc.returncode == 3, proc.stderr[-2000:]
    aside = [p for p in run_copy.iterdir() if p.name.startswith(".replaced-")]
    assert len(aside) == 1 and "moved to .replaced-" in proc.stdout
    assert (aside[0] / "ckpt" / "step_000004" / "model.pt").read_bytes() == old_model
    assert not (run_copy / "ckpt").exists() or not list((run_copy / "ckpt").glob("step_*"))
    # a new run that saves a verified checkpoint retires it
    proc = run1(run_copy, "train.max_steps=2", "train.eval_every=0", "train.resume=overwrite")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not [p for p in run_copy.iterdir() if p.name.startswith(".replaced-")]
    assert "(the replaced run): checkpoint" in proc.stdout
    assert json.loads((run_copy / ".lioncub_run").read_text())["run_id"] != old_id
    assert [r["step"] for r in records(run_copy) if "train_loss" in r] == [1, 2]


def test_an_unwritable_out_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run1(blocker / "run", "train.max_steps=2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "cannot write the run directory" in proc.stderr and "train.out_dir" in proc.stderr
    if os.geteuid() != 0:  # root writes through permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        proc = run1(ro / "run", "train.max_steps=2")
        assert proc.returncode == 2 and "cannot write the run directory" in proc.stderr


DOCS = ["the cat sat on the mat " * 20, "a dog ran in the park " * 20, "birds sing in the morning " * 20]


@pytest.fixture
def prepared(tmp_path) -> tuple[Path, dict]:
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    kw = dict(val_fraction=0, shard_tokens=100, num_proc=1, cache_dir=str(tmp_path / "hf"))
    return tmp_path, kw


def test_prepare_overwrite_refuses_a_manifest_it_did_not_write(prepared):
    tmp_path, kw = prepared
    d = tmp_path / "fake"
    d.mkdir()
    (d / "manifest.json").write_text("{}")
    (d / "train_000000.bin").write_bytes(b"my thesis, not a shard")
    before = snapshot(d)
    with pytest.raises(PrepareError, match=r"manifest.json is not one data.prepare wrote"):
        prepare_text(d, [tmp_path / "docs.jsonl"], overwrite=True, **kw)
    assert snapshot(d) == before


def test_prepare_overwrite_refuses_a_shard_named_file_without_a_valid_header(prepared):
    tmp_path, kw = prepared
    d = tmp_path / "ours"
    prepare_text(d, [tmp_path / "docs.jsonl"], **kw)
    (d / "val_000009.bin").write_bytes(b"not a shard at all")
    before = snapshot(d)
    with pytest.raises(PrepareError, match=r"val_000009.bin \(named like a shard, but its header is not one\)"):
        prepare_text(d, [tmp_path / "docs.jsonl"], overwrite=True, **kw)
    assert snapshot(d) == before
    (d / "val_000009.bin").unlink()
    assert prepare_text(d, [tmp_path / "docs.jsonl"], overwrite=True, **kw)["splits"]["train"]["tokens"] > 0


def test_overwrite_says_when_what_it_refuses_is_a_variant_run_inside(tmp_path):
    """train.py base.yaml variant.yaml trains in <base out_dir>/<variant>: overwriting the base run refuses that
    nested run's directory (replacing would move it aside and later delete it) and says what it is."""
    from trainer import rundir

    base = tmp_path / "base"
    (base / "lioncub_1bit").mkdir(parents=True)
    for d in (base, base / "lioncub_1bit"):
        (d / rundir.MARKER).write_text("{}")
    msg = rundir._refusal(base, "overwrite")
    assert "lioncub_1bit: another run's directory" in msg and "<out_dir>/<variant>" in msg
    (base / "notes").mkdir()   # a plain directory is named, not explained as a run
    assert "notes: another run's" not in rundir._refusal(base, "overwrite")
