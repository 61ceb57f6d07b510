"""Provenance and the console: git commit with a dirty flag, package, torch / CUDA /
NCCL versions and the host in the first console line and in <out_dir>/provenance.json (one entry per
start); the init_from and data.mix lines; a one-line diagnostics summary at log steps."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.dist import ROOT, torchrun
from trainer import provenance
from trainer.logger import RunLogger, diag_summary

TINY = ["model.preset=debug", "data.batch_size=4", "data.seq_len=64", "train.eval_steps=2", "log.wandb=disabled"]


def test_collect_names_the_commit_the_dirty_flag_and_the_versions(tmp_path):
    import torch

    p = provenance.collect()
    if shutil.which("git") and (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        assert p["commit"] == head and isinstance(p["dirty"], bool)
    assert p["torch"] == torch.__version__ and p["cuda"] == torch.version.cuda and p["host"]
    assert p["package"] == "lioncub-train" and p["version"].startswith("0.")
    line = provenance.console_line(p)
    assert line.startswith(f"code lioncub-train {p['version']} ") and f"torch {torch.__version__} CUDA " in line
    assert (p["commit"] or "unknown")[:12] in line and f"host {p['host']}" in line
    dirty = provenance.console_line({**p, "commit": "a" * 40, "dirty": True, "changed_files": 3})
    assert "git aaaaaaaaaaaa (dirty: 3 changed file(s))" in dirty
    assert "(clean)" in provenance.console_line({**p, "commit": "a" * 40, "dirty": False, "changed_files": 0})
    # every start adds an entry
    provenance.record(tmp_path, p)
    provenance.record(tmp_path, p, step=5)
    starts = json.loads((tmp_path / "provenance.json").read_text())["starts"]
    assert [s["step"] for s in starts] == [0, 5] and starts[0]["commit"] == p["commit"]


def test_diagnostics_summary_follows_its_train_line(tmp_path, capsys):
    rec = {"step": 10, "diag/sign_match": 0.9731, "diag/sign_flip": 0.0042, "diag/tie_rate": 0.0213,
           "diag/sign_match/attn": 0.5, "diag/seconds": 0.012}
    assert diag_summary(rec) == "diag       10 | sign match 0.9731 | flip 0.0042 | tie rate 0.0213 | 12 ms"
    assert diag_summary({"step": 3, "diag/seconds": 0.1}) is None
    log = RunLogger(tmp_path, True, "disabled", "p", "r", "", {})
    train = {"step": 10, "train_loss": 5.0}
    log.log(train)
    log.log(rec)  # the same step: printed at once, after the train line the trainer printed
    assert capsys.readouterr().out.strip() == diag_summary(rec)
    log.log({**rec, "step": 13})  # not a log step: waits for the next train line
    assert capsys.readouterr().out == ""
    log.log({**train, "step": 20})
    assert capsys.readouterr().out.strip() == diag_summary({**rec, "step": 13})
    log.close()
    assert json.loads((tmp_path / "provenance.json").read_text())["starts"][0]["argv"]


def test_console_shows_provenance_mix_resume_init_and_diagnostics(tmp_path):
    run = tmp_path / "run"
    args = [str(ROOT / "configs/default.yaml"), *TINY, "comm.mode=onebit", "diag.every=2", "train.log_every=2",
            "data.mix={builtin: 1.0}", f"train.out_dir={run}"]
    out = torchrun(2, ROOT / "train.py", *args, "train.max_steps=2").stdout
    lines = out.splitlines()
    first = next(i for i, l in enumerate(lines) if l.startswith("code lioncub-train "))
    assert re.match(r"code lioncub-train \S+ git [0-9a-f]{12} \((clean|dirty: \d+ changed file\(s\))\) \| python "
                    r"\S+ torch \S+ CUDA \S+ NCCL \S+ numpy \S+ \| host \S+", lines[first]), lines[first]
    assert any(l.startswith("data mix builtin x1 (") for l in lines), out
    train2 = next(i for i, l in enumerate(lines) if l.startswith("step      2/2 | loss"))
    assert re.match(r"diag \s+2 \| sign match \d\.\d{4} \| flip \d\.\d{4} \| tie rate \d\.\d{4} \| momentum spread",
                    lines[train2 + 1]), out
    starts = json.loads((run / "provenance.json").read_text())["starts"]
    assert len(starts) == 1 and starts[0]["torch"] and "commit" in starts[0]

    out = torchrun(2, ROOT / "train.py", *args, "train.max_steps=3", "train.resume=auto").stdout
    assert re.search(r"resumed from \S+step_000002 at step 2", out), out
    assert len(json.loads((run / "provenance.json").read_text())["starts"]) == 2

    out = torchrun(2, ROOT / "train.py", str(ROOT / "configs/default.yaml"), *TINY, f"model.init_from={run}",
                   "train.max_steps=1", f"train.out_dir={tmp_path / 'init'}").stdout
    assert f"| initialised from {run}" in out, out


def test_a_mix_scored_on_none_of_its_sources_says_so():
    from trainer.config import load_config
    from trainer.logger import mix_val_note

    mine = load_config([str(ROOT / "configs/default.yaml")], ["data.mix={/data/a: 1, /data/b: 1}"])
    note = mix_val_note(mine, "/cache/builtin", {"/data/a": "/data/a", "/data/b": "/data/b"})
    assert note.startswith("data.mix validates on data.dataset=builtin, which is none of the mix's sources")
    scored = load_config([str(ROOT / "configs/default.yaml")], ["data.mix={/data/a: 1}", "data.dataset=/data/a"])
    assert mix_val_note(scored, "/data/a", {"/data/a": "/data/a"}) is None
    assert mix_val_note(load_config([str(ROOT / "configs/default.yaml")], []), "/cache/builtin", None) is None
