"""A sharded run's checkpoint (parallel.shard_size > 1: the model as torch.distributed.checkpoint
files under step_NNNNNN/model/) is read as safely as model.pt: DCP's `.metadata` is a pickle, and
a crafted one must run nothing in any of the five readers (resume, model.export, sample, eval,
model.init_from), whether meta.json lists it (resealed with its new sha256) or not (its entry
deleted: an unlisted file is refused by name). A run directory falls back to the previous intact
checkpoint; a checkpoint directory named directly is refused in one line, exit 2.
"""
from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dist import ROOT, torchrun
from tests.faults.common import TINY, _Payload, _reseal, cli, run1

SHARDED = ["configs/default.yaml", *TINY, "parallel.shard_size=2", "train.eval_every=0"]


def _one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def train2(out: Path, *overrides: str, check: bool = True):
    """train.py on 2 ranks at parallel.shard_size=2 (one replica of 2 shards)."""
    return torchrun(2, ROOT / "train.py", *SHARDED, f"train.out_dir={out}", *overrides, timeout=300, check=check)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Iterator[Path]:
    """The sharded run (checkpoints at steps 2 and 4) in place of conftest.py's: its `run_copy` copies this one."""
    run = tmp_path_factory.mktemp("sharded") / "run"
    train2(run, "train.max_steps=4", "train.ckpt_every=2")
    assert (run / "ckpt" / "step_000004" / "model" / ".metadata").is_file()
    yield run
    shutil.rmtree(run, ignore_errors=True)


def craft_metadata(ckpt: Path, sentinel: Path, listed: bool) -> None:
    """Replace model/.metadata by a pickle that creates `sentinel` when unpickled; reseal meta.json
    with its sha256 (listed) or delete its entry (not listed)."""
    (ckpt / "model" / ".metadata").write_bytes(pickle.dumps(_Payload(sentinel)))
    if listed:
        _reseal(ckpt, "model/.metadata")
    else:
        meta = json.loads((ckpt / "meta.json").read_text())
        del meta["files"]["model/.metadata"]
        (ckpt / "meta.json").write_text(json.dumps(meta))


READERS = {
    "export": lambda src, tmp: cli("model.export", src, "--out", tmp / "hf"),
    "sample": lambda src, tmp: cli("sample", src, "--prompt", "The", "--max-new-tokens", "2", "--device", "cpu"),
    "eval": lambda src, tmp: cli("eval", "val", src, "--data", "builtin", "--batches", "1", "--batch-size", "1",
                                 "--seq-len", "16", "--device", "cpu", "--json"),
    "init_from": lambda src, tmp: run1(tmp / "new", "train.max_steps=1", "train.eval_every=0",
                                       f"model.init_from={src}"),
}


@pytest.mark.parametrize("listed", [True, False], ids=["resealed", "unlisted"])
@pytest.mark.parametrize("reader", list(READERS))
def test_crafted_dcp_metadata_runs_nothing_in_any_reader(run_copy, tmp_path, reader, listed):
    sentinel = tmp_path / "pwned"
    craft_metadata(run_copy / "ckpt" / "step_000004", sentinel, listed)
    why = "is not listed in"
    # a run directory: the crafted checkpoint is skipped by name, the previous one is used
    proc = READERS[reader](run_copy, tmp_path)
    assert not sentinel.exists(), "the crafted .metadata ran code"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped checkpoint step_000004:" in proc.stderr and "model/.metadata" in proc.stderr, proc.stderr
    assert ("refused to load" if listed else why) in proc.stderr, proc.stderr
    assert f"using checkpoint {run_copy / 'ckpt' / 'step_000002'}" in proc.stderr
    # the checkpoint directory named directly: one line, exit 2, nothing run
    (tmp_path / "direct").mkdir()
    proc = READERS[reader](run_copy / "ckpt" / "step_000004", tmp_path / "direct")
    assert not sentinel.exists(), "the crafted .metadata ran code"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "step_000004/model/.metadata" in _one_line(proc.stderr)


@pytest.mark.parametrize("listed", [True, False], ids=["resealed", "unlisted"])
def test_crafted_dcp_metadata_runs_nothing_on_resume_and_the_older_checkpoint_is_used(run_copy, tmp_path, listed):
    sentinel = tmp_path / "pwned"
    craft_metadata(run_copy / "ckpt" / "step_000004", sentinel, listed)
    proc = train2(run_copy, "train.max_steps=5", "train.resume=auto", check=False)
    assert not sentinel.exists(), "the crafted .metadata ran code"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped checkpoint step_000004:" in proc.stdout and "model/.metadata" in proc.stdout, proc.stdout
    assert "step_000002 at step 2" in proc.stdout


def test_a_file_meta_json_does_not_list_is_refused_by_name(run_copy, tmp_path):
    """Any file in a checkpoint directory must be one its save recorded: an extra one (here a
    second DCP shard file, which DCP itself would happily ignore or read) is named and the
    checkpoint skipped, by the resume and by the readers."""
    extra = run_copy / "ckpt" / "step_000004" / "model" / "__7_0.distcp"
    extra.write_bytes(b"not ours")
    proc = READERS["export"](run_copy, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{extra} is not listed in" in proc.stderr, proc.stderr
    proc = train2(run_copy, "train.max_steps=5", "train.resume=auto", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{extra} is not listed in" in proc.stdout and "step_000002 at step 2" in proc.stdout, proc.stdout


def test_crafted_dcp_metadata_in_every_checkpoint_stops_the_resume_in_one_line(run_copy, tmp_path):
    sentinel = tmp_path / "pwned"
    for step in ("step_000002", "step_000004"):
        craft_metadata(run_copy / "ckpt" / step, sentinel, listed=True)
    proc = train2(run_copy, "train.max_steps=5", "train.resume=auto", check=False)
    assert not sentinel.exists(), "the crafted .metadata ran code"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # one line per rank, "error (rank r): " and the same text
    lines = {x.split("): ", 1)[-1] for x in proc.stderr.strip().splitlines() if x.strip()}
    assert len(lines) == 1, lines
    (line,) = lines
    assert "found no intact checkpoint" in line and "step_000004/model/.metadata: refused to load" in line, line
