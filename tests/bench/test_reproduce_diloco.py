"""The diloco study of the reproduction suite: its run list (the baselines shared with horizon, the outer-lr
sweep on one seed, the comparison seeds at its best, the S = 2 arms), its summary on synthetic runs and its
--plan. No training: runs are built and summarized, never launched."""
from __future__ import annotations

import csv
import json
import re
import shlex
import shutil
import statistics

import pytest

from bench import time_to_loss as ttl
from bench.reproduce import STUDIES, framework, studies
from bench.reproduce.__main__ import main, parser, show_plan
from bench.reproduce.framework import NOT_RUN, Options, Run, RunResult

SETTING = "study-prose-1200"
DILOCO_ARMS = {a for a, _, _ in studies.DILOCO_ARMS}


def _opts(**kw) -> Options:
    return Options(setting=SETTING, lr=framework.FROM_SWEEP, **kw)


def _done(run: Run, val: float | None, status: str = "ok", records: list | None = None) -> RunResult:
    recs = records if records is not None else ([{"step": 1200, "val_loss": val}] if val is not None else [])
    return RunResult(run, status, framework.ROOT, records=recs)


def test_run_list_shares_horizons_baselines_and_sweeps_the_outer_lr_on_one_seed():
    o = _opts()
    st, hz = STUDIES["diloco"], STUDIES["horizon"]
    sc = st.scale(o)
    assert sc == hz.scale(o) and (sc.steps, sc.nproc, sc.diag_every) == (1200, 4, 0)
    runs = st.runs(sc, studies.FULL_SEEDS, o)
    base = [r for r in runs if r.label("arm") in studies.DILOCO_BASELINES]
    # the baselines are horizon's runs: the same names and specs, so the run store trains them once
    horizon = {r.name: framework.run_spec(r, sc) for r in hz.runs(sc, studies.FULL_SEEDS, o)}
    assert len(base) == 5 * 3 and all(horizon.get(r.name) == framework.run_spec(r, sc) for r in base)
    assert {r.label("arm") for r in base} == {"adamw_fp32", "fp32", "1bit", "8bit_l1", "dion_r0.0625_ef1"}
    # the DiLoCo arms list only their sweep: 6 arms x 3 outer lrs at the sweep seed (not a comparison seed)
    sweep = [r for r in runs if r.label("arm") in DILOCO_ARMS]
    assert len(runs) == len(base) + len(sweep) and len(sweep) == 6 * 3
    assert {(r.label("arm"), r.label("outer_lr"), r.seed) for r in sweep} == {
        (a, lr, studies.SWEEP_SEED) for a in DILOCO_ARMS for lr in (0.3, 0.7, 1.0)}
    assert studies.SWEEP_SEED not in studies.FULL_SEEDS
    best = json.loads((Options(setting="study-prose").results_dir() / framework.BEST_LR_FILE).read_text())["best"]
    for r in sweep:  # the resolved config: the arm's preset, outer lr, shard size, and AdamW's swept lr inside
        cfg = framework.run_config(r, sc)
        preset, shard = studies._diloco_arm(r.label("arm"))
        assert cfg.comm.mode == "diloco" and r.config == f"configs/variants/{preset}.yaml"
        assert cfg.comm.diloco.outer_lr == r.label("outer_lr") and cfg.parallel.shard_size == shard
        assert cfg.optim.name == "adamw" and cfg.optim.lr == best["adamw_fp32"]["value"]
    assert {r.label("arm") for r in sweep if framework.run_config(r, sc).parallel.shard_size == 2} == {
        "diloco_h10_s2", "diloco_h50_s2", "streaming_s2"}
    assert len({r.name for r in runs}) == len(runs)


def test_the_sweep_decides_each_arms_comparison_runs():
    o = _opts()
    st = STUDIES["diloco"]
    sc = st.scale(o)
    sweep = {(r.label("arm"), r.label("outer_lr")): r for r in st.runs(sc, studies.FULL_SEEDS, o)
             if r.label("role") == "sweep"}
    val = {0.3: 5.3, 0.7: 5.1, 1.0: 5.2}
    results = []
    for (arm, lr), run in sweep.items():
        if arm == "diloco_h10_s1":      # 1.0 diverged: counts as worse, the arm is decided
            results.append(_done(run, None, framework.diverged_status(90)) if lr == 1.0 else _done(run, val[lr]))
        elif arm == "diloco_h10_s2":    # 0.7, the best, crashed: it says nothing of its lr, the arm waits
            results.append(_done(run, None, "failed rc=1 (see log)") if lr == 0.7 else _done(run, val[lr]))
        elif arm == "diloco_h50_s2":    # the best at the grid's edge
            results.append(_done(run, 6.0 - lr))
        elif arm == "streaming_s1":     # 1.0 not run yet (--report-only): undecided
            results.append(_done(run, None, f"{NOT_RUN} (--report-only)") if lr == 1.0 else _done(run, val[lr]))
        elif arm == "streaming_s2":     # 0.7 missing altogether: undecided
            if lr != 0.7:
                results.append(_done(run, val[lr]))
        else:
            results.append(_done(run, val[lr]))
    chosen = studies.outer_lr_choice(results)
    assert chosen == {"diloco_h10_s1": 0.7, "diloco_h10_s2": None, "diloco_h50_s1": 0.7, "diloco_h50_s2": 1.0,
                      "streaming_s1": None, "streaming_s2": None}
    # a run stopped by a signal (exit 0 before its end) is no result either
    stopped = [_done(r.run, None, "failed rc=0 (stopped before its last step)") if r.run.label("arm") == "diloco_h10_s1"
               and r.run.label("outer_lr") == 0.3 else r for r in results]
    assert studies.outer_lr_choice(stopped)["diloco_h10_s1"] is None
    more = st.more_runs(results, sc, studies.FULL_SEEDS, o)
    assert {(r.label("arm"), r.label("outer_lr"), r.seed) for r in more} == {
        (a, lr, s) for a, lr in chosen.items() if lr is not None for s in studies.FULL_SEEDS}
    best = json.loads((Options(setting="study-prose").results_dir() / framework.BEST_LR_FILE).read_text())["best"]
    lr = best["adamw_fp32"]["value"]
    for r in more:  # at the inner lr the sweep gives AdamW, the outer lr in the name and in the spec
        assert r.name.endswith(f"_outer{r.label('outer_lr'):g}_p4_s{r.seed}_lr{lr:g}") and r.label("role") == "compare"
        assert f"optim.lr={lr:g}" in r.overrides and f"comm.diloco.outer_lr={r.label('outer_lr'):g}" in r.overrides
    # the plan's stand-ins: the comparison seeds of the undecided arms, never named like a real run
    later = st.more_runs(results, sc, studies.FULL_SEEDS, o, st.awaiting)
    assert sorted((r.label("arm"), r.seed) for r in later) == sorted(
        (a, s) for a in ("diloco_h10_s2", "streaming_s1", "streaming_s2") for s in studies.FULL_SEEDS)
    assert all("_outerbest_" in r.name for r in later) and not {r.name for r in later} & {r.name for r in more}


def test_a_best_at_the_lowest_outer_lr_runs_the_value_below_before_deciding():
    """0.3 best of 0.3 / 0.7 / 1.0 (a reading at H = 10: 5.43 / 5.66 / 5.95) says only that the best is 0.3 or
    below: the sweep adds OUTER_LR_BELOW at the sweep seed, the arm waits for it (no comparison runs at 0.3), and
    its result decides (better: 0.1; worse: 0.3, no longer at the edge). The --quick scale adds nothing."""
    o = _opts()
    st = STUDIES["diloco"]
    sc = st.scale(o)
    runs = [r for r in st.runs(sc, studies.FULL_SEEDS, o) if r.label("arm") == "diloco_h10_s1"]
    val = {0.3: 5.43, 0.7: 5.66, 1.0: 5.95}
    results = [_done(r, val[r.label("outer_lr")]) for r in runs]
    assert studies.outer_lr_choice(results) == {"diloco_h10_s1": None}
    [below] = st.more_runs(results, sc, studies.FULL_SEEDS, o)
    assert (below.label("outer_lr"), below.label("role"), below.seed) == (0.1, "sweep", studies.SWEEP_SEED)
    assert "comm.diloco.outer_lr=0.1" in below.overrides and "_outer0.1_" in below.name
    for v, want in ((5.30, 0.1), (5.50, 0.3)):
        done = results + [_done(below, v)]
        assert studies.outer_lr_choice(done) == {"diloco_h10_s1": want}
        more = st.more_runs(done, sc, studies.FULL_SEEDS, o)
        assert {(r.label("outer_lr"), r.label("role")) for r in more} == {(want, "compare")}, more
    # a diverged 0.1 counts as worse; a 0.1 not run yet (--report-only) leaves the arm waiting
    assert studies.outer_lr_choice(results + [_done(below, None, "failed: diverged at step 40")]) == {"diloco_h10_s1": 0.3}
    assert studies.outer_lr_choice(results + [_done(below, None, f"{NOT_RUN} (--report-only)")]) == {"diloco_h10_s1": None}
    assert studies.outer_lr_choice(results, extend=False) == {"diloco_h10_s1": 0.3}  # --quick


def _records(val: float, bytes_a: int, bytes_b: int) -> list[dict]:
    """Two log windows of 600 steps (comm_bytes: the window's mean per step) and two evaluations."""
    return [{"step": 600, "comm_bytes": bytes_a, "val_loss": val + 0.5, "train_loss": 9.0},
            {"step": 1200, "comm_bytes": bytes_b, "val_loss": val, "train_loss": 8.0}]


def _synthetic(sc, tmp_path) -> list[RunResult]:
    o = Options(setting=SETTING)
    st = STUDIES["diloco"]
    built = st.build(sc, studies.FULL_SEEDS, o)
    store = tmp_path / "results" / "store"
    out = []

    def add(run, val, b1, b2, status="ok"):
        r = RunResult(run, status, framework.ROOT, records=_records(val, b1, b2) if val is not None else [])
        r.entry = store / f"{run.name}.json.gz"
        r.tokens = {"read": 1200 * 4 * 4 * 128 + 1, "available": 26_463_019}  # as counted at launch
        out.append(r)

    ref = {1337: 5.0, 1338: 5.1, 1339: 5.2}
    for r in built:
        arm = r.label("arm")
        if arm == "adamw_fp32":
            add(r, ref[r.seed], 1000, 1000)
        elif arm == "fp32":
            add(r, ref[r.seed] + 0.1 + 0.01 * (r.seed - 1337), 1000, 1000)
        elif r.label("role") == "sweep" and arm in ("diloco_h10_s1", "diloco_h50_s1", "diloco_h10_s2"):
            lr = r.label("outer_lr")
            best = 1.0 if arm == "diloco_h50_s1" else 0.7
            add(r, 5.1 + abs(lr - best), 100, 0)
    for arm, lr, delta in (("diloco_h10_s1", 0.7, {1337: 0.02, 1338: 0.01, 1339: 0.03}),
                           ("diloco_h50_s1", 1.0, {1337: 0.30, 1338: 0.31, 1339: 0.29}),
                           ("diloco_h10_s2", 0.7, {1337: 0.0, 1338: 0.01, 1339: -0.01}),
                           ("diloco_h10_s1", 0.3, {1337: -1.0, 1338: -1.0, 1339: -1.0})):  # not the chosen lr
        for seed in studies.FULL_SEEDS:
            add(studies.diloco_run(arm, lr, sc, seed, "compare"), ref[seed] + delta[seed], 100, 0)
            out[-1].records.append({"event": "finish", "step": 1200, "finish_comm_bytes": 12000})  # sent at the end
    return out


def test_summary_reads_losses_bytes_and_time_to_loss_from_stored_runs(tmp_path):
    sc = STUDIES["diloco"].scale(Options(setting=SETTING))
    results = _synthetic(sc, tmp_path)
    s = studies.diloco_summary(results, sc)
    rows = {r["arm"]: r for r in s.rows}
    # the arms with runs only, each DiLoCo arm at the outer lr its sweep chose (the decoy at 0.3 left out)
    assert set(rows) == {"adamw_fp32", "fp32", "diloco_h10_s1", "diloco_h50_s1", "diloco_h10_s2"}
    h10 = rows["diloco_h10_s1"]
    assert (h10["outer_lr"], h10["workers"], rows["diloco_h10_s2"]["workers"]) == (0.7, "4 x 1", "2 x 2")
    assert h10["val_loss_n"] == 3 and h10["val_loss_mean"] == pytest.approx(5.12)
    assert h10["delta_mean"] == pytest.approx(0.02) and h10["delta_std"] == pytest.approx(0.01)
    assert h10["verdict"] == "not significant at 5 %"  # t = 3.5 < 4.30 at 2 dof
    assert rows["diloco_h50_s1"]["outer_lr"] == 1.0 and rows["diloco_h50_s1"]["verdict"] == "worse"
    assert rows["fp32"]["verdict"] == "worse" and "verdict" not in rows["adamw_fp32"]
    # slow-axis bytes: comm_bytes x window length summed with what the end sent, over the steps; vs AdamW's
    assert rows["adamw_fp32"]["bytes_per_step"] == pytest.approx(1000.0)
    assert h10["bytes_mean"] == pytest.approx(600 * 100 + 12000)
    assert h10["bytes_per_step"] == pytest.approx(60.0) and h10["bytes_vs_ref"] == pytest.approx(1000 / 60)
    assert h10["tokens"] == rows["adamw_fp32"]["tokens"] == 1200 * 4 * 4 * 128 + 1  # equal tokens
    # bytes between the two nodes, per node port and step, by the cost model: AdamW's ring over 4 ranks moves
    # 1.5 x its buffer through each port; 4 x 1 DiLoCo a tenth of that at H = 10; 2 x 2 two rings of half the
    # model sharing the port, a tenth of the buffer: 1.5 H fewer
    adamw = rows["adamw_fp32"]
    model = ttl._model(framework.run_config(results[0].run, sc).to_dict(), 8192)   # study-prose's vocab
    assert adamw["port_bytes"] == pytest.approx(1.5 * 4 * sum(p.numel() for p in model.parameters()), rel=1e-9)
    assert h10["port_vs_ref"] == pytest.approx(10) and rows["diloco_h50_s1"]["port_vs_ref"] == pytest.approx(50)
    assert rows["diloco_h10_s2"]["port_vs_ref"] == pytest.approx(15)
    assert h10["port_bytes_cycle"] == pytest.approx(10 * h10["port_bytes"]) and "port_bytes_cycle" not in adamw
    assert h10["delta_ci"] == pytest.approx(4.303 * 0.01 / 3 ** 0.5)
    # the sweep's table: every value, its gap to the arm's best, the best marked, a best at the grid's edge flagged,
    # a gap inside AdamW's spread over seeds (std 0.1 here) said
    table = dict(s.extra_tables)[studies.SWEEP_TABLE]
    assert re.search(r"\| diloco_h10_s1 \| 0.7 \| 5.1000 \| \+0.0000 \| best \|  \|  \|", table)
    assert re.search(r"\| diloco_h10_s1 \| 0.3 \| 5.5000 \| \+0.4000 \|  \|  \|  \|", table)
    assert re.search(r"\| diloco_h10_s1 \| 1.0 \| 5.4000 \| \+0.3000 \|  \|  \|  \|", table)
    assert re.search(r"\| diloco_h50_s1 \| 1.0 \| 5.1000 \| \+0.0000 \| best \| edge \|", table)
    # time to loss: nothing computed yet; one bench.time_to_loss command per target over every arm's stored entries,
    # both shard sizes in one table (S = 2 as the variant @parallel.shard_size=2), one breakdown directory
    ttl_keys = [k for t in studies.TTL_TARGETS for k, _ in studies.ttl_settings(t)]
    assert {h10[k] for k in ttl_keys} == {"not computed"}
    text = "\n".join(s.notes)
    cmds = re.findall(r"`(python -m bench\.time_to_loss [^`]*)`", text)
    assert len(cmds) == 2
    assert f"--target {statistics.fmean([5.0, 5.1, 5.2])!r}" in cmds[0]
    assert f"--target {rows['diloco_h50_s1']['val_loss_mean']!r}" in cmds[1]   # the loosest: every arm reaches it
    for c in cmds:
        assert "--link 100mbit,1gbit --nodes 2" in c and c.count("--cluster") == 2 and " --measure " in c
        assert "diloco_h10=" in c and "diloco_h10_s1_outer0.7_p4_s1338.json.gz" in c and "_outer0.3_" not in c
        assert "diloco_h10@parallel.shard_size=2=" in c and "diloco_h10_s2_outer0.7_p4_s1338.json.gz" in c
        assert "--vocab-size 8192" in c and f"{studies.DILOCO_TTL_DIR}/breakdown " in c
        assert " parallel.shard_size=2" not in c                # no longer an override of every variant
    assert "DiLoCo's finding" in text and "diloco_h50_s1 (4 x 1): Δ +0.3000 ± " in text
    assert "over 3 pairs (worse), 50x fewer bytes between nodes" in text

    # bench.time_to_loss's results written for AdamW's target: its cells read back; a long reason goes below
    out = tmp_path / "results" / studies.DILOCO_TTL_DIR / "target_adamw"
    out.mkdir(parents=True)
    argv = shlex.split(cmds[0])
    (out / "meta.json").write_text(json.dumps({"argv": argv[3:]}))
    link, cluster = studies.ttl_settings()[0][1], studies.ttl_settings()[2][1]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["setting", "variant", "step_s", "target_s", "budget_s", "budget_loss",
                                          "missing"])
        w.writeheader()
        w.writerows([{"setting": link, "variant": "diloco_h10", "step_s": 0.5, "target_s": 300.0},
                     {"setting": link, "variant": "diloco_h10@parallel.shard_size=2", "step_s": 0.4, "target_s": 200.0},
                     {"setting": link, "variant": "adamw_fp32", "step_s": 2.0, "target_s": 2400.0},
                     {"setting": link, "variant": "lion_fp32", "step_s": 2.0},
                     {"setting": cluster, "variant": "lion_fp32", "step_s": 0.01, "budget_s": 9.0,
                      "budget_loss": 5.4321},
                     {"setting": cluster, "variant": "diloco_h10", "missing": "the MFU is unknown"}])
    s = studies.diloco_summary(results, sc)
    rows = {r["arm"]: r for r in s.rows}
    assert (rows["diloco_h10_s1"]["ttl_adamw_100mbit"], rows["adamw_fp32"]["ttl_adamw_100mbit"]) == ("5.0 min",
                                                                                                       "40.0 min")
    assert rows["diloco_h10_s2"]["ttl_adamw_100mbit"] == "3.3 min"
    assert rows["fp32"]["ttl_adamw_100mbit"] == "not reached" and rows["diloco_h10_s1"]["ttl_adamw_cluster1"] == \
        "not predicted"
    assert rows["diloco_h50_s1"]["ttl_adamw_100mbit"] == "not in its results"
    # where bench.time_to_loss read the curve at equal time, the cell carries it after the time to target
    assert rows["fp32"]["ttl_adamw_cluster1"] == "not reached · 5.432 at 9.00 s" and "After '·'" in "\n".join(s.notes)
    assert rows["diloco_h10_s1"]["ttl_all_100mbit"] == "not computed"  # the other target's command has not run
    assert "diloco_h10_s1 (adamw_cluster1): the MFU is unknown" in "\n".join(s.notes)
    ttl_table = dict(s.extra_tables)[studies.TTL_TABLE]
    assert "| diloco_h10_s2 | 2 x 2 | 3.3 min |" in ttl_table and "to 5.1000 (AdamW), 100mbit simulated" in ttl_table
    # results of another command (other runs or another target) are not read
    (out / "meta.json").write_text(json.dumps({"argv": argv[3:-1]}))
    rows = {r["arm"]: r for r in studies.diloco_summary(results, sc).rows}
    assert rows["diloco_h10_s1"]["ttl_adamw_100mbit"] == "stale (computed from other runs)"


def test_a_failed_comparison_seed_is_named_and_the_sweep_s_failures_stay_in_its_table(tmp_path):
    """The review's scenarios: a diverged comparison seed is named in the finding (the Δ over the two left is
    said to be over 2 pairs); a diverged sweep run at a value the arm did not choose leaves the arm's row ok."""
    sc = STUDIES["diloco"].scale(Options(setting=SETTING))
    results = _synthetic(sc, tmp_path)
    bad = next(r for r in results if r.run.label("arm") == "diloco_h10_s2" and r.run.label("role") == "compare"
               and r.run.seed == 1339)
    bad.status, bad.records = framework.diverged_status(700), bad.records[:1]
    sweep = next(r for r in results if r.run.label("arm") == "diloco_h10_s1" and r.run.label("role") == "sweep"
                 and r.run.label("outer_lr") == 1.0)
    sweep.status = framework.diverged_status(90)
    s = studies.diloco_summary(results, sc)
    rows = {r["arm"]: r for r in s.rows}
    assert rows["diloco_h10_s1"]["status"] == "ok" and rows["diloco_h10_s1"]["outer_lr"] == 0.7
    assert "diverged at step 90" in dict(s.extra_tables)[studies.SWEEP_TABLE]
    assert rows["diloco_h10_s2"]["delta_n"] == 2 and rows["diloco_h10_s2"]["status"].startswith("failed: diverged")
    assert "diloco_h10_s2 (2 x 2): Δ +0.0050 ± 0.0635 over 2 pairs" in s.notes[-1]
    # an arm with a seed that did not finish is not timed on the others' curve: its cells say so
    assert rows["diloco_h10_s2"]["ttl_adamw_100mbit"] == "not timed: 2 of 3 seeds stored"
    assert "diloco_h10@parallel.shard_size=2" not in "\n".join(s.notes)
    assert "over 2 pairs (not significant at 5 %; left out: s1339: failed: diverged at step 700" in s.notes[-1]


def test_the_sweep_table_says_a_run_not_trained_yet_is_pending_not_failed(tmp_path):
    """An interim report (--report-only while the study trains): a sweep run not trained yet is "not trained
    yet" in the outer-lr table, as in the main table's status; a sweep run that failed still says why."""
    sc = STUDIES["diloco"].scale(Options(setting=SETTING))
    results = _synthetic(sc, tmp_path)
    built = STUDIES["diloco"].build(sc, studies.FULL_SEEDS, Options(setting=SETTING))
    sweep = [r for r in built if r.label("arm") == "streaming_s1" and r.label("role") == "sweep"]
    results += [_done(sweep[0], None, f"{NOT_RUN} (--report-only)"), _done(sweep[1], None, "failed: exit 3")]
    table = dict(studies.diloco_summary(results, sc).extra_tables)[studies.SWEEP_TABLE]
    waiting, failed = (next(line for line in table.splitlines() if f"| streaming_s1 | {r.label('outer_lr')} |" in line)
                       for r in sweep[:2])
    assert waiting.endswith("| not trained yet |") and "failed" not in waiting
    assert failed.endswith("| failed: exit 3 |")


def test_slow_axis_bytes_drop_a_stopped_run_s_records_past_its_checkpoint():
    """A run stopped at step 417 (its last log window flushed there) and resumed from the checkpoint of 300
    trains 301-417 again: the records before the resume past step 300 are not counted twice or mixed with
    the resumed windows."""
    run = studies.diloco_run("diloco_h10_s1", 0.7, STUDIES["diloco"].scale(Options(setting=SETTING)), 1337,
                             "compare")
    recs = [{"step": 200, "comm_bytes": 10}, {"step": 400, "comm_bytes": 10}, {"step": 417, "comm_bytes": 999},
            {"event": "resume", "step": 300}, {"step": 400, "comm_bytes": 10}, {"step": 600, "comm_bytes": 10}]
    r = RunResult(run, "ok", framework.ROOT, records=recs)
    assert studies.slow_axis_bytes(r) == 600 * 10
    assert studies.slow_axis_bytes_per_step(r) == 10


def test_plan_counts_the_runs_left_and_their_hours(tmp_path, capsys):
    """--plan before anything trained: every run to train, the comparison runs as stand-ins; with one arm's sweep
    stored, its comparison runs named at the chosen outer lr and the hours from the stored runs' wall time; the
    baselines counted once beside horizon."""
    out, work = tmp_path / "results", tmp_path / "work"
    out.mkdir()
    shutil.copy(Options(setting="study-prose").results_dir() / framework.BEST_LR_FILE, out)
    common = ["--setting", SETTING, "--lr", framework.FROM_SWEEP, "--out", str(out), "--work", str(work)]
    assert main(["diloco", "--plan", *common]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^diloco +51 +0 +0 +0 +51 +0$", text, re.M), text
    assert "18 of the runs to train are stand-ins" in text and "left: 51 of 51 run(s) (no finished run to time)" in text
    st = STUDIES["diloco"]
    o = _opts(out=out, work=work)
    sc = st.scale(o)
    for run in st.runs(sc, studies.FULL_SEEDS, o):
        if run.label("arm") == "diloco_h10_s1":
            r = _done(run, 5.0 + abs(run.label("outer_lr") - 0.7))  # inside the grid: no run below it
            r.wall_s = 1800.0
            framework.save_stored(out / framework.STORE_DIR, r, framework.run_spec(run, sc))
    assert main(["diloco", "--plan", *common]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^diloco +51 +3 +0 +0 +48 +0$", text, re.M), text
    assert "15 of the runs to train are stand-ins" in text
    assert "diloco_h10_s1_outer0.7_p4_s1338_lr0.001" in text and "diloco_h10_s1_outerbest" not in text
    assert "left: 48 of 51 run(s), about 24.0 h on this machine" in text  # 48 x the stored median, 30 min
    assert "cost: 3 finished run(s) recorded 1.5 h" in text
    # beside horizon (as `all` lists them): the five baselines' 15 runs are horizon's, counted there once
    show_plan(["horizon", "diloco"], parser().parse_args(["diloco", "--plan", *common]))
    text = capsys.readouterr().out
    assert re.search(r"^diloco +36 .*\(\+15 shared with an earlier study\)$", text, re.M), text


def test_first_trains_the_matching_runs_before_the_others(tmp_path, capsys):
    """--first GLOB: the outer-lr sweep (seed 7) ahead of the baselines it would otherwise wait behind; the
    same runs, in another order, in --plan as in a study's execution; a bad value is an argparse error."""
    runs = [framework.Run(n, "c.yaml", (), 1, 4) for n in ("horizon_a_s1337", "diloco_x_s7", "horizon_a_s1338",
                                                           "streaming_y_s7", "diloco_x_s1337")]
    got = [r.name for r in framework.first_ordered(runs, ("*_s7",))]
    assert got == ["diloco_x_s7", "streaming_y_s7", "horizon_a_s1337", "horizon_a_s1338", "diloco_x_s1337"]
    assert framework.first_ordered(runs, ()) == runs
    assert [r.name for r in framework.first_ordered(runs, ("nothing*", "*1338"))][0] == "horizon_a_s1338"
    out, work = tmp_path / "results", tmp_path / "work"
    out.mkdir()
    shutil.copy(Options(setting="study-prose").results_dir() / framework.BEST_LR_FILE, out)
    common = ["--setting", SETTING, "--lr", framework.FROM_SWEEP, "--out", str(out), "--work", str(work)]
    assert parser().parse_args(["diloco", "--first", "*_s7_*,x*", *common]).first == ("*_s7_*", "x*")
    assert main(["diloco", "--plan", "--first", "*_s7_*", *common]) == 0
    left = re.search(r"left: (.*)$", capsys.readouterr().out, re.M).group(1).split(", ")
    assert len(left) == 51 and all("_s7_" in n for n in left[:18]) and not any("_s7_" in n for n in left[18:])
    assert main(["diloco", "--plan", *common]) == 0
    plain = re.search(r"left: (.*)$", capsys.readouterr().out, re.M).group(1).split(", ")
    assert sorted(plain) == sorted(left) and plain[0].startswith("horizon_")
    with pytest.raises(SystemExit):
        parser().parse_args(["diloco", "--first", ","])


def test_first_orders_a_study_s_execution(tmp_path, monkeypatch):
    """The study's own loop visits the matching runs first (--report-only: nothing launches)."""
    out = tmp_path / "results"
    out.mkdir()
    shutil.copy(Options(setting="study-prose").results_dir() / framework.BEST_LR_FILE, out)
    seen, real = [], framework.ensure_run
    monkeypatch.setattr(framework, "ensure_run", lambda run, *a, **k: (seen.append(run.name), real(run, *a, **k))[1])
    main(["diloco", "--report-only", "--first", "*_s7_*", "--setting", SETTING, "--lr", framework.FROM_SWEEP,
          "--out", str(out), "--work", str(tmp_path / "work")])
    assert len(seen) == 33 and all("_s7_" in n for n in seen[:18]) and not any("_s7_" in n for n in seen[18:])


def test_report_only_of_a_study_still_training_is_interim_and_a_failed_run_still_fails_it(tmp_path, monkeypatch,
                                                                                           capsys):
    """--report-only over a study whose runs are not all trained writes the interim report and exits 0,
    naming the runs still to train (a note, not an error); a run that failed after its launch still makes
    it exit 1 and is named as failed."""
    out = tmp_path / "results"
    out.mkdir()
    shutil.copy(Options(setting="study-prose").results_dir() / framework.BEST_LR_FILE, out)
    argv = ["diloco", "--report-only", "--setting", SETTING, "--lr", framework.FROM_SWEEP, "--out", str(out),
            "--work", str(tmp_path / "work")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    # how many depends on what the committed store holds by now (the study trains over several sessions)
    assert re.search(r"note: study diloco: [1-9][0-9]* run\(s\) not trained yet \(", err) and "error" not in err
    assert f"note: {out / 'store'} does not exist: --report-only reads the run store under --out" in err
    assert (out / "diloco.md").is_file()
    real, victim = framework.ensure_run, "diloco_h10_s1_outer0.7_p4_s7"

    def one_failed(run, *a, **k):
        r = real(run, *a, **k)
        if run.name.startswith(victim):
            r.status = "failed rc=1 (see x.log)"  # a crash; a diverged run is a result (framework.DIVERGED)
        return r
    monkeypatch.setattr(framework, "ensure_run", one_failed)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert re.search(rf"error: study diloco: [1-9] run\(s\) failed or were not run \({victim}", err)
    assert "not trained yet" in err


def test_no_study_lists_them_and_says_what_to_name(capsys):
    """Without a study the command lists the studies and exits 2 with an error line saying what to name
    (--plan alone included); --list alone exits 0 with the list only."""
    assert main(["--plan"]) == 2
    out, err = capsys.readouterr()
    assert "diloco" in out and "horizon" in out
    assert err.strip() == "error: name a study to plan (one of the above, or all), e.g. python -m bench.reproduce all --plan"
    assert main([]) == 2 and "error: name a study to run" in capsys.readouterr().err
    assert main(["--list"]) == 0 and capsys.readouterr().err == ""


def test_an_interim_row_and_the_dion_growth_say_what_is_still_to_train():
    """A --report-only table row with runs not trained yet says "interim: k of n run(s) not trained yet"
    (not "failed"); a real failure is still named. Dion §4.1's growth over two seeds with a third to come is
    "not established", over the whole plan "not reproduced here" (no significant growth, one-sided)."""
    runs = {(arm, seed): Run(f"horizon_{arm}_p4_s{seed}", "configs/variants/dion.yaml", seed=seed,
                             labels=(("arm", arm),))
            for arm in ("dion_r0.25_ef0", "dion_r0.25_ef1", "dion_r0.0625_ef0", "dion_r0.0625_ef1")
            for seed in (1337, 1338, 1339)}
    val = {"dion_r0.25_ef1": 4.83, "dion_r0.25_ef0": 4.85, "dion_r0.0625_ef1": 5.03, "dion_r0.0625_ef0": 5.05}
    shift = {1337: 0.0, 1338: 0.004, 1339: -0.003}
    done = [_done(r, val[a] + shift[s] + (0.001 * (s - 1337) if a == "dion_r0.0625_ef0" else 0))
            for (a, s), r in runs.items() if s != 1339]
    waiting = [_done(r, None, f"{NOT_RUN} (--report-only)") for (a, s), r in runs.items() if s == 1339]
    assert framework.status_of(done[:2] + waiting[:1]) == "interim: 1 of 3 run(s) not trained yet"
    assert framework.status_of(done[:2]) == "ok"
    assert framework.status_of([*done[:1], _done(done[1].run, None, "failed: exit 3"), *waiting[:1]]) == \
        "failed: exit 3; interim: 1 of 3 run(s) not trained yet"
    groups = framework.group_runs(done + waiting, "arm")
    note = studies.ef_growth_note(groups)
    assert "over 2 seed(s): not established (no significant growth at 5 %, one-sided; interim, 4 of its runs not trained yet)." \
        in note
    full = [_done(r, val[a] + shift[s] + (0.001 * (s - 1337) if a == "dion_r0.0625_ef0" else 0))
            for (a, s), r in runs.items()]
    note = studies.ef_growth_note(framework.group_runs(full, "arm"))
    assert "over 3 seed(s)" in note and note.endswith("not reproduced here (no significant growth at 5 %, one-sided; a growth is not excluded).")


def test_without_an_adamw_run_the_loosest_target_is_still_timed(tmp_path):
    """No finished AdamW run: its target and Δs cannot be had, the loosest final of the arms still can (one
    command); the note says why the first is missing, not that nothing is stored."""
    sc = STUDIES["diloco"].scale(Options(setting=SETTING))
    results = [r for r in _synthetic(sc, tmp_path) if r.run.label("arm") != "adamw_fp32"]
    s = studies.diloco_summary(results, sc)
    text = "\n".join(s.notes)
    cmds = re.findall(r"`(python -m bench\.time_to_loss [^`]*)`", text)
    rows = {r["arm"]: r for r in s.rows}
    assert len(cmds) == 1 and f"--target {rows['diloco_h50_s1']['val_loss_mean']!r}" in cmds[0]
    assert "no finished AdamW run yet" in text and "no arm has all its runs stored" not in text
    assert rows["fp32"]["ttl_adamw_100mbit"] == "-" and rows["fp32"]["ttl_all_100mbit"] == "not computed"
