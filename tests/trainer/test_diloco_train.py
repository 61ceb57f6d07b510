"""comm.mode=diloco end to end: the trainer on 2 gloo ranks (tests/workers/diloco_train.py), and its
bad configurations (one line naming the key, exit 2)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.dist import ROOT, torchrun
from trainer.config import ConfigError, load_config, validate

TINY = ["model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.eval_steps=1", "log.wandb=disabled",
        "optim.name=adamw", "comm.mode=diloco", "comm.diloco.inner_steps=10"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("diloco_train")
    torchrun(2, "diloco_train.py", str(out), timeout=480)
    results = [json.loads((out / f"result_{r}.json").read_text()) for r in range(2)]
    shutil.rmtree(out)   # six runs' checkpoints (1.4 GB): the tests read the results only
    return results


def test_replicas_hold_identical_global_parameters_after_every_outer_step(results):
    watch = results[0]["streaming"]["watch"]
    # H = 3, F = 2, tau = 1: fragment 0 is sent after steps 1, 4, 7 and applied after 2, 5 (7's is
    # applied by the end of training); fragment 1 is sent after 3, 6 and applied after 4, 7
    assert [(w["step"], w["fragments"]) for w in watch] == [(2, [0]), (4, [1]), (5, [0]), (7, [1])]
    for w in watch:
        assert len(set(w["global"])) == 1, w            # every rank's global parameters, bit for bit
        assert len(set(w["local_before"])) == 2, w      # the workers trained apart in between
    assert len(set(results[0]["streaming"]["final"])) == 1  # after the run's end: one model everywhere
    assert results[0]["streaming"] == results[1]["streaming"]


def test_bytes_on_the_replicate_axis_equal_the_formula(results):
    s = results[0]["streaming"]
    assert s["background"] == ["BackgroundAverage"] * 2   # tau > 0: the averages run on their own thread
    booked = {int(k): v for k, v in s["booked"].items()}
    formula = {int(k): v for k, v in s["formula"].items()}
    assert booked == formula
    assert [t for t, b in sorted(formula.items()) if b] == [2, 4, 5, 7]   # the outer steps: nothing between
    assert len(set(b for b in formula.values() if b)) == 2                   # one size per fragment
    blocking = results[0]["blocking_bytes"]
    assert blocking["booked"] == blocking["formula"]
    assert [t for t, b in sorted(blocking["formula"].items(), key=lambda kv: int(kv[0])) if b] == ["3", "6"]
    # the run's total over its records is every average sent: the one sent after the last step (tau
    # = 1: fragment 0's, after step 7) is applied by the end of training, and fragment 1 (last sent
    # after step 6) sends step 7's pseudo-gradient for the final average; both in the finish record
    sent = {int(k): v for k, v in s["sent"].items()}
    assert [t for t, b in sorted(sent.items()) if b] == [1, 3, 4, 6, 7]   # five outer steps sent
    [finish] = s["finish"]
    assert finish["event"] == "finish" and finish["step"] == 7
    assert s["final_sent"] == formula[4] > 0             # fragment 1's size on the wire
    assert finish["finish_comm_bytes"] == sent[7] + s["final_sent"] and finish["finish_comm_bytes_recv"] > 0
    assert sum(booked.values()) + finish["finish_comm_bytes"] == sum(sent.values()) + s["final_sent"]
    assert sum(booked.values()) < sum(sent.values())   # the train records alone undercount
    # tau = 0: nothing is in flight at the end; the finish record holds the final average of step 7
    # (the last outer step was after step 6)
    assert [r["finish_comm_bytes"] for r in blocking["finish"]] == [blocking["final_sent"]]
    assert blocking["final_sent"] == blocking["formula"]["6"] > 0
    assert sum(blocking["booked"].values()) == sum(blocking["formula"].values())


def test_dion_inner_steps_with_clipping_send_nothing_between_outer_steps(results):
    """Dion as DiLoCo's inner optimizer with optim.grad_clip > 0: each worker clips by its own gradients'
    norm, so the steps between outer steps book 0 bytes on the replicate axis (they once booked the 4 of
    an averaged clipping norm) and the outer steps exactly the formula's."""
    d = results[0]["dion_clip"]
    booked = {int(k): v for k, v in d["booked"].items()}
    formula = {int(k): v for k, v in d["formula"].items()}
    assert booked == formula and [t for t, b in sorted(booked.items()) if b] == [3, 6]
    assert all(n is not None and n > 0.5 for n in d["clipped"][:2]), d["clipped"]   # the clip was active


def test_resume_at_an_outer_step_and_mid_inner_phase_continues_exactly(results):
    whole, pieces = results[0]["whole"], results[0]["pieces"]
    assert pieces["resumed_at"] == [3, 4]
    assert pieces["losses"] == whole["losses"] and len(whole["losses"]) == 7
    assert pieces["val_loss"] == whole["val_loss"]
    assert pieces["final"] == whole["final"] and len(set(whole["final"])) == 1


def test_streaming_resume_with_an_average_in_flight_books_its_bytes_and_continues_exactly(results):
    s, p = results[0]["streaming"], results[0]["streaming_pieces"]
    assert p["resumed_at"] == [3]
    # fragment 1's average was sent after step 3 and in flight at the stop; the resumed run books it
    # at its outer step (4) as the uninterrupted run does: no byte lost or booked twice
    assert p["booked"] == s["booked"]
    assert p["finish"][0]["finish_comm_bytes"] == s["finish"][0]["finish_comm_bytes"] > 0
    assert p["final"] == s["final"] and len(set(p["final"])) == 1
    assert results[1]["streaming_pieces"]["booked"] == p["booked"]


def test_a_finished_streaming_run_extended_past_its_end_trains_on(results):
    """The run ended right after a send (step 7), so its end applied that average early; resumed with a
    larger train.max_steps it skips that outer step and trains to the new end, the replicas identical."""
    e = results[0]["streaming_extended"]
    assert e["resumed_at"] == [7] and e["steps"][-3:] == [8, 9, 10]
    assert len(set(e["final"])) == 1 and e["final"] != results[0]["streaming"]["final"]


def test_a_rollback_with_an_average_in_flight_books_each_average_once(results):
    """A NaN at step 5 rolls the streaming run back to its checkpoint of step 3 while fragment 0's
    average (sent after step 4) is in flight: it is waited for and dropped, and the replayed steps book
    what the uninterrupted run books (it was booked twice at step 5: the dropped average's bytes and
    the replayed one's)."""
    s, r = results[0]["streaming"], results[0]["streaming_rollback"]
    assert r["nonfinite"] == [5]
    assert r["booked"] == s["booked"], (r["booked"], s["booked"])
    assert len(set(r["final"])) == 1
    assert results[1]["streaming_rollback"]["booked"] == r["booked"]


def test_the_wait_for_a_background_average_is_booked_as_comm_time(results):
    for run in ("streaming", "streaming_pieces"):
        s = results[0][run]
        booked = {int(k): v for k, v in s["booked"].items()}
        comm_ms = {int(k): v for k, v in s["comm_ms"].items()}
        # tau = 1: the averages run on a background thread; the step that applies one waits for it,
        # and that wait (the exchange the inner step did not hide) is the step's comm time
        # (the pieces' step 4 applies the average the checkpoint at step 3 had waited for: that wait
        # belongs to the save, and step 4 has its bytes with no wait)
        saved = {4} if run == "streaming_pieces" else set()
        assert all(comm_ms[t] > 0 for t, b in booked.items() if b and t not in saved), (run, comm_ms)
        assert all(comm_ms[t] == 0 for t, b in booked.items() if not b or t in saved), (run, comm_ms)


def test_worker_drift_is_logged_on_outer_steps_at_the_diagnostics_cadence(results):
    s = results[0]["streaming"]
    # diag.every = 2: diagnostics at 2, 4, 6; sends after 1, 4, 7 (fragment 0) and 3, 6 (fragment 1)
    assert s["diag_steps"] == [2, 4, 6]
    assert [(r["step"], r["diag/diloco_drift_fragment"]) for r in s["drift_logged"]] == [(4, 0), (6, 1)]
    want = {(w["step"], w["fragment"]): w for w in s["drift"]}
    assert sorted(want) == [(1, 0), (3, 1), (4, 0), (6, 1), (7, 0)]
    for r in s["drift_logged"]:   # the scalars on the e3m0 wire: the exact mean, not the decoded one
        w = want[(r["step"], int(r["diag/diloco_drift_fragment"]))]
        assert w["spread"] > 1e-3 and w["cos_min"] < 1
        for key in ("spread", "cos_min", "cos_mean"):
            assert r[f"diag/diloco_drift_{key}"] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key
    assert results[1]["streaming"]["drift_logged"] == s["drift_logged"]
    # the uninterrupted DiLoCo run took diagnostics, the pieces none: the same parameters bit for bit
    assert results[0]["pieces"]["final"] == results[0]["whole"]["final"]


def test_a_checkpoint_inside_a_cycle_holds_the_global_model(results):
    for r in results:
        c = r["checkpoint_mid_cycle"]
        assert c["model_is_global"] and not c["model_is_local"] and c["rank_file_local"], c


def test_a_damaged_outer_state_falls_back_to_the_previous_checkpoint(results):
    assert [r["damaged"] for r in results] == [{"step": 4, "outer_step": 4}] * 2


@pytest.mark.parametrize("override,key", [("comm.diloco.inner_steps=0", "comm.diloco.inner_steps"),
                                          ("comm.diloco.wire=pbit", "comm.diloco.wire"),
                                          ("comm.diloco.wire=onebit", "comm.diloco.wire"),
                                          ("comm.diloco.nonsense=1", "comm.diloco.nonsense"),
                                          ("comm.momentum_sync.every=2", "comm.momentum_sync.every"),
                                          ("comm.bucket_mb=1", "comm.bucket_mb")])
def test_bad_options_are_config_errors_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        validate(load_config(ROOT / "configs/default.yaml", TINY + [override]), world_size=2)
    lines = [ln for ln in str(e.value).splitlines() if key in ln]
    assert len(lines) == 1, str(e.value)


def test_a_run_shorter_than_the_first_outer_step_is_refused_naming_inner_steps():
    """train.max_steps below the first outer step (plus tau): the workers would only meet in the final
    average; the error names comm.diloco.inner_steps, the step of the first outer step and a fix. One
    outer step within the run is enough to be allowed."""
    for over, first in ((["comm.diloco.inner_steps=500"], "the first outer step comes after step 500"),
                        (["comm.diloco.inner_steps=50", "comm.diloco.fragments=2", "comm.diloco.overlap_steps=1",
                          "train.max_steps=25"], "the first fragment's outer step comes after step 26")):
        with pytest.raises(ConfigError) as e:
            load_config(ROOT / "configs/default.yaml", TINY + over)
        [line] = [ln for ln in str(e.value).splitlines() if "comm.diloco.inner_steps" in ln]
        assert first in line and "meet only in the final average" in line and "set comm.diloco.inner_steps" in line
    assert load_config(ROOT / "configs/default.yaml", TINY + ["comm.diloco.inner_steps=50", "comm.diloco.fragments=2",
                                                              "comm.diloco.overlap_steps=1", "train.max_steps=26"])
    assert load_config(ROOT / "configs/default.yaml", TINY + ["train.max_steps=10"])


@pytest.mark.parametrize("steps,streaming", [(50, False), (5, False), (12, True), (25, True)])
def test_the_suggested_inner_steps_is_itself_accepted(steps, streaming):
    """The fix the too-short error names is a value the config takes, with an outer step of every
    fragment inside the run (it said max_steps // 10 whatever the fragments and tau: 1 at 12 steps,
    which streaming's fragments=2 and overlap_steps=1 refuse)."""
    import re

    over = TINY + ["comm.diloco.inner_steps=500", f"train.max_steps={steps}"] + (
        ["comm.diloco.fragments=2", "comm.diloco.overlap_steps=1"] if streaming else [])
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/default.yaml", over)
    [line] = [ln for ln in str(e.value).splitlines() if "comm.diloco.inner_steps: 500" in ln]
    H, outer = map(int, re.search(r"e\.g\. (\d+): (\d+) outer step", line).groups())
    o = load_config(ROOT / "configs/default.yaml", over + [f"comm.diloco.inner_steps={H}"]).comm.options.diloco
    applied = [t for t in range(1, steps + 1) if 0 in o.due(t, o.overlap_steps)]  # fragment 0's outer steps
    assert outer == len(applied) >= 1 and H >= min(1, steps // 10), (line, applied)
    assert all(any(k in o.due(t, o.overlap_steps) for t in range(1, steps + 1)) for k in range(o.fragments))


def test_a_run_too_short_for_any_cycle_says_how_long_it_must_be():
    over = TINY + ["comm.diloco.inner_steps=500", "comm.diloco.fragments=2", "comm.diloco.overlap_steps=1",
                   "train.max_steps=2"]
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/default.yaml", over)
    assert "a run needs at least 3 steps for an outer step of every fragment" in str(e.value), str(e.value)
    assert load_config(ROOT / "configs/default.yaml", over[:-1] + ["train.max_steps=3", "comm.diloco.inner_steps=2"])


@pytest.mark.parametrize("bad", [["train.max_steps=50", "comm.diloco.inner_stepz=5"], ["train.max_steps=50", "comm.diloco=5"],
                                 ["train.max_steps=50", 'comm.diloco.inner_steps="5"'], ['train.max_steps="50"']])
def test_a_refused_key_is_not_checked_again_as_its_default(bad):
    """A misspelt key, a section that is not a mapping, a string for an int: one problem naming it, not a
    second one quoting the default standing in for the value refused (inner_steps 500 with 50 steps, or the
    default train.max_steps)."""
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/default.yaml", [x for x in TINY if "inner_steps" not in x] + bad)
    lines = [ln for ln in str(e.value).splitlines() if ln.strip().startswith("-")]
    assert len(lines) == 1 and "500" not in lines[0], str(e.value)


def test_a_misspelt_key_beside_the_key_it_resembles_hides_no_other_problem():
    """inner_stepz=5 beside inner_steps=2: the typo does not stand for inner_steps (given), so the problems of
    the section are still all reported (fragments 3 > inner_steps 2), with the typo, at once."""
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/default.yaml", TINY + ["comm.diloco.inner_stepz=5", "comm.diloco.fragments=3",
                                                          "comm.diloco.inner_steps=2"])
    msg = str(e.value)
    assert "comm.diloco.inner_stepz: unknown key" in msg and "comm.diloco.fragments" in msg, msg


def test_the_config_check_reports_more_fragments_than_blocks_with_the_other_problems():
    """The debug model has 2 blocks: fragments=3 is a config problem found before any rank starts, listed
    with a run too short for an outer step (both at once, not one per launch)."""
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/default.yaml", TINY + ["comm.diloco.fragments=3", "comm.diloco.inner_steps=500",
                                                               "train.max_steps=100"])
    msg = str(e.value)
    assert "comm.diloco.fragments: 3 fragments but the model has 2 blocks" in msg and "meet only in the final" in msg
    assert load_config(ROOT / "configs/default.yaml", TINY + ["comm.diloco.fragments=2"])
    # a starting point's shape is its own: not judged from the preset
    from trainer.config_validate import _blocks
    from trainer.config_schema import ModelConfig

    assert _blocks(ModelConfig(preset="debug")) == 2 and _blocks(ModelConfig(preset="debug", n_layer=5)) == 5
    assert _blocks(ModelConfig(preset="debug", init_from="/some/run")) is None


def test_more_fragments_than_blocks_exits_2_naming_the_key(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "configs/default.yaml", *TINY, "comm.diloco.fragments=3",
                           "comm.diloco.inner_steps=4", f"train.out_dir={tmp_path / 'run'}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("comm.diloco.fragments: 3 fragments but the model has 2 blocks") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "config problem" in proc.stderr  # the config check, before the build
    assert not (tmp_path / "run").exists()


def test_alpha_zero_with_overlap_is_a_banner_note_not_an_error(tmp_path):
    """comm.diloco.alpha = 0 with overlap_steps > 0 is valid (it is torchft's default) but throws away the
    tau inner steps each exchange overlapped: the run says so under its banner, naming both keys; the
    streaming preset (alpha 0.5) and tau = 0 say nothing."""
    from optim.sync.diloco import DiLoCoSchemeOptions

    assert DiLoCoSchemeOptions(diloco={"overlap_steps": 1, "alpha": 0.5}).notes() == []
    assert DiLoCoSchemeOptions(diloco={"overlap_steps": 0, "alpha": 0.0}).notes() == []
    preset = load_config(ROOT / "configs/variants/streaming_diloco.yaml", ["train.max_steps=200"]).comm.diloco
    assert preset.overlap_steps == 1 and DiLoCoSchemeOptions(diloco=preset).notes() == []
    proc = subprocess.run([sys.executable, "train.py", "configs/default.yaml", *TINY, "comm.diloco.inner_steps=2",
                           "comm.diloco.fragments=2", "comm.diloco.overlap_steps=1", "train.max_steps=4",
                           f"train.out_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [note] = [ln for ln in proc.stdout.splitlines() if ln.startswith("note: ")]
    assert "comm.diloco.alpha: 0 with comm.diloco.overlap_steps=1" in note and "discarding its 1 inner step" in note
