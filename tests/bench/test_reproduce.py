"""bench.reproduce: the App. C.1 toy's known answers, the run reuse / resume rules, the per-tensor
fallback of Fig. 6, the pending-optimizer hooks, and every study's --quick mode end to end."""
from __future__ import annotations

import csv
import json
import shutil
import re
import math
import os
import shlex
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.reproduce import STUDIES, StudyUnavailable, framework, studies, toy
from bench.reproduce.__main__ import main
from bench.reproduce.framework import Options, Run, RunResult, ensure_run, full_scale, quick_scale
from optim.quantize import lp_quantize

from .quick_launch import direct_launches


# ---------------------------------------------------------------------------------------------
# App. C.1 toy


def test_toy_zero_noise_known_answer():
    """s = 0: every quantizer with L >= 2 converges below the stated bound; 2-bit L_inf never moves."""
    grid = toy.ToyGrid(quantizers=["l0", "l1", "l2", "linf"], bits=[2, 8], seeds=[0])
    rows = toy.zero_noise_check(toy.ToySetup(), grid)
    assert len(rows) == 2 * (1 + 2 * 4) + 1  # fp32 per aggregator, sign for vote, 4 quantizers x 2 widths
    for r in rows:
        if r["quantizer"] == "linf" and r["bits"] == 2:
            # hand computation: y = L x / (clip max|x|) = x / (2 max|x|) in [-1/2, 1/2] rounds half-to-even to 0
            assert r["final"] == r["initial"], r
        else:
            assert r["ratio"] < toy.ZERO_NOISE_BOUND, r
        assert r["meets"], r


def test_toy_degenerate_case_by_hand():
    """The premise of the 2-bit L_inf known answer, on the project's quantizer directly."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    assert torch.count_nonzero(lp_quantize(x, 1, math.inf, clip=2.0)) == 0
    # and L = 2 keeps the largest element: round(2 * max / (2 * max)) = 1
    q = lp_quantize(x, 2, math.inf, clip=2.0)
    assert q[x.abs().argmax()] == torch.sign(x[x.abs().argmax()])


def test_toy_noise_sampler_matches_stable_law():
    """alpha = 2 at scale 1 is N(0, 2); alpha = 1 is a standard Cauchy (median |x| = 1)."""
    g = toy.sample_noise(2.0, (200_000,), seed=1).numpy()
    assert abs(g.std() - math.sqrt(2)) < 0.02
    c = toy.sample_noise(1.0, (200_000,), seed=2).numpy()
    assert abs(np.median(np.abs(c)) - 1.0) < 0.02
    with pytest.raises(ValueError, match="alpha"):
        toy.sample_noise(2.5, (3,), seed=0)


def test_toy_vote_sums_quantized_votes():
    """vote with identical clients: one client's quantized vote decides, scaled by C (no noise)."""
    setup = toy.ToySetup(steps=1, clients=3)
    prob = toy.Problem(setup, 0)
    r = toy.run_one(prob, torch.zeros(1, 3, prob.n), "vote", "l1", 8, setup)  # 3 clients, zero noise samples
    _, g = prob.loss_grad(prob.theta0)
    c = (1 - setup.betas[0]) * g  # zero momentum at step 0
    q = torch.cat([lp_quantize(c[a:b], 127, 1.0) for a, b in prob.segments()])
    theta = prob.theta0 - setup.lr_vote * torch.sign(3 * q.to(torch.float32))
    assert r.loss[-1] == pytest.approx(prob.loss_grad(theta)[0], rel=1e-6)


def test_toy_quick_writes_table_and_plot(tmp_path):
    assert main(["toy", "--quick", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "toy.csv")))
    grid = toy.QUICK_GRID
    assert len(rows) == len(grid.aggregators) * len(grid.alphas) * len(grid.bits)
    for q in ["fp32", *grid.quantizers]:
        assert {f"{q}_mean", f"{q}_std", f"{q}_n", f"{q}_diverged"} <= set(rows[0])
    vote = [r for r in rows if r["aggregator"] == "vote"]
    assert all(r["sign_mean"] for r in vote)  # the 1-bit reference exists for vote only
    md = (tmp_path / "toy.md").read_text()
    assert "| aggregation | alpha | bits | L |" in md and "Zero noise" in md
    assert (tmp_path / "toy.png").stat().st_size > 10_000
    runs = [json.loads(x) for x in open(tmp_path / "toy_runs.jsonl")]
    per_noise = (1 + len(grid.quantizers) * len(grid.bits)) + (2 + len(grid.quantizers) * len(grid.bits))
    assert sum(1 for r in runs if not r.get("zero_noise")) == per_noise * len(grid.alphas) * len(grid.seeds)
    assert all(r["meets"] for r in runs if r.get("zero_noise"))


# ---------------------------------------------------------------------------------------------
# run reuse / resume / restart (no training: the launch is faked)


def _fake_launch(calls: list, finish: bool = True):
    def launch(run, scale, run_dir, resume, log):
        calls.append(resume)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text("model: {preset: debug}\n")
        recs = [{"step": scale.steps, "val_loss": 1.0}]
        if finish:
            recs.append({"step": scale.steps, "params_identical": True})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return 0 if finish else 1
    return launch


def test_ensure_run_reuses_resumes_and_restarts(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(framework, "_launch", _fake_launch(calls))
    scale = quick_scale(4)
    run = Run("r", "configs/variants/lion_fp32.yaml", ("optim.lr=1e-3",), 1, 2)
    quiet = lambda s: None  # noqa: E731

    first = ensure_run(run, scale, tmp_path, echo=quiet)
    assert (first.status, first.how, calls) == ("ok", "fresh", ["never"])
    again = ensure_run(run, scale, tmp_path, echo=quiet)
    assert (again.status, again.how, calls) == ("reused", "reused", ["never"])  # nothing launched
    assert again.final("val_loss") == 1.0 and again.config == {"model": {"preset": "debug"}}

    changed = Run("r", run.config, ("optim.lr=2e-3",), 1, 2)  # another spec under the same name
    ensure_run(changed, scale, tmp_path, echo=quiet)
    assert calls[-1] == "overwrite"

    # unfinished with a checkpoint and the same spec: resume
    run_dir = tmp_path / "runs" / "r"
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 2, "train_loss": 3.0}) + "\n")
    (run_dir / "ckpt" / "step_000002").mkdir(parents=True)
    ensure_run(changed, scale, tmp_path, echo=quiet)
    assert calls[-1] == "auto"
    ensure_run(changed, scale, tmp_path, restart=True, echo=quiet)
    assert calls[-1] == "overwrite"


def test_a_run_killed_on_its_first_launch_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """The suite killed (a test run, a reboot) during a run's first launch: its spec never reached the
    run directory, but waited beside it, so the next launch resumes instead of training again; a
    directory older than the pending spec (not made by that launch) is not resumed."""
    from trainer.rundir import MARKER

    scale, quiet = quick_scale(4), (lambda s: None)  # noqa: E731
    run = Run("k", "configs/variants/lion_fp32.yaml", ("optim.lr=1e-3",), 1, 2)
    run_dir = tmp_path / "runs" / "k"

    def killed(run_, scale_, run_dir_, resume, log):
        assert not (run_dir_ / framework.SPEC_FILE).exists()  # overwrite would refuse a foreign file
        run_dir_.mkdir(parents=True, exist_ok=True)
        (run_dir_ / MARKER).write_text("{}")
        (run_dir_ / "config.yaml").write_text("model: {preset: debug}\n")
        (run_dir_ / "ckpt" / "step_000002").mkdir(parents=True, exist_ok=True)
        raise KeyboardInterrupt  # the suite dies here: nothing after the launch runs

    monkeypatch.setattr(framework, "_launch", killed)
    with pytest.raises(KeyboardInterrupt):
        ensure_run(run, scale, tmp_path, echo=quiet)
    assert framework.stored_spec(run_dir) == framework.run_spec(run, scale)

    calls: list = []
    monkeypatch.setattr(framework, "_launch", _fake_launch(calls))
    done = ensure_run(run, scale, tmp_path, echo=quiet)
    assert (calls, done.how, done.status) == (["auto"], "resumed", "ok")
    assert not framework.pending_spec_path(run_dir).exists()  # the spec now lives in the run directory
    assert framework.stored_spec(run_dir) == framework.run_spec(run, scale)

    # a pending spec newer than the directory's marker: that launch never (re)made the directory
    (run_dir / framework.SPEC_FILE).unlink()
    pending = framework.pending_spec_path(run_dir)
    pending.write_text(json.dumps(framework.run_spec(run, scale)))
    os.utime(run_dir / MARKER, ns=(pending.stat().st_mtime_ns - 10**9,) * 2)
    assert framework.stored_spec(run_dir) is None


def test_a_resume_that_fails_restarts_without_our_files_in_the_directory(tmp_path, monkeypatch):
    """train.resume=overwrite refuses a directory holding files the trainer did not write: the
    fallback from a failed resume clears ours first, as a first launch does."""
    calls: list = []
    scale, quiet = quick_scale(4), (lambda s: None)  # noqa: E731
    run = Run("f", "configs/variants/lion_fp32.yaml", ("optim.lr=1e-3",), 1, 2)
    run_dir = tmp_path / "runs" / "f"
    monkeypatch.setattr(framework, "_launch", _fake_launch(calls, finish=False))
    ensure_run(run, scale, tmp_path, echo=quiet)  # unfinished: the spec is written into the directory
    (run_dir / "ckpt" / "step_000002").mkdir(parents=True)
    assert (run_dir / framework.SPEC_FILE).is_file()

    seen: list = []

    def launch(run_, scale_, run_dir_, resume, log):
        seen.append((resume, (run_dir_ / framework.SPEC_FILE).exists()))
        return 1 if resume == "auto" else _fake_launch(calls)(run_, scale_, run_dir_, resume, log)

    monkeypatch.setattr(framework, "_launch", launch)
    res = ensure_run(run, scale, tmp_path, echo=quiet)
    assert seen == [("auto", True), ("overwrite", False)] and res.status == "ok"


def test_ensure_run_reports_failures_and_pending(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(framework, "_launch", _fake_launch(calls, finish=False))
    said: list[str] = []
    bad = ensure_run(Run("x", "configs/variants/lion_fp32.yaml"), quick_scale(), tmp_path, echo=said.append)
    assert bad.status.startswith("failed rc=1") and not bad.ok
    assert said[-1] == f"[x] {bad.status}"  # at once, not only in the study's summary hours later
    quiet = lambda s: None  # noqa: E731
    pending = ensure_run(Run("y", "configs/variants/dion.yaml", requires=("dion",)), quick_scale(), tmp_path,
                         echo=quiet, available=lambda n: n != "dion")
    assert pending.status.startswith("pending: optim.name=dion")
    no_preset = ensure_run(Run("z", "configs/variants/nope.yaml", requires=("lion",)), quick_scale(), tmp_path,
                           echo=quiet)
    assert no_preset.status == "pending: configs/variants/nope.yaml does not exist"
    assert calls == ["never"]


def test_a_run_stopped_on_a_non_finite_loss_is_a_stored_result_not_a_failure_to_run(tmp_path, monkeypatch):
    """torchrun exits 1 when a worker exits 3, so the run's last metrics record (the trainer's diverged event) is
    what says train.on_nonfinite stopped it: the study stores it with its curve up to the stop, counts it as
    diverged, and neither a later session nor --report-only trains it again; an lr sweep counts it as failed."""
    from trainer.state import DIVERGED_EVENT

    calls: list = []

    def launch(run, scale, run_dir, resume, log):
        calls.append(resume)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text("model: {preset: debug}\n")
        recs = [{"step": 2, "val_loss": 4.0}, {"step": 3, "event": "nonfinite", "policy": "stop", "train_loss": None},
                {"step": 3, "event": DIVERGED_EVENT}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return 1

    monkeypatch.setattr(framework, "_launch", launch)
    scale, work, quiet = quick_scale(4), tmp_path / "work", (lambda s: None)  # noqa: E731
    run = Run("d", "configs/variants/onebit_adam.yaml", ("optim.lr=1e-3",), 1, 2)
    said: list[str] = []
    res = ensure_run(run, scale, work, echo=said.append)
    assert res.diverged and not res.ok and res.status.startswith("failed")  # a sweep counts it as worse
    assert res.status == framework.diverged_status(3) and "step 3" in said[-1]
    assert studies.diverged(res) is True and res.final("val_loss") == 4.0
    # the same run directory again: not launched, it would stop there again
    assert ensure_run(run, scale, work, echo=quiet).status == res.status and calls == ["never"]
    # stored: a new machine's --report-only summary reads it as diverged
    store = tmp_path / "store"
    framework.save_stored(store, res, framework.run_spec(run, scale))
    shutil.rmtree(work)
    back = ensure_run(run, scale, work, echo=quiet, store=store, report_only=True)
    assert (back.how, back.status, back.diverged) == ("stored", res.status, True) and back.records == res.records
    assert framework.stored_walls(store) == {}  # a partial run's wall time estimates no other run
    # --restart trains it again; a resume past the stop clears the verdict
    ensure_run(run, scale, work, echo=quiet, store=store, restart=True)
    assert calls == ["never", "never"]
    assert framework.diverged_at([{"step": 3, "event": DIVERGED_EVENT}, {"step": 2, "event": "resume"}]) is None
    # a failure that is no divergence stays a failure to run (retrained by the next session)
    monkeypatch.setattr(framework, "_launch", _fake_launch(calls, finish=False))
    crash = ensure_run(Run("c", run.config, run.overrides, 1, 2), scale, work, echo=quiet)
    assert crash.status.startswith("failed rc=1") and not crash.diverged


def test_store_outlives_the_run_directory(tmp_path, monkeypatch):
    """A finished run saved to the store is summarized from there once its run directory is gone (a new
    machine), only under the same spec, and --restart retrains it."""
    import shutil

    calls: list = []
    monkeypatch.setattr(framework, "_launch", _fake_launch(calls))
    scale, work, store = quick_scale(4), tmp_path / "work", tmp_path / "results" / "store"
    run = Run("r", "configs/variants/lion_fp32.yaml", ("optim.lr=1e-3",), 1, 2)
    quiet = lambda s: None  # noqa: E731

    first = ensure_run(run, scale, work, echo=quiet, store=store)
    assert (first.how, calls) == ("fresh", ["never"]) and framework.load_stored(store, "r") is None
    path = framework.save_stored(store, first, framework.run_spec(run, scale), {"w_mean": 0.5, "w_abs": 2.0})
    blob = path.read_bytes()
    assert framework.save_stored(store, first, framework.run_spec(run, scale), {"w_mean": 0.5, "w_abs": 2.0}) is None
    assert path.read_bytes() == blob  # an unchanged run is not rewritten
    # the machine it trained on, CPU vector width included (it decides float rounding across hosts)
    assert framework.load_stored(store, "r")["machine"]["cpu_capability"] == framework.machine()["cpu_capability"]
    # the run directory wins while it exists
    assert ensure_run(run, scale, work, echo=quiet, store=store).how == "reused"

    shutil.rmtree(work)
    back = ensure_run(run, scale, work, echo=quiet, store=store, report_only=True)
    assert (back.status, back.how, back.source) == ("reused", "stored", "trained") and calls == ["never"]
    assert back.final("val_loss") == 1.0 and back.config == {"model": {"preset": "debug"}}
    assert back.extras == {"w_mean": 0.5, "w_abs": 2.0}
    assert studies.run_matrix_weights(back, {}) == (0.5, 2.0)  # fig10's weights without the checkpoint
    other = Run("r", run.config, ("optim.lr=2e-3",), 1, 2)  # same name, another spec: not the stored run
    assert ensure_run(other, scale, work, echo=quiet, store=store, report_only=True).status.startswith("failed")
    assert ensure_run(run, scale, work, echo=quiet, store=store, restart=True).how == "fresh"
    assert calls == ["never", "never"]


def test_report_only_leaves_the_store_entry_of_a_finished_run_directory_alone(tmp_path, monkeypatch):
    """--report-only over a run directory that finished (the store holds the same run, with the training tokens
    counted at its launch): the summary keeps those tokens and the entry is not rewritten without them."""
    calls: list = []
    monkeypatch.setattr(framework, "_launch", _fake_launch(calls))
    scale, work, store = quick_scale(4), tmp_path / "work", tmp_path / "results" / "store"
    run = Run("r", "configs/variants/lion_fp32.yaml", ("optim.lr=1e-3",), 1, 2)
    first = ensure_run(run, scale, work, echo=lambda s: None, store=store)
    first.tokens = {"read": 1025, "available": 9999}
    path = framework.save_stored(store, first, framework.run_spec(run, scale))
    blob = path.read_bytes()
    again = ensure_run(run, scale, work, echo=lambda s: None, store=store, report_only=True)
    assert (again.how, again.tokens) == ("reused", {"read": 1025, "available": 9999})
    assert framework.save_stored(store, again, framework.run_spec(run, scale)) is None
    assert path.read_bytes() == blob and calls == ["never"]


def test_study_stores_each_run_as_it_finishes(tmp_path, monkeypatch):
    """A study cut off in its second run (the machine shut down) has already stored its first run."""
    calls: list = []
    fake = _fake_launch(calls)

    def launch(run, scale, run_dir, resume, log):
        if len(calls) == 1:
            raise KeyboardInterrupt  # the second launch never returns
        return fake(run, scale, run_dir, resume, log)

    monkeypatch.setattr(framework, "_launch", launch)
    opts = Options(quick=True, out=tmp_path / "results", work=tmp_path / "work", seeds=[1, 2])
    with pytest.raises(KeyboardInterrupt):
        STUDIES["dion_ef"].execute(opts, echo=lambda s: None)
    stored = sorted(p.name for p in opts.store_dir().iterdir())
    assert stored == ["dion_r0.0625_ef1_p2_s1.json.gz"] and calls == ["never"]


def test_a_study_stores_a_diverged_run_and_does_not_fail_for_it(tmp_path, monkeypatch):
    from trainer.state import DIVERGED_EVENT

    calls: list = []

    def launch(run, scale, run_dir, resume, log):
        calls.append(run.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text("model: {preset: debug}\n")
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 2, "event": DIVERGED_EVENT}) + "\n")
        return 1

    monkeypatch.setattr(framework, "_launch", launch)
    opts = Options(quick=True, out=tmp_path / "results", work=tmp_path / "work", seeds=[1])
    said: list[str] = []
    STUDIES["dion_ef"].execute(opts, echo=said.append)
    entries = [framework.load_stored(opts.store_dir(), n) for n in calls]
    assert calls and all(e["status"] == framework.diverged_status(2) for e in entries)
    assert opts.failed == [] and any(f"{len(calls)} run(s) diverged" in s for s in said)
    STUDIES["dion_ef"].execute(replace(opts, report_only=True), echo=said.append)  # read back, not relaunched
    assert len(calls) == len(entries) and opts.failed == []


def test_import_raw_records_rebuilds_loss_only_entries(tmp_path):
    scale = quick_scale(4)
    run = Run("a_s1", "configs/variants/lion_fp32.yaml", ("optim.lr=1e-3",), 1, 2)
    rec = {"name": "a_s1", "config": run.config, "overrides": framework.trainer_overrides(run, scale), "seed": 1,
           "nproc": 2, "status": "ok", "run_dir": "bench/out/x/runs/a_s1", "wall_s": 12.5, "load_before": [1.0],
           "load_after": [2.0], "train_time_s": 10.0, "val_loss": [[2, 3.0], [4, 2.5]],
           "train_loss": [[1, 4.0], [2, 3.5], [4, 3.0]]}
    failed = {**rec, "name": "b_s1", "status": "failed rc=1"}
    raw = tmp_path / "t_runs.jsonl"
    raw.write_text(json.dumps(rec) + "\n" + json.dumps(failed) + "\n")
    store = tmp_path / "store"
    assert framework.import_raw_records(raw, store) == ["a_s1"]
    assert framework.import_raw_records(raw, store) == []  # already there: left alone
    res = ensure_run(run, scale, tmp_path / "work", store=store, report_only=True, echo=lambda s: None)
    assert (res.status, res.how) == ("reused", "stored") and res.source.startswith(framework.IMPORTED)
    assert res.series("val_loss") == ([2, 4], [3.0, 2.5]) and res.final("train_loss") == 3.0
    assert res.final("train_time_s") == 10.0 and res.wall_s == 12.5 and res.window_mean("diag/sign_match") is None


def test_all_runs_every_study_and_reports_failures(tmp_path, monkeypatch, capsys):
    """`all` executes every registered study in order with the shared options, goes on past a study that fails,
    and exits non-zero naming it; a study with a failed run exits 1 on its own too."""
    seen: list = []

    def execute(self, opts, echo=print):
        seen.append((self.name, opts.quick, opts.seeds, opts.argv[0]))
        if self.name == "fig10":
            opts.failed.append("b0.99_plus_p2_s7")
        if self.name == "compressors":
            raise StudyUnavailable("needs optim.name=nope")
        return []

    monkeypatch.setattr(framework.Study, "execute", execute)
    monkeypatch.setattr(toy.ToyStudy, "execute", execute)
    assert main(["all", "--quick", "--seeds", "7", "--out", str(tmp_path)]) == 1
    assert seen == [(n, True, [7], n) for n in STUDIES]
    err = capsys.readouterr().err
    assert "2 study(ies) failed or could not run: fig10, compressors" in err and "b0.99_plus_p2_s7" in err
    seen.clear()
    assert main(["table2", "--quick", "--out", str(tmp_path)]) == 0 and main(["fig10", "--quick"]) == 1
    assert main(["all", "--nproc", "2"]) == 2 and len(seen) == 2  # --nproc belongs to one study


def test_all_seed_major_trains_one_seed_of_every_study_before_the_next(tmp_path, monkeypatch, capsys):
    """--seed-major: pass k runs every training study with its first k seeds (the earlier ones come from the
    store, so its report covers the seeds done so far), then the studies with their own loop (the toy) once;
    each study's recorded command reruns it alone; the exit status is each study's last pass. Refused for a
    single study and with --restart."""
    seen: list = []
    fail_once = {"fig5"}

    def execute(self, opts, echo=print):
        seen.append((self.name, opts.seeds, opts.argv))
        if self.name in fail_once and opts.seeds == [5]:
            opts.failed.append("a run")   # fails in pass 1, retried (and done) in pass 2
        return []

    monkeypatch.setattr(framework.Study, "execute", execute)
    monkeypatch.setattr(toy.ToyStudy, "execute", execute)
    assert main(["all", "--seed-major", "--seeds", "5,6", "--out", str(tmp_path)]) == 0
    training = [n for n, s in STUDIES.items() if s.build is not None]
    assert "toy" in STUDIES and "toy" not in training and len(training) >= 6 and "fig5" in training
    tail = ["--out", str(tmp_path)]
    expect = ([(n, [5], [n, *tail, "--seeds", "5"]) for n in training]
              + [(n, [5, 6], [n, *tail, "--seeds", "5,6"]) for n in training]
              + [(n, [5, 6], [n, "--seeds", "5,6", *tail]) for n in STUDIES if n not in training])
    assert seen == expect
    seen.clear()
    fail_once.add("table2")  # a study whose last pass fails makes the suite fail, naming it
    monkeypatch.setattr(framework.Study, "execute", lambda self, opts, echo=print: seen.append(
        (self.name, opts.seeds, opts.argv)) or (opts.failed.append("x") if self.name == "table2" else None) or [])
    assert main(["all", "--seed-major", "--seeds", "5,6"]) == 1
    assert "1 study(ies) failed or could not run: table2" in capsys.readouterr().err
    seen.clear()
    # each study's own seeds: fig10 and the sweep have one, so the second and third passes leave them out
    monkeypatch.setattr(framework.Study, "execute", execute)
    assert main(["all", "--seed-major", "--lr", "from-sweep"]) == 0
    assert seen[0][:2] == ("lr_sweep", STUDIES["lr_sweep"].seeds)
    third = [n for n, s, _ in seen if s == STUDIES["table2"].seeds]
    assert "table2" in third and "fig10" not in third and "lr_sweep" not in third
    assert [n for n, s, _ in seen].count("fig10") == 1 and [n for n, s, _ in seen].count("table2") == 3
    assert main(["table2", "--seed-major"]) == 2 and "orders the studies of 'all'" in capsys.readouterr().err
    assert main(["all", "--seed-major", "--restart"]) == 2 and "--restart" in capsys.readouterr().err


def test_optimizer_hooks():
    assert framework.optimizer_available("lion") and framework.optimizer_available("dion")
    assert not framework.optimizer_available("sgd")
    with pytest.raises(StudyUnavailable, match="optim.name=sgd"):
        framework.Study("x", "x", "x", requires=("sgd",), planned="later").check_available()
    # the full study trains every compressed optimizer and every Dion rank with and without error feedback;
    # --quick one of each kind (the others train end to end in their own tests)
    full = {r.label("optimizer") for r in studies.compressors_runs(full_scale(300), [1], Options())}
    assert full >= set(studies.COMPRESSED) | {"adamw_fp32", "lion_fp32"}
    quick = {r.label("optimizer") for r in studies.compressors_runs(quick_scale(), [1], Options(quick=True))}
    assert quick == {"adamw_fp32", *studies.COMPRESSED_QUICK} and set(studies.COMPRESSED_QUICK) <= set(studies.COMPRESSED)
    dion = studies.dion_runs(full_scale(300), [1], Options())
    assert {(r.label("rank_fraction"), r.label("error_feedback")) for r in dion} == {
        (f, ef) for f in studies.DION_RANKS for ef in (True, False)}
    dion = studies.dion_runs(quick_scale(), [1], Options(quick=True))
    assert {(r.label("rank_fraction"), r.label("error_feedback")) for r in dion} == {(0.0625, True), (0.0625, False)}


def test_shared_run_names_and_specs():
    """table3 reuses table2's 1-bit runs and fig6_17 reuses fig5's no-sync runs under a shared --work."""
    o = Options(quick=True)
    for a, b, pick in [("table2", "table3", lambda r: r.label("arm") == "1bit"),
                       ("fig5", "fig6_17", lambda r: r.label("arm") == "none")]:
        sa, sb = STUDIES[a], STUDIES[b]
        ra = {r.name: framework.run_spec(r, sa.scale(o)) for r in sa.build(sa.scale(o), [1], o) if pick(r)}
        rb = {r.name: framework.run_spec(r, sb.scale(o)) for r in sb.build(sb.scale(o), [1], o)}
        assert ra and ra == rb
    # compressors' Lion rows are table2's full-size runs
    full = Options()
    t2, comp = STUDIES["table2"], STUDIES["compressors"]
    ra = {r.name: framework.run_spec(r, t2.scale(full)) for r in t2.build(t2.scale(full), [1], full)}
    rb = {r.name: framework.run_spec(r, comp.scale(full)) for r in comp.build(comp.scale(full), [1], full)
          if r.label("optimizer") in studies.COMPRESSORS_FROM_TABLE2}
    assert len(rb) == len(studies.COMPRESSORS_FROM_TABLE2) == 4 and all(ra[name] == spec for name, spec in rb.items())


# ---------------------------------------------------------------------------------------------
# settings, the no-repeat check, the lr sweep, wire bytes


def test_setting_is_in_the_run_key_and_its_own_directory():
    """--setting / --set overrides replace the scale's value of the same key, enter every run's spec (the store
    key), and send results and runs to a directory of the setting's own."""
    base, prose = Options(), Options(setting="study-prose")
    extra = Options(setting="study-prose", sets=("optim.warmup_steps=5",))
    t2 = STUDIES["table2"]
    specs = {}
    for o in (base, prose, extra):
        sc = t2.scale(o)
        run = t2.build(sc, [1], o)[0]
        specs[o.setting_name()] = framework.run_spec(run, sc)["overrides"]
    assert "model.preset=tiny" in specs["tiny-builtin"] and "data.dataset=data/prose" not in specs["tiny-builtin"]
    pro = specs["study-prose"]
    assert "model.preset=study" in pro and "model.preset=tiny" not in pro and "data.dataset=data/prose" in pro
    # study-prose reads shuffled windows; its superseded first runs read the stream in order (their own key)
    seq = framework.run_spec(t2.build(t2.scale(Options(setting="study-prose-sequential")), [1], base)[0],
                             t2.scale(Options(setting="study-prose-sequential")))["overrides"]
    assert "data.order=shuffled" in pro and "data.order=shuffled" not in seq
    assert [o for o in pro if o != "data.order=shuffled"] == seq
    ext = next(v for k, v in specs.items() if k.startswith("study-prose+"))
    assert "optim.warmup_steps=5" in ext and "optim.warmup_steps=20" not in ext
    assert len(set(map(tuple, specs.values()))) == 3
    assert base.results_dir() == framework.ROOT / framework.DEFAULT_RESULTS
    assert prose.results_dir() == framework.ROOT / framework.DEFAULT_RESULTS / "study-prose"
    assert extra.results_dir().name.startswith("study-prose+") and extra.results_dir() != prose.results_dir()
    assert "study-prose" in str(prose.work_dir("table2")) and t2.scale(prose).setting == "study-prose"
    with pytest.raises(StudyUnavailable, match="unknown setting"):
        Options(setting="nope").setting_overrides()


def test_no_repeat_check_refuses_before_launching(tmp_path, monkeypatch, capsys):
    """A study whose runs would read a training token twice launches nothing and says why, with the numbers;
    a run that fits records 'tokens seen / tokens available' in its raw record and the report."""
    calls: list = []
    monkeypatch.setattr(framework, "_launch", _fake_launch(calls))
    out, work = tmp_path / "results", tmp_path / "work"
    # 2 ranks x 2 x 32 tokens a step: 100000 steps read ~12.8M tokens of the ~110K-token built-in corpus
    assert main(["dion_ef", "--quick", "--steps", "100000", "--out", str(out), "--work", str(work)]) == 2
    err = capsys.readouterr().err
    assert "would read training tokens twice" in err and "--allow-repeat" in err and calls == []
    assert main(["dion_ef", "--quick", "--out", str(out), "--work", str(work)]) == 0 and len(calls) == 2
    recs = [json.loads(x) for x in open(out / "dion_ef_runs.jsonl")]
    from data import resolve_dataset
    from data.loader import split_shards, open_shard
    avail = sum(len(open_shard(p)) for p in split_shards(resolve_dataset("builtin"), "train"))
    assert {(r["train_tokens_read"], r["train_tokens_available"]) for r in recs} == {(6 * 2 * 2 * 32 + 1, avail)}
    assert f"tokens seen / tokens available = 769 / {avail:,}" in (out / "dion_ef.md").read_text()
    stored = framework.load_stored(out / "store", recs[0]["name"])
    assert stored["tokens"] == {"read": 769, "available": avail}
    # --allow-repeat launches it and says how many times over it reads the corpus
    calls.clear()
    assert main(["dion_ef", "--quick", "--steps", "100000", "--allow-repeat", "--out", str(tmp_path / "r2"),
                 "--work", str(tmp_path / "w2")]) == 0 and len(calls) == 2
    assert "reads the training split" in (tmp_path / "r2" / "dion_ef.md").read_text()


def _lr_launch(calls: list, best: float):
    """A fake trainer whose final val loss is smallest at lr `best` (log distance)."""
    def launch(run, scale, run_dir, resume, log):
        calls.append(run.name)
        lr = next(float(o.split("=")[1]) for o in reversed([*scale.overrides, *run.overrides])
                  if o.startswith(("optim.lr=", "optim.matrix_lr=")))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text("model: {preset: debug}\n")
        loss = 3.0 + abs(math.log10(lr / best))
        recs = [{"step": 1, "train_loss": loss + 1, "val_loss": loss + 1}, {"step": scale.steps, "train_loss": loss,
                "val_loss": loss}, {"step": scale.steps, "params_identical": True}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return 0
    return launch


def test_lr_sweep_best_lr_feeds_the_other_studies(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(framework, "_launch", _lr_launch(calls, 3e-4))
    out, work = tmp_path / "results", tmp_path / "work"
    assert main(["lr_sweep", "--quick", "--out", str(out), "--work", str(work)]) == 0
    rows = list(csv.DictReader(open(out / "lr_sweep.csv")))
    key, values = studies.SWEEP_ARMS["lion_fp32"]
    assert sorted(float(r["lr"]) for r in rows) == sorted(values) and len(calls) == 3
    assert all(2.5 < b / a < 4 for a, b in zip(sorted(values), sorted(values)[1:]))  # about 3x apart
    assert [float(r["lr"]) for r in rows if r["best"]] == [3e-4] and not any(r["edge"] for r in rows)
    best = json.loads((out / framework.BEST_LR_FILE).read_text())
    assert best["best"] == {"lion_fp32": {"key": "optim.lr", "value": 3e-4, "val_loss": 3.0, "edge": False}}
    assert best["overrides"] == list(STUDIES["lr_sweep"].scale(Options(quick=True)).overrides)
    assert (out / "lr_sweep.png").stat().st_size > 5_000

    # table2 --lr from-sweep: every arm needs a swept lr; with one arm only, it refuses and names the missing arm
    with pytest.raises(StudyUnavailable, match="no arm 'lioncub_1bit'"):
        STUDIES["table2"].execute(Options(quick=True, out=out, work=work, lr=framework.FROM_SWEEP))
    best["best"].update({a: {"key": "optim.lr", "value": v, "val_loss": 3.0, "edge": False}
                         for a, v in (("lioncub_1bit", 1e-4), ("lioncub_8bit_l1", 1e-3))})
    (out / framework.BEST_LR_FILE).write_text(json.dumps(best))
    calls.clear()
    assert main(["table2", "--quick", "--lr", framework.FROM_SWEEP, "--out", str(out), "--work", str(work)]) == 0
    recs = {r["labels"]["arm"]: r for r in map(json.loads, open(out / "table2_runs.jsonl"))}
    assert {a: [o for o in r["overrides"] if o.startswith("optim.lr=")][-1] for a, r in recs.items()} == {
        "fp32": "optim.lr=0.0003", "1bit": "optim.lr=0.0001", "8bit_l1": "optim.lr=0.001"}
    assert recs["fp32"]["name"].endswith("_lr0.0003") and len(calls) == 3
    assert "lr_sweep study (--lr from-sweep): lion_fp32 optim.lr=0.0003, lioncub_1bit optim.lr=0.0001" in \
        (out / "table2.md").read_text()
    # a sweep of another setting is refused
    assert main(["table2", "--quick", "--lr", framework.FROM_SWEEP, "--set", "optim.warmup_steps=1",
                 "--out", str(out), "--work", str(work)]) == 2
    # the full table2 drops its fixed-lr control under --lr from-sweep
    arms = {r.label("arm") for r in studies.table2_runs(full_scale(300), [1], Options(lr=framework.FROM_SWEEP))}
    assert "fp32_lr3e-4" not in arms and "8bit_linf" in arms
    # every arm the issue names is swept: the Lion family, the Adam family, the compressors, Dion and Muon
    assert set(studies.SWEEP_ARMS) >= {"lion_fp32", "adamw_fp32", "lioncub_1bit", "lioncub_8bit_l1", "onebit_adam",
                                       "binsgdm", "loco_adamw", "dion", "muon"}


def test_lr_sweep_extends_its_grid_past_a_best_at_the_edge(tmp_path, monkeypatch):
    """Full scale: an arm whose best value is the grid's smallest gets the next value below (the grid's step),
    again while the best stays at the edge, at most SWEEP_EXTEND times; a best still at the edge then is flagged.
    A rerun trains nothing: the added runs are found like the others."""
    calls: list = []
    monkeypatch.setattr(framework, "_launch", _lr_launch(calls, 5e-5))
    monkeypatch.setattr(studies, "SWEEP_ARMS", {a: studies.SWEEP_ARMS[a] for a in ("lion_fp32", "adamw_fp32")})
    assert studies.next_grid_value([1e-4, 3e-4, 1e-3], below=True) == 3e-5
    assert studies.next_grid_value([3e-4, 1e-3, 3e-3], below=False) == 1e-2
    assert studies.next_grid_value([0.006, 0.02, 0.06], below=False) == 0.2
    out, work = tmp_path / "results", tmp_path / "work"
    opts = dict(out=out, work=work, allow_repeat=True)
    STUDIES["lr_sweep"].execute(Options(**opts), echo=lambda s: None)
    rows = list(csv.DictReader(open(out / "lr_sweep.csv")))
    grid = {a: sorted(float(r["lr"]) for r in rows if r["arm"] == a) for a in ("lion_fp32", "adamw_fp32")}
    # Lion: 3e-5 (0.22 from the best in log10) beats 1e-4 (0.30), so 1e-5 is tried and 3e-5 ends inside the grid
    assert grid["lion_fp32"] == [1e-5, 3e-5, 1e-4, 3e-4, 1e-3]
    # AdamW: 1e-4, then 3e-5, then the cap: its best stays at the edge and says so
    assert grid["adamw_fp32"] == [3e-5, 1e-4, 3e-4, 1e-3, 3e-3] and len(calls) == 10
    best = json.loads((out / framework.BEST_LR_FILE).read_text())["best"]
    assert (best["lion_fp32"]["value"], best["lion_fp32"]["edge"]) == (3e-5, False)
    assert (best["adamw_fp32"]["value"], best["adamw_fp32"]["edge"]) == (3e-5, True)
    calls.clear()
    STUDIES["lr_sweep"].execute(Options(**opts), echo=lambda s: None)
    assert calls == [] and len(list(csv.DictReader(open(out / "lr_sweep.csv")))) == 10

    # a value added past the upper edge that diverges (the run fails): no further value, the arm keeps its best
    # (at the edge of what finished, and says which value did not), and the other studies still get its lr
    fake = _lr_launch(calls, 1.0)
    monkeypatch.setattr(framework, "_launch", lambda run, scale, *a: 1 if run.name.startswith(
        "sweep_adamw_fp32_lr0.01_") else fake(run, scale, *a))
    monkeypatch.setattr(studies, "SWEEP_ARMS", {"adamw_fp32": studies.SWEEP_ARMS["adamw_fp32"]})
    o = Options(out=tmp_path / "r2", work=tmp_path / "w2", allow_repeat=True)
    STUDIES["lr_sweep"].execute(o, echo=lambda s: None)
    rows = {float(r["lr"]): r for r in csv.DictReader(open(tmp_path / "r2" / "lr_sweep.csv"))}
    assert sorted(rows) == [3e-4, 1e-3, 3e-3, 1e-2] and rows[1e-2]["status"].startswith("failed")
    assert rows[3e-3]["best"] and rows[3e-3]["edge"] == "edge; 0.01 did not finish"
    assert o.failed == [next(n for n in o.failed if n.startswith("sweep_adamw_fp32_lr0.01_"))]
    best = json.loads((tmp_path / "r2" / framework.BEST_LR_FILE).read_text())["best"]
    assert (best["adamw_fp32"]["value"], best["adamw_fp32"]["edge"]) == (3e-3, True)
    # --report-only on the store alone: the value past the edge was never stored, so it is "not run" there and
    # the arm has no best until it is tried (the sweep would otherwise hand out the edge value)
    r3 = tmp_path / "r3"
    shutil.copytree(tmp_path / "r2" / "store", r3 / "store")
    o = Options(out=r3, work=tmp_path / "w3", report_only=True)
    STUDIES["lr_sweep"].execute(o, echo=lambda s: None)
    assert json.loads((r3 / framework.BEST_LR_FILE).read_text())["best"] == {}
    assert any(n.startswith("sweep_adamw_fp32_lr0.01_") for n in o.not_run) and o.failed == []  # interim, not failed


def test_plan_lists_each_run_state_and_the_time_left(tmp_path, monkeypatch, capsys):
    """--plan launches and writes nothing: per study the runs stored, finished in their run directory,
    resumable (a checkpoint of the same spec) or to train, a run shared with an earlier study counted once,
    and the time left from the finished runs' wall times."""
    calls: list = []
    monkeypatch.setattr(framework, "_launch", _lr_launch(calls, 3e-4))
    out, work = tmp_path / "results", tmp_path / "work"
    common = ["--quick", "--out", str(out), "--work", str(work)]
    assert main(["lr_sweep", *common]) == 0 and len(calls) == 3
    capsys.readouterr()
    assert main(["lr_sweep", "--plan", *common]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^lr_sweep +3 +0 +3 +0 +0 +0$", text, re.M) and "left: 0 of 3 run(s)" in text
    assert re.search(r"^cost: 3 finished run\(s\) recorded [\d.]+ h .* about [\d.]+ h$", text, re.M)
    # the run directories gone: the store holds them; one run's directory with a checkpoint of its own spec
    # is resumable, and table2 / table3 (sharing its P = 2 1-bit run) are to train, the shared run counted once
    shutil.rmtree(work)
    planned, _ = framework.plan_study(STUDIES["table2"], Options(quick=True, out=out, work=work))
    first = planned[0]
    run_dir = work / "runs" / first.run.name
    (run_dir / "ckpt" / "step_3").mkdir(parents=True)
    scale = STUDIES["table2"].scale(Options(quick=True))
    (run_dir / framework.SPEC_FILE).write_text(json.dumps(framework.run_spec(first.run, scale)))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["all", "--plan", *common]) == 0
    text = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.rglob("*")) == before and len(calls) == 3  # nothing launched or written
    assert re.search(r"^lr_sweep +3 +3 +0 +0 +0 +0$", text, re.M)
    n2 = len(planned)
    assert re.search(rf"^table2 +{n2} +0 +0 +1 +{n2 - 1} +0$", text, re.M)
    assert re.search(r"^table3 +\d+ .*\(\+1 shared with an earlier study\)$", text, re.M)
    left = int(re.search(r"^left: (\d+) of", text, re.M).group(1))
    assert left > n2 and "about" in text and "h on this machine" in text
    # --lr from-sweep before the sweep wrote its best values: the plan says so
    (out / framework.BEST_LR_FILE).unlink()
    assert main(["table2", "--plan", "--lr", framework.FROM_SWEEP, *common]) == 0
    assert "has no value for every arm yet" in capsys.readouterr().out


def test_plan_cost_counts_recorded_hours_and_the_whole_plan_at_medians():
    """The suite's cost: the finished runs' recorded wall time, and the whole plan with every run (finished or
    left) at its geometry's median, so a resumed run's short last launch does not shrink the estimate; a run of
    a geometry with none finished is scaled from the best-timed geometry by steps x world size."""
    def p(name, nproc, steps, state, wall=None):
        return framework.Planned("s", Run(name, "c.yaml", nproc=nproc), steps, state, wall)
    plan = [p("a", 4, 300, "stored", 600.0), p("b", 4, 300, "stored", 1000.0), p("c", 4, 300, "stored", 200.0),
            p("d", 4, 300, "to train"), p("e", 8, 300, "resumable"), p("f", 4, 300, "pending: sweep")]
    done, recorded, whole = framework.hours_spent(plan, framework.minutes_left(plan)[0])
    assert done == 3 and recorded == pytest.approx(1800 / 3600)
    # finished: 3 x median 600; left: d at 600, e scaled x2 = 1200; the pending run is not counted
    assert whole == pytest.approx((3 * 600 + 600 + 1200) / 3600)
    assert framework.hours_spent([p("d", 4, 300, "to train")], None) == (0, 0.0, None)


def test_fig5_embedding_head_arm_and_dion_convention():
    """Fig. 5 syncs the embedding and the head (the paper's arm) beside the head only, in every setting but the
    committed tiny-builtin one; that setting's Dion runs pin the transpose_wide convention they trained under."""
    def arms(o: Options):
        st = STUDIES["fig5"]
        return {r.label("arm"): r for r in st.build(st.scale(o), [1], o)}
    prose = arms(Options(setting="study-prose"))
    emb = next(r for a, r in prose.items() if a.startswith("sync_emb_head"))
    assert "comm.momentum_sync.layers=[embedding,head]" in emb.overrides
    assert any(a.startswith("sync_head") for a in prose) and len(prose) == 4
    assert not any(a.startswith("sync_emb") for a in arms(Options()))
    assert any(a.startswith("sync_emb") for a in arms(Options(quick=True)))
    for o, pinned in ((Options(), True), (Options(setting="study-prose"), False)):
        st = STUDIES["dion_ef"]
        runs = st.build(st.scale(o), [1], o)
        assert all(("optim.transpose_wide=false" in r.overrides) == pinned for r in runs)
    comp = {r.label("optimizer") for r in studies.compressors_runs(full_scale(300, setting="study-prose"), [1],
                                                                   Options())}
    assert {"muon", "dion"} <= comp
    # the committed Dion runs say which convention they trained under
    entry = framework.load_stored(framework.ROOT / framework.DEFAULT_RESULTS / "store", "dion_r0.25_ef1_p4_s1338")
    assert "optim.transpose_wide=false" in entry["spec"]["overrides"]


def test_wire_bytes_per_algorithm():
    """Wire / buffer from each scheme's cost model: a ring allreduce sends 2(P-1)/P of its buffer; the
    all-to-all + all-gather exchanges keep a rank's own chunk (below 1 at P = 2) and approach 2 as P grows."""
    tiny = {"model": {"preset": "tiny"}}
    for p in (2, 4, 8):
        f, wire = framework.wire_factor({**tiny, "comm": {"mode": "fp32"}}, p)
        assert f == pytest.approx(2 * (p - 1) / p) and "ring allreduce" in wire
    comp = [framework.wire_factor({**tiny, "comm": {"mode": "compressed", "compressor": "scaled_sign"}}, p)[0]
            for p in (2, 4, 8)]
    assert comp[0] < 1 < comp[1] < comp[2] < 2
    assert framework.wire_factor({**tiny, "comm": {"mode": "fp32"}}, 1)[0] is None  # one rank sends nothing
    # an optimizer that decides what crosses (Dion: its factors) says so, at the carrying scheme's wire factor;
    # one that sends the scheme's own vector (Muon: the flat gradient) keeps the scheme's words
    f, wire = framework.wire_factor({**tiny, "optim": {"name": "dion"}, "comm": {"mode": "fp32"}}, 4)
    assert f == pytest.approx(1.5) and wire.startswith("every low-rank matrix's P and R factors")
    assert "ring allreduce" in wire and "carried by comm.mode fp32" in wire
    assert framework.wire_factor({**tiny, "optim": {"name": "muon"}, "comm": {"mode": "fp32"}}, 4)[1] == \
        "the flat gradient, fp32 (ring allreduce)"


def test_compressors_say_which_scale_the_1bit_adam_row_used():
    """The 1-bit Adam row's note comes from its run's config: a block scale says so, and differs from the
    reference's per-tensor L2 scale; no 1-bit Adam run, no note."""
    def res(comm):
        run = Run("o", "configs/variants/onebit_adam.yaml", labels=(("optimizer", "onebit_adam"),))
        return RunResult(run, "ok", Path("."), records=[{"step": 1, "val_loss": 1.0}], config={"comm": comm})
    # a run whose config predates comm.scale / comm.block says nothing: the next run's config decides
    note = studies.onebit_adam_scale([res({}), res({"compressor": "scaled_sign", "scale": "mean_abs", "block": 2048})])
    assert "mean |y| of each block of 2048 elements" in note and "comm.scale=mean_abs comm.block=2048" in note
    assert studies.onebit_adam_scale([res({"compressor": "scaled_sign"})]) == ""
    note = studies.onebit_adam_scale([res({"compressor": "scaled_sign", "scale": "l2", "block": 0})])
    assert "||y||_2 / sqrt(n) of each rank's chunk" in note
    other = Run("a", "configs/variants/adamw_fp32.yaml", labels=(("optimizer", "adamw_fp32"),))
    assert studies.onebit_adam_scale([RunResult(other, "ok", Path("."), config={"comm": {}})]) == ""


# ---------------------------------------------------------------------------------------------
# Fig. 6: per-tensor keys when logged, per-role otherwise


def _fake_result(records: list[dict], beta2: float) -> RunResult:
    run = Run(f"b{beta2}", "configs/variants/lioncub_1bit.yaml", labels=(("beta2", beta2),))
    cfg = {"model": {"preset": "debug", "tie_embeddings": False, "pos_emb": "rope", "block_size": 0}}
    return RunResult(run, "ok", Path("."), records=records, config=cfg)


def test_fig6_prefers_per_tensor_keys():
    def recs(scale):
        out = []
        for step in (2, 4):
            r = {"step": step, "diag/momentum_spread/embedding": 9.0, "diag/momentum_spread/head": 9.0,
                 "diag/momentum_spread/attn": 1.0, "diag/momentum_spread/mlp": 1.0, "diag/momentum_spread/norm": 1.0}
            r[studies.TENSOR_PREFIX + "transformer.wte.weight"] = 100.0 * scale * step
            r[studies.TENSOR_PREFIX + "lm_head.weight"] = 50.0 * scale
            r[studies.TENSOR_PREFIX + "transformer.h.0.attn.qkv.weight"] = 1.0 * scale
            r[studies.TENSOR_PREFIX + "transformer.h.0.mlp.fc.weight"] = 3.0 * scale
            r[studies.BLOCK_PREFIX + "0"] = 3.0 * scale
            out.append(r)
        return out
    res = [_fake_result(recs(1.0), 0.95), _fake_result(recs(0.5), 0.99)]
    summ = studies.fig6_summary(res, quick_scale())
    rows = {r["layer"]: r for r in summ.rows}
    assert rows["transformer.wte.weight"]["granularity"] == "tensor"
    assert rows["transformer.wte.weight"]["role"] == "embedding" and rows["lm_head.weight"]["role"] == "head"
    assert rows["transformer.wte.weight"]["spread_0.95"] == pytest.approx(300.0)  # mean of 200 and 400
    assert rows["transformer.wte.weight"]["ratio_0.95"] == pytest.approx(300.0 / 2.0)  # median(1, 3) = 2
    assert rows["0"]["granularity"] == "block"
    assert "**tensor**" in summ.notes[0]


def test_fig6_falls_back_to_roles():
    rec = {"step": 2, "diag/momentum_spread/embedding": 8.0, "diag/momentum_spread/head": 4.0,
           "diag/momentum_spread/attn": 1.0, "diag/momentum_spread/mlp": 2.0, "diag/momentum_spread/norm": 0.5}
    summ = studies.fig6_summary([_fake_result([rec], 0.95)], quick_scale())
    rows = {r["layer"]: r for r in summ.rows}
    assert set(rows) == set(studies.ROLES) and all(r["granularity"] == "role" for r in rows.values())
    assert rows["embedding"]["ratio_0.95"] == pytest.approx(8.0)  # median(1, 2, 0.5) = 1
    assert "**role**" in summ.notes[0] and "no per-tensor keys" in summ.notes[0]


def test_final_matrix_weights(tmp_path):
    """Fig. 10's weight columns: attention and MLP matrices only, from the checkpoint of the final step."""
    from model import GPT, get_preset
    from model.checkpoint_files import sha256_file

    with torch.device("meta"):
        model = GPT(get_preset("debug"))
    roles = studies._param_roles([RunResult(Run("r", "x.yaml"), "ok", tmp_path,
                                            config={"model": {"preset": "debug"}})])
    value = {"attn": 0.5, "mlp": -0.25, "embedding": 9.0, "norm": 7.0}  # the last two must not count
    state = {k: torch.full(p.shape, value[roles[k]]) for k, p in model.named_parameters()}
    n = {role: sum(p.numel() for k, p in model.named_parameters() if roles[k] == role) for role in ("attn", "mlp")}
    ckpt = tmp_path / "ckpt"
    for step in (4, 6):
        (ckpt / f"step_{step:06d}").mkdir(parents=True)
        torch.save(state, ckpt / f"step_{step:06d}" / "model.pt")
        files = {"model.pt": sha256_file(ckpt / f"step_{step:06d}" / "model.pt")}  # as the trainer records them
        (ckpt / f"step_{step:06d}" / "meta.json").write_text(json.dumps({"step": step, "world_size": 1,
                                                                          "files": files}))
    (ckpt / "latest").write_text("step_000006")
    finished = RunResult(Run("r", "x.yaml"), "ok", tmp_path, records=[{"step": 6, "params_identical": True}])
    mean, mag = studies.final_matrix_weights(finished, roles)
    total = n["attn"] + n["mlp"]
    assert mean == pytest.approx((0.5 * n["attn"] - 0.25 * n["mlp"]) / total)
    assert mag == pytest.approx((0.5 * n["attn"] + 0.25 * n["mlp"]) / total)
    # the newest checkpoint is not the final step's (a run that stopped early, or an unfinished one): no numbers
    (ckpt / "latest").write_text("step_000004")
    assert studies.final_matrix_weights(finished, roles) == (None, None)
    unfinished = RunResult(Run("r", "x.yaml"), "ok", tmp_path, records=[{"step": 6, "train_loss": 1.0}])
    assert studies.final_matrix_weights(unfinished, roles) == (None, None)


def _finished(name: str, seed: int, val: float | None, labels=(), status: str = "ok") -> RunResult:
    recs = [{"step": 10, "val_loss": val}] if val is not None else []
    return RunResult(Run(name, "x.yaml", seed=seed, labels=tuple(labels)), status, Path(name), records=recs)


def test_paired_stats_pairs_by_seed():
    ref = [_finished("a", 1, 3.0), _finished("a", 2, 5.0), _finished("a", 3, 4.0)]
    # seed 3 unfinished in the arm, seed 4 has no reference: both left out of the pairs
    arm = [_finished("b", 2, 5.5), _finished("b", 1, 3.1), _finished("b", 3, 9.0, status="failed: rc=1"),
           _finished("b", 4, 1.0)]
    st = framework.paired_stats(arm, ref, lambda r: r.final("val_loss"), "d")
    assert st["d_n"] == 2
    assert st["d_mean"] == pytest.approx(0.3)
    assert st["d_std"] == pytest.approx(statistics.stdev([0.1, 0.5]))
    assert st["d_t"] == pytest.approx(0.3 / (statistics.stdev([0.1, 0.5]) / 2 ** 0.5))  # paired t, 1 dof
    # a common offset per seed cancels: the unpaired spread is large, the paired one is zero
    arm2 = [_finished("c", s, v + 0.25) for s, v in ((1, 3.0), (2, 5.0), (3, 4.0))]
    st2 = framework.paired_stats(arm2, ref, lambda r: r.final("val_loss"), "d")
    assert st2["d_mean"] == pytest.approx(0.25) and st2["d_std"] == pytest.approx(0.0, abs=1e-12)
    assert framework.seed_stats(arm2, lambda r: r.final("val_loss"), "v")["v_std"] == pytest.approx(1.0)
    assert framework.paired_stats(arm, [], lambda r: r.final("val_loss"), "d") == {"d_mean": None, "d_std": None,
                                                                                   "d_n": 0, "d_t": None}


def test_table2_summary_pairs_and_leaves_the_control_unranked():
    runs = []
    for seed, base in ((1, 5.0), (2, 4.0)):
        for arm, label, _, _, paper in studies.TABLE2_ARMS:
            off = {"fp32": 0.0, "1bit": 0.1, "8bit_l1": -0.05, "fp32_lr3e-4": -0.5, "8bit_l0": 0.2 * seed,
                   "8bit_l2": 0.3 * seed, "8bit_linf": 0.5 * seed}[arm]
            runs.append(_finished(f"{arm}{seed}", seed, base + off, (("arm", arm), ("label", label), ("paper", paper))))
    rows = {r["arm"]: r for r in studies.table2_summary(runs, framework.full_scale(300)).rows}
    assert rows["1bit"]["delta_vs_fp32_mean"] == pytest.approx(0.1)
    assert rows["1bit"]["delta_vs_fp32_std"] == pytest.approx(0.0, abs=1e-12)  # the seeds' 1.0 offset cancels
    assert rows["1bit"]["val_loss_std"] == pytest.approx(statistics.stdev([5.1, 4.1]))
    assert rows["8bit_l0"]["delta_vs_fp32_std"] == pytest.approx(statistics.stdev([0.2, 0.4]))
    # the control has the lowest loss but no rank; the paper's arms are ranked among themselves
    assert rows["fp32_lr3e-4"]["rank"] is None and rows["fp32_lr3e-4"]["delta_vs_fp32_mean"] == pytest.approx(-0.5)
    assert rows["8bit_l1"]["rank"] == 1 and rows["fp32"]["rank"] == 2
    assert sorted(r["rank"] for a, r in rows.items() if a not in studies.TABLE2_CONTROLS) == list(range(1, 7))


def test_compressors_summary_pairs_every_row_with_its_seeds_adamw():
    def run(opt, seed, val):  # the study's own variant, so the wire factor resolves its config
        return RunResult(Run(f"{opt}{seed}", studies.variant(opt), seed=seed, labels=(("optimizer", opt),)), "ok",
                         Path(opt), records=[{"step": 10, "val_loss": val}])
    runs = [run(opt, seed, base + off) for seed, base in ((1, 5.0), (2, 4.0), (3, 4.5))
            for opt, off in (("adamw_fp32", 0.0), ("muon", -0.2), ("onebit_adam", 0.05 * seed))]
    runs.append(run("muon", 4, 1.0))  # no AdamW run at seed 4: not paired
    rows = {r["optimizer"]: r for r in studies.compressors_summary(runs, framework.full_scale(300)).rows}
    assert rows["muon"]["delta_vs_adamw_mean"] == pytest.approx(-0.2) and rows["muon"]["delta_vs_adamw_n"] == 3
    assert rows["muon"]["delta_vs_adamw_std"] == pytest.approx(0.0, abs=1e-12)  # the seeds' offsets cancel
    assert rows["muon"]["val_loss_n"] == 4
    assert rows["onebit_adam"]["delta_vs_adamw_mean"] == pytest.approx(0.1)
    assert rows["onebit_adam"]["delta_vs_adamw_std"] == pytest.approx(statistics.stdev([0.05, 0.1, 0.15]))
    assert "delta_vs_adamw_mean" not in rows["adamw_fp32"]


def test_dion_summary_gap_is_per_seed():
    runs = []
    for seed, base in ((1, 4.0), (2, 4.4)):
        for r, gap in ((0.5, 0.01), (0.0625, 0.2)):
            runs.append(_finished(f"on{r}{seed}", seed, base + r, (("rank_fraction", r), ("error_feedback", True))))
            runs.append(_finished(f"off{r}{seed}", seed, base + r + gap * seed,
                                  (("rank_fraction", r), ("error_feedback", False))))
    rows = studies.dion_summary(runs, framework.full_scale(300)).rows
    off = {x["rank_fraction"]: x for x in rows if x["error_feedback"] == "off"}
    assert off[0.5]["gap_off_minus_on_mean"] == pytest.approx(0.015)
    assert off[0.0625]["gap_off_minus_on_mean"] == pytest.approx(0.3)
    assert off[0.0625]["gap_off_minus_on_std"] == pytest.approx(statistics.stdev([0.2, 0.4]))
    assert all(x.get("gap_off_minus_on_mean") is None for x in rows if x["error_feedback"] == "on")


# ---------------------------------------------------------------------------------------------
# every training study's --quick mode, end to end (torchrun, 2 ranks, debug model)

EXPECTED_COLUMNS = {
    "table2": {"label", "paper_val_loss", "val_loss_mean", "val_loss_std", "val_loss_n", "delta_vs_fp32_mean", "rank",
               "sign_match_pct", "sign_flip_pct", "sign_match_embedding_pct", "sign_match_mlp_pct", "status"},
    "table3": {"ranks", "scope", "tie_pct", "tie_attn_pct", "tie_mlp_pct", "pos_pos", "pos_neg", "pos_zero", "neg_pos",
               "neg_neg", "neg_zero", "zero_pos", "zero_neg", "zero_zero", "n", "status"},
    "fig10": {"beta2", "arm", "val_loss_mean", "delta_vs_exact_mean", "best_val_mean", "drift_mean", "tie_rate_pct", "tie_attn_pct",
              "w_mean", "w_abs", "status"},
    "fig5": {"beta2", "arm", "val_loss_mean", "val_loss_std", "delta_vs_sync_mean", "status"},
    "fig6_17": {"layer", "granularity", "role", "spread_0.95", "spread_0.99", "ratio_0.95", "ratio_0.99"},
    "compressors": {"optimizer", "val_loss_mean", "delta_vs_adamw_mean", "bytes_per_step", "wire_bytes_per_step",
                    "wire_factor", "status"},
    "dion_ef": {"rank_fraction", "error_feedback", "val_loss_mean", "gap_off_minus_on_mean", "status"},
    "lr_sweep": {"arm", "key", "lr", "val_loss_mean", "best", "edge", "status"},
}


def check_quick_study(out, name: str) -> list[dict]:
    """The files a --quick study writes into `out`: its csv's columns, plot, report, meta and run records;
    returns the run records."""
    rows = list(csv.DictReader(open(out / f"{name}.csv")))
    assert rows and EXPECTED_COLUMNS[name] <= set(rows[0]), (name, rows[:1])
    assert (out / f"{name}.png").stat().st_size > 5_000
    md = (out / f"{name}.md").read_text()
    assert md.startswith(("# Lion Cub", "# Dion", "# Learning-rate")) and "tokens seen / tokens available" in md and "|---" in md and "Machine (this report):" in md and "Runs trained on" in md
    meta = json.loads((out / f"{name}_meta.json").read_text())
    assert meta["machine"]["cpu_count"] and meta["scale"]["quick"] is True
    runs = [json.loads(x) for x in open(out / f"{name}_runs.jsonl")]
    for r in runs:
        if not r["status"].startswith("pending"):
            assert r["status"] in ("ok", "reused") and r["final_val_loss"] is not None, r
            assert r["load_before"] and r["wall_s"] > 0
    return runs


@pytest.mark.slow
def test_quick_training_studies_end_to_end(tmp_path, monkeypatch):
    out, work = tmp_path / "results", tmp_path / "work"
    launches = direct_launches(monkeypatch)  # the first run by torchrun, the others forked (quick_launch.py)
    for name in ["table2", "table3", "fig10", "dion_ef"]:  # the other quick studies: test_reproduce_quick.py
        assert main([name, "--quick", "--out", str(out), "--work", str(work)]) == 0, name
        runs = check_quick_study(out, name)
        if name == "table3":  # reused from table2 through the shared --work
            assert {r["how"] for r in runs} == {"reused"}
    assert launches.real == 1 and launches.direct > 0, vars(launches)

    # fig10's weight columns are filled from each run's final checkpoint (values: test_final_matrix_weights)
    for r in csv.DictReader(open(out / "fig10.csv")):
        assert r["w_mean"] and float(r["w_abs"]) > 0, r

    # numbers recomputed from the raw metrics: table3's vote table is the mean of the late diag records
    t3_rows = {r["scope"]: r for r in csv.DictReader(open(out / "table3.csv"))}
    t3 = t3_rows["all"]
    attn = t3_rows["attn"]  # the per-role table: its own distribution, and its tie rate is the role's
    assert sum(float(attn[f"{e}_{v}"]) for e in ("pos", "neg", "zero") for v in ("pos", "neg", "zero")) == \
        pytest.approx(100.0, abs=1e-6)
    assert float(attn["tie_pct"]) == pytest.approx(float(t3["tie_attn_pct"]))
    cells = [float(t3[f"{e}_{v}"]) for e in ("pos", "neg", "zero") for v in ("pos", "neg", "zero")]
    assert sum(cells) == pytest.approx(100.0, abs=1e-6)
    recs = [json.loads(x) for x in open(work / "runs" / "1bit_p2_s1337" / "metrics.jsonl")]
    diag = [r for r in recs if "diag/tie_rate" in r]
    last = max(r["step"] for r in diag)
    late = [r["diag/tie_rate"] for r in diag if r["step"] > last / 2]
    assert float(t3["tie_pct"]) == pytest.approx(100 * statistics.fmean(late))
    assert float(t3["tie_pct"]) == pytest.approx(float(t3["pos_zero"]) + float(t3["neg_zero"]) + float(t3["zero_zero"]))

    # table2: 8-bit L1 matches exact Lion's sign more often than the 1-bit vote (Lion Cub Fig. 4)
    t2 = {r["arm"]: r for r in csv.DictReader(open(out / "table2.csv"))}
    assert float(t2["8bit_l1"]["sign_match_pct"]) > float(t2["1bit"]["sign_match_pct"])
    assert t2["fp32"]["sign_match_pct"] == ""  # gradient sync: no diagnostics
    # dion_ef: both arms, and the gap column filled on the "off" row
    dion = {r["error_feedback"]: r for r in csv.DictReader(open(out / "dion_ef.csv"))}
    assert {(r["rank_fraction"], ef) for ef, r in dion.items()} == {("0.0625", "on"), ("0.0625", "off")}
    assert dion["off"]["gap_off_minus_on_mean"] and not dion["on"]["gap_off_minus_on_mean"]

    # a new machine: the run directories are gone, the store (committed with the results) is not; every
    # table is rebuilt from it, fig10's checkpoint-derived weights included
    import shutil

    tables = {n: (out / f"{n}.csv").read_text() for n in ("fig10", "table2", "table3")}
    shutil.copytree(work, tmp_path / "work_kept")
    shutil.rmtree(work)
    for n, text in tables.items():
        assert main([n, "--quick", "--out", str(out), "--work", str(work), "--report-only"]) == 0
        assert (out / f"{n}.csv").read_text() == text, n
        assert {json.loads(x)["how"] for x in open(out / f"{n}_runs.jsonl")} == {"stored"}
    shutil.rmtree(work, ignore_errors=True)  # --report-only launches nothing, so it may not have made one
    shutil.copytree(tmp_path / "work_kept", work)

    # a second invocation launches nothing and writes the same table
    before = (out / "fig10.csv").read_text()
    assert main(["fig10", "--quick", "--out", str(out), "--work", str(work)]) == 0
    assert (out / "fig10.csv").read_text() == before
    assert {json.loads(x)["how"] for x in open(out / "fig10_runs.jsonl")} == {"reused"}
    # a --report-only summary names the command that trains the runs, and says it was a summary
    assert main(["fig10", "--quick", "--out", str(out), "--work", str(work), "--report-only"]) == 0
    assert (out / "fig10.csv").read_text() == before
    meta = json.loads((out / "fig10_meta.json").read_text())
    assert meta["report_only"] is True and "--report-only" not in meta["command"] and "--quick" in meta["command"]
    assert f"Command: `{meta['command']}`" in (out / "fig10.md").read_text()


# ---------------------------------------------------------------------------------------------
# the committed full-size results are what the committed run store says


# fig10 is not here: its eight 1000-step runs finished before the run store existed and, unlike the other
# studies' seed-1337 runs, cannot be imported from its raw record (its table reads tie rates and the final
# checkpoint's weights, which the raw record lacks); reproduction_tiny.md says so. Retraining them puts it here.
@pytest.mark.parametrize("name", ["table2", "table3", "fig5", "fig6_17", "compressors", "dion_ef"])
def test_committed_tables_rebuild_from_the_store(name, tmp_path):
    """docs/results/reproduction/<study>.csv is rebuilt, to the byte, by `--report-only` from the committed run
    store alone (no run directories, no training): every number in the report traces back to a stored run,
    and a change to a study's summary that was not followed by regenerating its committed table fails here."""
    import shutil

    committed = framework.ROOT / framework.DEFAULT_RESULTS
    shutil.copytree(committed / framework.STORE_DIR, tmp_path / framework.STORE_DIR)
    meta = json.loads((committed / f"{name}_meta.json").read_text())
    argv = [a for a in shlex.split(meta["command"])[3:] if a != "--report-only"]
    assert argv[0] == name
    work = tmp_path / "no_runs"  # empty: every run must come from the store
    assert main([*argv, "--report-only", "--out", str(tmp_path), "--work", str(work)]) == 0, name
    assert (tmp_path / f"{name}.csv").read_text() == (committed / f"{name}.csv").read_text()
    assert {json.loads(x)["how"] for x in open(tmp_path / f"{name}_runs.jsonl")} == {"stored"}


def test_the_prose_setting_judges_on_a_quarter_of_its_val_split():
    """study-prose's verdicts are final val losses: its full runs evaluate 3 times on 64 global batches
    (131K tokens at 4 ranks x 4 x 128), not the scale's 8 (the val split's first three documents);
    the committed tiny-builtin setting keeps its own evaluation (its stored runs stay valid)."""
    from bench.reproduce import STUDIES, Options

    prose = STUDIES["table2"].scale(Options(setting="study-prose"))
    assert (prose.eval_every, prose.eval_steps) == (100, 64)
    tiny = STUDIES["table2"].scale(Options())
    assert (tiny.eval_every, tiny.eval_steps) == (30, 8)
    assert STUDIES["table2"].scale(Options(setting="study-prose", quick=True)).eval_steps != 64  # tests stay quick


# ---------------------------------------------------------------------------------------------
# runs shared by spec (none trains twice), the longer-horizon setting, Table 2's added seeds


def _dion_pair(o: Options):
    """The compressors' Dion run and dion_ef's rank-1/4 error-feedback run, with their scales."""
    comp, ef = STUDIES["compressors"], STUDIES["dion_ef"]
    sc, se = comp.scale(o), ef.scale(o)
    a = next(r for r in comp.build(sc, [1337], o) if r.label("optimizer") == "dion")
    b = next(r for r in ef.build(se, [1337], o) if r.label("rank_fraction") == 0.25 and r.label("error_feedback"))
    return (a, sc), (b, se)


def test_the_compressors_dion_run_serves_dion_efs_rank_quarter_run(tmp_path, monkeypatch):
    """Two names, override lists that differ in words (the preset's rank 1/4 and error feedback, stated or not)
    and in diag.every (10 / 0): one training run. Stored under the compressors' name, it serves dion_ef without
    a launch; a run without diagnostics does not serve one that wants them."""
    (a, sa), (b, sb) = _dion_pair(Options(setting="study-prose"))
    assert a.name != b.name and framework.run_spec(a, sa) != framework.run_spec(b, sb)
    ka, kb = framework.spec_key(framework.run_spec(a, sa)), framework.spec_key(framework.run_spec(b, sb))
    assert ka[0] == kb[0] and (ka[1], kb[1]) == (10, 0)
    assert framework.covers(10, 0) and not framework.covers(0, 10)
    # another rank is another run
    other = next(r for r in STUDIES["dion_ef"].build(sb, [1337], Options(setting="study-prose"))
                 if r.label("rank_fraction") == 0.0625 and r.label("error_feedback"))
    assert framework.spec_key(framework.run_spec(other, sb))[0] != kb[0]

    calls: list = []
    monkeypatch.setattr(framework, "_launch", _fake_launch(calls))
    store, quiet = tmp_path / "store", (lambda s: None)
    first = ensure_run(a, sa, tmp_path / "w1", echo=quiet, store=store)
    framework.save_stored(store, first, framework.run_spec(a, sa))
    assert calls == ["never"]
    served = ensure_run(b, sb, tmp_path / "w2", echo=quiet, store=store, by_spec=framework.stored_specs(store))
    assert (served.status, served.how, served.same_as, calls) == ("reused", "stored", a.name, ["never"])
    assert served.final("val_loss") == 1.0 and served.run.name == b.name
    # without the index (or with --restart) it trains
    assert ensure_run(b, sb, tmp_path / "w3", echo=quiet, store=store).how == "fresh" and len(calls) == 2

    # the other way round: dion_ef's run (no diagnostics) stored, the compressors' run trains
    store2 = tmp_path / "store2"
    r = ensure_run(b, sb, tmp_path / "w4", echo=quiet, store=store2)
    framework.save_stored(store2, r, framework.run_spec(b, sb))
    again = ensure_run(a, sa, tmp_path / "w5", echo=quiet, store=store2, by_spec=framework.stored_specs(store2))
    assert again.how == "fresh" and not again.same_as and len(calls) == 4


def test_a_study_trains_a_run_another_study_stored_under_another_name_once(tmp_path, monkeypatch):
    """The compressors' Dion run stored, then dion_ef at the same setting: its plan lists the shared run as
    stored, and its execution (the spec index) trains every run but that one."""
    calls: list = []
    monkeypatch.setattr(framework, "_launch", _fake_launch(calls))
    (a, sa), (b, sb) = _dion_pair(Options(setting="study-prose"))
    store = tmp_path / "results" / "store"
    r = ensure_run(a, sa, tmp_path / "work" / "compressors", echo=lambda s: None, store=store)
    framework.save_stored(store, r, framework.run_spec(a, sa))
    o = Options(setting="study-prose", out=tmp_path / "results", work=tmp_path / "work", seeds=[1337])
    planned, _ = framework.plan_study(STUDIES["dion_ef"], o, framework.stored_specs(store))
    state = {p.run.name: p.state for p in planned}
    assert state[b.name] == "stored" and sum(s == "to train" for s in state.values()) == len(state) - 1
    monkeypatch.setattr(framework, "token_budget", lambda run, scale, allow=False: {"read": 1, "available": 2})
    echoed: list = []
    STUDIES["dion_ef"].execute(o, echo=echoed.append)
    assert len(calls) == 1 + len(state) - 1  # every dion_ef run but the shared one trained
    assert any(f"the same run as the stored {a.name}" in line for line in echoed)


def test_longer_horizon_setting_runs_4x_the_steps_at_study_proses_swept_lr():
    o = Options(setting="study-prose-1200", lr=framework.FROM_SWEEP)
    base = Options(setting="study-prose", lr=framework.FROM_SWEEP)
    h = STUDIES["horizon"]
    sc, sb = h.scale(o), h.scale(base)
    assert (sc.steps, sc.eval_every, sc.ckpt_every, sc.eval_steps) == (1200, 200, 300, 64) and sb.steps == 300
    assert sc.overrides == sb.overrides  # the model, corpus and batch of study-prose: its sweep applies
    assert h.scale(Options(setting="study-prose-1200", steps=40)).steps == 40  # --steps still wins
    runs = h.runs(sc, studies.FULL_SEEDS, o)
    arms = {r.label("arm") for r in runs}
    assert arms == {a for a, _ in studies.HORIZON_ARMS} and len(runs) == 3 * len(arms)
    best = json.loads((Options(setting="study-prose").results_dir() / framework.BEST_LR_FILE).read_text())["best"]
    lr = {r.label("arm"): [x for x in r.overrides if x.startswith(("optim.lr=", "optim.matrix_lr="))][-1] for r in runs}
    assert lr["onebit_adam"] == f"optim.lr={best['onebit_adam']['value']:g}"
    assert lr["dion_r0.0625_ef0"] == f"optim.matrix_lr={best['dion']['value']:g}"
    assert lr["8bit_l1"] == f"optim.lr={best['lioncub_8bit_l1']['value']:g}"
    onebit = next(r for r in runs if r.label("arm") == "onebit_adam")
    assert "optim.freeze_step=180" in onebit.overrides  # 15 % of this run
    # the runs are the owning studies' runs: at study-prose the store serves every one of them
    sb_runs = h.runs(sb, studies.FULL_SEEDS, base)
    by_spec = framework.stored_specs(base.store_dir())
    assert all(framework.same_run_stored(by_spec, framework.run_spec(r, sb), r.name) for r in sb_runs)
    # the corpus at 1,200 steps: read once at most (the plan's line, from the size a stored run counted)
    planned = [framework.Planned("horizon", r, sc.steps, "to train") for r in runs]
    line = framework.corpus_line(planned, o)
    read = 1200 * 4 * 4 * 128 + 1
    assert f"reads {read:,} of " in line and "(9.3 %" in line, line


def test_table2_adds_two_seeds_to_the_arms_it_compares():
    o = Options(setting="study-prose")
    t2 = STUDIES["table2"]
    runs = t2.build(t2.scale(o), studies.FULL_SEEDS, o)
    seeds = {}
    for r in runs:
        seeds.setdefault(r.label("arm"), []).append(r.seed)
    five = [*studies.FULL_SEEDS, *studies.TABLE2_ADDED_SEEDS]
    assert {a: s for a, s in seeds.items() if a in studies.TABLE2_FIVE_SEEDS} == \
        {a: five for a in studies.TABLE2_FIVE_SEEDS}
    assert seeds["8bit_linf"] == studies.FULL_SEEDS
    # explicit --seeds and the committed tiny-builtin setting keep their seeds
    assert {r.seed for r in t2.build(t2.scale(o), [7], Options(setting="study-prose", seeds=[7]))} == {7}
    legacy = Options()
    assert {r.seed for r in t2.build(t2.scale(legacy), studies.FULL_SEEDS, legacy)} == set(studies.FULL_SEEDS)


def test_horizon_summary_pairs_each_arm_with_its_reference_by_seed():
    sc = full_scale(1200)
    vals = {"adamw_fp32": (5.0, 5.1, 5.2), "onebit_adam": (5.3, 5.3, 5.6), "dion_r0.25_ef1": (4.0, 4.1, 4.2),
            "dion_r0.25_ef0": (4.01, 4.12, 4.23)}
    results = []
    for arm, vs in vals.items():
        for seed, v in zip(studies.FULL_SEEDS, vs):
            run = studies.horizon_run(arm, sc, seed)
            # val losses at 100 (warm-up: not judged), 600 and 1200; 1-bit Adam's seed 1338 rises 0.3 after 600
            up = arm == "onebit_adam" and seed == 1338
            recs = [{"step": 100, "train_loss": 9.0, "val_loss": 9.0}, {"step": 600, "val_loss": v - (0.3 if up else -0.2)},
                    {"step": 1200, "train_loss": 5.0, "val_loss": v}]
            results.append(RunResult(run, "ok", Path("x"), records=recs))
    rows = {r["arm"]: r for r in studies.horizon_summary(results, sc).rows}
    one = rows["onebit_adam"]
    assert one["reference"] == "adamw_fp32" and one["delta_n"] == 3
    assert one["delta_mean"] == pytest.approx(0.3) and one["delta_std"] == pytest.approx(statistics.stdev([.3, .2, .4]))
    assert one["delta_t"] == pytest.approx(0.3 / (statistics.stdev([.3, .2, .4]) / 3 ** 0.5))
    assert one["verdict"] == "worse"                                  # t 5.2 > 4.30 at 2 dof
    assert one["val_rise"] == pytest.approx(0.3) and one["diverged"] == "1 of 3"
    assert rows["adamw_fp32"]["val_rise"] == 0 and rows["adamw_fp32"]["diverged"] == "0 of 3"
    assert rows["dion_r0.25_ef0"]["delta_mean"] == pytest.approx(0.02) and rows["adamw_fp32"]["reference"] == "-"
    assert rows["dion_r0.25_ef0"]["verdict"] == "not significant at 5 %"   # 0.01, 0.02, 0.03: t 3.5 < 4.30
    assert rows["1bit"]["val_loss_n"] == 0 and rows["1bit"]["delta_n"] == 0  # no run: an empty row
    # a pair missing: the t and the verdict are over the pairs, not the arm's seeds
    short = [r for r in results if not (r.run.label("arm") == "adamw_fp32" and r.run.seed == 1339)]
    one = {r["arm"]: r for r in studies.horizon_summary(short, sc).rows}["onebit_adam"]
    assert (one["val_loss_n"], one["delta_n"]) == (3, 2) and one["verdict"] == "not significant at 5 %"  # 12.71 at 1 dof
    # a run that stopped on a non-finite loss diverged, whatever its records say; one that failed otherwise (a
    # crash: no verdict) is not counted either way
    def one_bit(status, seed):
        return {r["arm"]: r for r in studies.horizon_summary(
            [RunResult(r.run, status, Path("x"), records=r.records) if r.run.label("arm") == "onebit_adam"
             and r.run.seed == seed else r for r in results], sc).rows}["onebit_adam"]

    assert one_bit(framework.diverged_status(412), 1337)["diverged"] == "2 of 3"
    assert one_bit("failed rc=1 (see x.log)", 1337)["diverged"] == "1 of 2"


def test_dion_ef_growth_is_a_paired_statistic_of_its_own():
    """Dion §4.1 (error feedback helps more as the rank falls) is judged on the per-seed difference of the two
    ranks' gains, not by comparing two rows: noisy gains whose means grow do not reproduce it."""
    sc = full_scale(1200)

    def results(gain_quarter, gain_sixteenth):
        out = []
        for rank, gains in (("0.25", gain_quarter), ("0.0625", gain_sixteenth)):
            for seed, g in zip(studies.FULL_SEEDS, gains):
                for ef, v in (("1", 5.0), ("0", 5.0 + g)):
                    recs = [{"step": 1200, "val_loss": v}]
                    out.append(RunResult(studies.horizon_run(f"dion_r{rank}_ef{ef}", sc, seed), "ok", Path("x"),
                                         records=recs))
        return out

    def note(res):
        return next(n for n in studies.horizon_summary(res, sc).notes if n.startswith("Dion §4.1"))

    assert note(results((.020, .021, .019), (.050, .052, .055))).endswith("reproduces (the gain grows, significant at 5 %, one-sided).")
    # a directional claim, tested one-sided: growths 0.01 / 0.02 / 0.03, t 3.5 at 2 dof (over 2.920, under the
    # two-sided 4.303) pass
    assert note(results((.020, .020, .020), (.030, .040, .050))).endswith(
        "t 3.5 at 2 dof over 3 seed(s): reproduces (the gain grows, significant at 5 %, one-sided).")
    noisy = note(results((.020, .021, .019), (.060, .010, .045)))   # means 0.020 -> 0.038, paired t 1.2
    assert "not reproduced here" in noisy and "t 1.2 at 2 dof over 3 seed(s)" in noisy
    assert note(results((.020,), (.018,))).endswith("-0.0020 over 1 seed(s): one unit, no verdict.")
    assert note([]).endswith("no seed has all four Dion runs yet.")


def test_config_files_and_overrides_go_anywhere_and_become_sets(tmp_path, monkeypatch, capsys):
    """util/cli.py's convention: config files and key=value words in any order with the flags and the study
    name; each changes every run after the setting, as --set does (files' lines first, in order, then the
    words, then --set), and the study sees them in Options.sets."""
    seen: list = []

    def execute(self, opts, echo=print):
        seen.append((self.name, opts.sets, opts.quick))
        return []

    monkeypatch.setattr(framework.Study, "execute", execute)
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("optim: {lr: 0.001, betas: [0.9, 0.99]}\ndata:\n  mix: {builtin: 1.0}\n")
    b.write_text("extends: a.yaml\ntrain: {out_dir: runs/x}\n")
    c = tmp_path / "c.yaml"  # a later file: its keys win, a nested mapping merges key by key (as in train.py)
    c.write_text("optim: {lr: 0.002}\ndata:\n  mix: {data/owt: 0.5}\n")
    assert main(["optim.warmup_steps=3", "--quick", str(b), "table2", "--set", "train.log_every=1", str(c),
                 "--out", str(tmp_path / "out")]) == 0
    want = ("optim.lr=0.002", "optim.betas=[0.9, 0.99]", "data.mix={\"builtin\": 1.0, \"data/owt\": 0.5}",
            "train.out_dir=runs/x", "optim.warmup_steps=3", "train.log_every=1")
    assert seen == [("table2", want, True)]
    # the lines parse back to the files' values (as a run's overrides), and through the setting's own merge
    from trainer.config import parse_overrides

    assert parse_overrides(list(want[:4])) == {"optim": {"lr": 0.002, "betas": [0.9, 0.99]},
                                               "data": {"mix": {"builtin": 1.0, "data/owt": 0.5}},
                                               "train": {"out_dir": "runs/x"}}
    opts = Options(quick=True, sets=want)
    merged = dict(x.split("=", 1) for x in opts.setting_overrides())
    assert merged["optim.lr"] == "0.002" and merged["train.log_every"] == "1"
    with pytest.raises(SystemExit) as e:
        main(["table2", "fig10"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "'fig10': expected a config file" in err and err.count("\n") == 1


def test_paired_verdict_words_and_critical_values():
    """Under the critical value the verdict is "not significant" (never "no difference"), at three decimals
    (4.301 at 2 dof is under 4.303); an interim arm's verdict says so with its degrees of freedom."""
    assert studies.paired_verdict(3, 4.301) == "not significant at 5 %"
    assert studies.paired_verdict(3, 4.31) == "worse" and studies.paired_verdict(3, -4.31) == "better"
    assert studies.paired_verdict(2, 42.3, "interim: 1 of 3 run(s) not trained yet") == "worse (interim, 1 dof)"
    assert studies.paired_verdict(2, 3.0, "failed: exit 3; interim: 1 of 3 run(s) not trained yet") == \
        "not significant at 5 % (interim, 1 dof)"
    assert studies.paired_verdict(1, 99.0) == "-"
