"""Checkpoint layout (trainer/checkpoint.py): state identical on every rank is written once.

Under gradient sync every rank steps one shared optimizer state, so rank 0's file holds it whole
and the other ranks' files only their per-rank entries (step counter, exchange state); meta.json
names the file that holds it. Update-sync optimizers (per-rank momenta) keep every rank's state.
A resume reads the new layout, a checkpoint written by an older version (every rank's whole state
in its own file: built here by hand exactly as that code wrote it), and resumes on another world
size; the damaged shared file is reported and the previous checkpoint used."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.dist import ROOT, torchrun
from tests.faults.common import TINY, records

COMMON = [*TINY, "train.max_steps=4", "train.ckpt_every=2"]


def _train(nproc: int, out: Path, *extra: str):
    return torchrun(nproc, ROOT / "train.py", "configs/default.yaml", *COMMON, f"train.out_dir={out}", *extra,
                    timeout=300)


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train_loss"]) for r in records(run) if "train_loss" in r]


def _digest(run: Path) -> str:
    recs = [r for r in records(run) if "param_sha256" in r]
    assert recs and recs[-1]["params_identical"], recs
    return recs[-1]["param_sha256"][0]


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _to_old_layout(ckpt: Path) -> None:
    """Rewrite a checkpoint as the previous version wrote it: every rank file holds that rank's whole
    optimizer state (rank 0's shared entries plus its own per-rank ones), meta.json has no
    optimizer_shared and lists every file's sha256."""
    meta = json.loads((ckpt / "meta.json").read_text())
    shared = meta.pop("optimizer_shared")
    whole = _load(ckpt / shared)["optimizer"]
    for r in range(meta["world_size"]):
        name = f"rank_{r:05d}.pt"
        if name == shared:
            continue
        state = _load(ckpt / name)
        state["optimizer"] = {**whole, **state["optimizer"]}
        torch.save(state, ckpt / name)
        meta["files"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / "meta.json").write_text(json.dumps(meta, indent=2))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("straight") / "run"
    _train(2, out)
    yield out
    shutil.rmtree(out, ignore_errors=True)


def test_gradient_sync_writes_the_shared_optimizer_state_once(straight):
    ckpt = straight / "ckpt" / "step_000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta.get("optimizer_shared") == "rank_00000.pt"
    r0, r1 = _load(ckpt / "rank_00000.pt"), _load(ckpt / "rank_00001.pt")
    assert set(r1["optimizer"]) == {"comm"} and r1["optimizer"]["comm"]["rank"] == 1
    assert "state" in r0["optimizer"] and r0["optimizer"]["comm"]["rank"] == 0
    assert set(r1) == set(r0)  # loader, RNG, step, ...: per rank as before
    assert (ckpt / "rank_00001.pt").stat().st_size < (ckpt / "rank_00000.pt").stat().st_size / 20


@pytest.mark.parametrize("layout", ["new", "old"])
def test_resume_from_the_new_and_the_old_layout_continues_bit_for_bit(straight, tmp_path, layout):
    split = tmp_path / "split"
    _train(2, split, "train.stop_after=2")
    if layout == "old":
        _to_old_layout(split / "ckpt" / "step_000002")
        assert "optimizer" in _load(split / "ckpt" / "step_000002" / "rank_00001.pt") and \
            "state" in _load(split / "ckpt" / "step_000002" / "rank_00001.pt")["optimizer"]
    proc = _train(2, split, "train.resume=auto")
    assert "resumed from" in proc.stdout and "step_000002" in proc.stdout and "skipped" not in proc.stdout
    assert "global batch" not in proc.stdout           # the same world size: nothing to warn about
    assert _losses(split) == _losses(straight)
    assert _digest(split) == _digest(straight)


def test_resume_on_another_world_size_from_the_new_layout(tmp_path):
    from trainer.checkpoint import find_resumable

    run = tmp_path / "run"
    _train(2, run, "train.stop_after=2")
    # on 1 rank the resume needs both old rank files (checked) but holds only rank 0's and the shared
    # state: trainer/state.py reads the others one at a time when their states are combined
    path, meta, files = find_resumable(run / "ckpt", 0, 1, report=lambda line: None)
    assert meta.get("optimizer_shared") and int(meta["world_size"]) == 2
    assert sorted(files) == sorted({"model.pt", "rank_00000.pt", meta["optimizer_shared"]}), sorted(files)
    proc = _train(1, run, "train.resume=auto")
    assert "written by 2 ranks, resumed on 1" in proc.stdout
    assert [s for s, _ in _losses(run)] == [1, 2, 3, 4]
    # the global batch halves: said, with how to keep it
    [warn] = [ln for ln in proc.stdout.splitlines() if "global batch" in ln]
    assert warn.startswith("warning: the global batch is now ") and warn.endswith("resume on the checkpoint's 2 rank(s) to keep it"), warn
    now, was = [int(x.replace(",", "")) for x in re.findall(r"\b\d[\d,]*\b", warn)][:2]
    assert was == 2 * now


def test_an_old_rank_file_failing_its_second_read_on_one_rank_stops_every_rank(tmp_path):
    """Resumed on another world size, a rank reads the old rank files it does not keep a second time, one at a
    time, after every rank agreed the checkpoint is intact. A file that fails that read on rank 1 only (changed
    since) stops both ranks with rank 1's message: rank 0 must not go on into training and wait there."""
    run = tmp_path / "run"
    _train(3, run, "comm.mode=onebit", "train.stop_after=2")
    proc = torchrun(2, "resume_reread_fails.py", str(run), timeout=240, check=False)
    said = [json.loads((run / f"reread_{r}.json").read_text()) for r in range(2)]
    assert all(s["type"] == "CheckpointError" for s in said), (said, proc.stderr[-3000:])
    assert "it changed since" in said[1]["text"] and "rank_0000" in said[1]["text"], said[1]
    assert said[0]["text"].startswith("rank 1: ") and "it changed since" in said[0]["text"], said[0]


def test_a_damaged_shared_file_is_reported_and_the_previous_checkpoint_used(tmp_path):
    run = tmp_path / "run"
    _train(2, run, "train.stop_after=4", "train.max_steps=6")
    shared = run / "ckpt" / "step_000004" / "rank_00000.pt"
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shared.write_bytes(bytes(data))
    proc = _train(2, run, "train.resume=auto", "train.max_steps=6")
    assert "skipped checkpoint step_000004" in proc.stdout and "rank_00000.pt is corrupt" in proc.stdout
    assert "resumed from" in proc.stdout and "step_000002" in proc.stdout


def test_update_sync_keeps_every_ranks_state(tmp_path):
    run = tmp_path / "run"
    _train(2, run, "comm.mode=onebit", "train.max_steps=2")
    ckpt = run / "ckpt" / "step_000002"
    assert "optimizer_shared" not in json.loads((ckpt / "meta.json").read_text())
    m0, m1 = (_load(ckpt / f"rank_{r:05d}.pt")["optimizer"] for r in (0, 1))
    assert "state" in m1 and not torch.equal(m0["state"][0]["exp_avg"], m1["state"][0]["exp_avg"])


# ---- train.async_ckpt: written in the background, verified and resumed like a synchronous save ----------
def test_async_checkpoints_are_the_synchronous_ones_and_resume_bit_for_bit(tmp_path):
    sync, bg = tmp_path / "sync", tmp_path / "async"
    _train(2, sync, "train.max_steps=6", "train.keep_ckpts=5")
    _train(2, bg, "train.max_steps=6", "train.keep_ckpts=5", "train.async_ckpt=true", "train.stop_after=4")
    assert sorted(p.name for p in (bg / "ckpt").iterdir()) == ["latest", "step_000002", "step_000004"]
    for step in ("step_000002", "step_000004"):  # the same files listed in meta.json; the same model bytes
        a = json.loads((sync / "ckpt" / step / "meta.json").read_text())["files"]
        b = json.loads((bg / "ckpt" / step / "meta.json").read_text())["files"]
        assert set(a) == set(b) == {"model.pt", "rank_00000.pt", "rank_00001.pt"}
        assert a["model.pt"] == b["model.pt"]  # the snapshot keeps the tied weight's one storage
        for r in ("rank_00000.pt", "rank_00001.pt"):  # the rank files differ in train_time only
            x, y = _load(sync / "ckpt" / step / r), _load(bg / "ckpt" / step / r)
            assert x["optimizer"]["comm"]["step"] == y["optimizer"]["comm"]["step"]
            assert x["loader"] == y["loader"] and x["step"] == y["step"]
    proc = _train(2, bg, "train.max_steps=6", "train.keep_ckpts=5", "train.async_ckpt=true", "train.resume=auto")
    assert "resumed from" in proc.stdout and "step_000004" in proc.stdout
    assert _losses(bg) == _losses(sync) and _digest(bg) == _digest(sync)
    # a damaged background checkpoint is skipped like any other
    latest = bg / "ckpt" / "step_000006" / "rank_00001.pt"
    latest.write_bytes(latest.read_bytes()[:100])
    proc = _train(2, bg, "train.max_steps=8", "train.keep_ckpts=5", "train.async_ckpt=true", "train.resume=auto")
    assert "skipped checkpoint step_000006" in proc.stdout and "step_000004 at step 4" in proc.stdout


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failed_background_save_is_reported_and_never_marked_intact(tmp_path, fail_rank):
    out = tmp_path / "run"
    proc = torchrun(2, "async_ckpt_failure.py", str(out), str(fail_rank), timeout=300)
    assert "checkpoint step 4: the background save failed: disk full while writing" in proc.stderr
    for r in (0, 1):  # every rank stops at the next wait, naming the step
        res = json.loads((out / f"result_{r}.json").read_text())
        assert res["error"] and "background save of checkpoint step 4 failed" in res["error"], res
    assert not (out / "ckpt" / "step_000004").exists()
    assert (out / "ckpt" / "latest").read_text().strip() == "step_000002"
    proc = _train(2, out, "train.max_steps=6", "train.resume=auto")
    assert "resumed from" in proc.stdout and "step_000002 at step 2" in proc.stdout


def test_a_rollback_waits_for_the_background_save_in_flight(tmp_path):
    out = tmp_path / "run"
    torchrun(2, "async_ckpt_rollback.py", str(out), timeout=300)
    res = json.loads((out / "result.json").read_text())
    assert res["error"] is None and res["step"] == 6, res
    assert len(res["rollback"]) == 1 and "step_000004 at step 4" in res["rollback"][0], res["rollback"]
