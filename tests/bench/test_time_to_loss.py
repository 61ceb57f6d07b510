"""bench.time_to_loss on small synthetic run directories: the target crossing, the curves stretched by
measured step times, --cluster parsing and its predicted compute and DiLoCo communication."""
from __future__ import annotations

import csv
import json
import math
import subprocess

import pytest
import yaml

from bench import time_to_loss as ttl
from bench.step_breakdown import cycle_steps, summarize_run

DEBUG = ["model.preset=debug", "data.batch_size=2", "data.seq_len=32"]
_CONFIGS: dict[str, dict] = {}


def resolved(variant: str) -> dict:
    """The resolved config a run of `variant` on the debug model writes (config.yaml)."""
    if variant not in _CONFIGS:
        from trainer.config import load_config

        _CONFIGS[variant] = load_config([f"configs/variants/{variant}.yaml"], DEBUG).to_dict()
    return json.loads(json.dumps(_CONFIGS[variant]))


def make_run(d, cfg: dict, vals: dict[int, float], steps: int = 20, step_ms=100.0, comm_ms=None, tokens=128):
    """A run directory: config.yaml, one train record per step (step_ms may be a function of the
    step), val records at the steps of `vals`."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    recs = []
    for s in range(1, steps + 1):
        ms = step_ms(s) if callable(step_ms) else step_ms
        cm = comm_ms(s) if callable(comm_ms) else (comm_ms if comm_ms is not None else ms / 2)
        recs.append({"step": s, "train_loss": 6.0 - 0.1 * s, "step_ms": ms, "comm_ms": cm, "fwdbwd_ms": ms - cm,
                     "comm_bytes": 8, "tokens": tokens * s})
        if s in vals:
            recs.append({"step": s, "val_loss": vals[s], "train_time_s": 0.1 * s})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return d


# ---- curves and the target crossing ---------------------------------------------------------------

def test_crossing_is_interpolated_between_evaluations():
    steps, losses = [10, 20, 30], [4.0, 3.0, 2.0]
    assert ttl.crossing_step(steps, losses, 2.5) == pytest.approx(25.0)
    assert ttl.crossing_step(steps, losses, 3.0) == pytest.approx(20.0)
    assert ttl.crossing_step(steps, losses, 5.0) == 10.0          # there at the first evaluation
    assert ttl.crossing_step(steps, losses, 1.0) is None          # never reached
    # the FIRST crossing counts, also when the curve rises again afterwards
    assert ttl.crossing_step([10, 20, 30, 40], [4.0, 2.9, 3.5, 2.0], 3.0) == pytest.approx(10 + 10 * 1.0 / 1.1)


def test_a_local_update_curve_is_read_at_the_steps_its_model_changes():
    """DiLoCo evaluates its global model, which moves only at outer steps: evaluated every 2 steps at H = 10 it
    reads 9.36 at steps 10-18 and 8.25 at 20. No model reached 8.94 before the outer step of 20 (a line between
    18 and 20 said 18.76); at a time inside the cycle its loss is the current model's, not a line."""
    cfg = diloco_config(inner_steps=10)
    cfg["train"]["max_steps"] = 20
    changes = ttl.model_changes(cfg)
    assert changes == [10.0, 20.0] and ttl.model_changes(resolved("adamw_fp32")) is None
    steps, losses = [10, 12, 14, 16, 18, 20], [9.36] * 5 + [8.25]
    assert ttl.crossing_step(steps, losses, 8.9375) == pytest.approx(18.76, abs=0.01)   # interpolated: wrong here
    assert ttl.crossing_step(steps, losses, 8.9375, changes) == 20.0
    assert ttl.crossing_step(steps, losses, 9.5, changes) == 10.0
    assert ttl.loss_at_step(steps, losses, 19, changes) == 9.36      # the model of step 10 until step 20
    assert ttl.loss_at_step([10, 20], [9.36, 8.25], 15, changes) == 9.36
    curve = ttl.Curve("d", "-", [float(s) for s in steps], losses, 1.0, cfg)
    assert curve.changes == changes


@pytest.mark.parametrize("H", [1, 5, 10])
def test_a_local_update_curve_evaluated_less_often_than_its_model_changes_reads_like_a_synchronous_one(H):
    """Evaluated every 200 steps while the model changes every H: the line between the evaluated models, as a
    synchronous curve's, snapped to the first outer step at or past its crossing (the review's H = 10 run:
    5.5 crossed at 949 interpolated, not at the next evaluation); the loss at a time is the current model's on
    that line. At H = 1 the two readings agree exactly."""
    steps, losses = [200, 400, 600], [6.0, 5.6, 5.3]
    changes = [float(c) for c in range(H, 601, H)]
    sync = ttl.crossing_step(steps, losses, 5.5)
    assert sync == pytest.approx(400 + 200 * 0.1 / 0.3)
    assert ttl.crossing_step(steps, losses, 5.5, changes) == H * math.ceil(sync / H - 1e-9)
    assert ttl.loss_at_step(steps, losses, 499, changes) == pytest.approx(
        ttl.loss_at_step(steps, losses, H * (499 // H)))
    assert ttl.loss_at_step(steps, losses, 400 + H - 1, changes) == 5.6   # the model evaluated at 400
    assert ttl.loss_at_step(steps, losses, 199, changes) is None     # before the first evaluated model
    assert ttl.loss_at_step(steps, losses, 600, changes) == 5.3


def test_a_local_update_curve_whose_evaluations_saw_older_models():
    # evaluated at 10 and 30; the model of step 30 is the one made at 30, 25 or 20
    assert ttl.crossing_step([10, 30], [9.0, 8.0], 8.5, [10.0, 20.0, 30.0]) == 20.0   # the line: 8.5 at 20
    assert ttl.crossing_step([10, 30], [9.0, 8.0], 8.7, [10.0, 20.0, 30.0]) == 20.0
    assert ttl.crossing_step([10, 30], [9.0, 8.0], 8.4, [10.0, 20.0, 30.0]) == 30.0
    # the evaluation at 30 saw the model of 25: the line runs from 10 to 25
    assert ttl.crossing_step([10, 30], [9.0, 8.0], 8.5, [10.0, 20.0, 25.0, 40.0]) == 20.0
    assert ttl.crossing_step([10, 30], [9.0, 8.0], 8.2, [10.0, 20.0, 25.0, 40.0]) == 25.0
    assert ttl.loss_at_step([10, 30], [9.0, 8.0], 22, [10.0, 20.0, 40.0]) == 8.0   # evaluated at 30: that model
    assert ttl.loss_at_step([10, 30], [9.0, 8.0], 22, [10.0, 20.0, 25.0, 40.0]) == pytest.approx(9.0 - 10 / 15)
    assert ttl.loss_at_step([10, 30], [9.0, 8.0], 35, [10.0, 20.0, 25.0, 40.0]) == 8.0
    assert ttl.loss_at_step([10, 30], [9.0, 8.0], 45, [10.0, 20.0, 25.0, 40.0]) is None  # a model never evaluated
    assert ttl.loss_at_step([0, 200, 400], [10.0, 5.0, 3.0], 500, [100.0, 200.0, 300.0, 400.0, 500.0]) is None
    # the model evaluated at s0 seen again at s (no change between) and now below: the evaluation's step
    assert ttl.crossing_step([10, 30], [9.0, 8.0], 8.5, [10.0, 40.0]) == 30.0


def test_streaming_model_changes():
    # Streaming DiLoCo (H 4, F 2, tau 1): each fragment's outer step tau after its send, and the end
    st = diloco_config(inner_steps=4, fragments=2, overlap_steps=1, alpha=0.5)
    st["train"]["max_steps"] = 10
    assert ttl.model_changes(st) == [3.0, 5.0, 7.0, 9.0, 10.0]


def test_load_curve_reads_val_loss_and_tokens_per_step(tmp_path):
    d = make_run(tmp_path / "adamw_fp32", resolved("adamw_fp32"), {5: 4.0, 10: 3.5, 20: 3.0}, tokens=256)
    with open(d / "metrics.jsonl", "a") as f:  # a re-logged evaluation of step 20 keeps the last
        f.write(json.dumps({"step": 20, "val_loss": 2.95}) + "\n")
    c = ttl.load_curve("adamw_fp32", d)
    assert c.steps == [5, 10, 20] and c.losses == [4.0, 3.5, 2.95]
    assert c.tokens_per_step == 256
    t = ttl.load_curve("adamw_fp32", d, metric="train_loss")
    assert len(t.steps) == 20 and t.losses[0] == pytest.approx(5.9)
    with pytest.raises(FileNotFoundError, match="--train"):
        ttl.load_curve("x", tmp_path / "nothing")


def test_time_axis_is_steps_times_measured_step_and_missing_target_reported(tmp_path):
    runs, bd = tmp_path / "runs", tmp_path / "bd" / "runs" / "1gbit"
    cfg_a, cfg_l = resolved("adamw_fp32"), resolved("lion_fp32")
    make_run(runs / "adamw_fp32", cfg_a, {10: 4.0, 20: 3.0})
    make_run(runs / "lion_fp32", cfg_l, {10: 3.5, 20: 3.2})                  # never reaches 3.0
    make_run(bd / "adamw_fp32", cfg_a, {}, step_ms=200.0)
    make_run(bd / "lion_fp32", cfg_l, {}, step_ms=50.0)
    curves = {n: ttl.load_curve(n, runs / n) for n in ("adamw_fp32", "lion_fp32")}
    target, src = ttl.default_target(curves, "adamw_fp32", "val_loss")
    assert target == 3.0 and "adamw_fp32" in src
    key = "(a) sim"
    times = {key: {n: ttl.measured_step(c, tmp_path / "bd", "1gbit", warmup=3) for n, c in curves.items()}}
    assert times[key]["adamw_fp32"]["step_s"] == pytest.approx(0.2)
    rows = {r["variant"]: r for r in ttl.report_rows(curves, target, times, "adamw_fp32")}
    assert rows["adamw_fp32"]["target_s"] == pytest.approx(20 * 0.2)
    assert rows["lion_fp32"]["target_step"] is None and rows["lion_fp32"]["target_s"] is None
    assert rows["lion_fp32"]["speedup"] is None and rows["lion_fp32"]["total_s"] == pytest.approx(20 * 0.05)
    md = ttl.markdown(list(rows.values()), {key: "MEASURED"}, target, src, "val_loss")
    assert "| lion_fp32 |" in md and "not reached" in md.split("| lion_fp32 |")[1].splitlines()[0]
    panels = ttl.curve_panels(curves, times)
    assert panels[key]["lion_fp32"][0] == pytest.approx([10 * 0.05, 20 * 0.05])
    # equal time: lion_fp32's whole run (1.0 s) is the quickest; adamw_fp32 is at step 5 then, before its
    # first evaluation; with lion at 0.3 s a step (6.0 s whole), adamw's 4.0 s reads its curve at step 20 and
    # lion's at 4.0 / 0.3 = 13.3 (3.5 - 0.3 x 3.3 / 10)
    assert rows["lion_fp32"]["budget_s"] == pytest.approx(1.0) and rows["lion_fp32"]["budget_loss"] == 3.2
    assert rows["adamw_fp32"]["budget_step"] == pytest.approx(5) and rows["adamw_fp32"]["budget_loss"] is None
    assert "before its first evaluation (5)" in md.split("| adamw_fp32 |")[1].splitlines()[0]
    times[key]["lion_fp32"]["step_s"] = 0.3
    rows = {r["variant"]: r for r in ttl.report_rows(curves, target, times, "adamw_fp32")}
    assert rows["adamw_fp32"]["budget_s"] == pytest.approx(4.0) and rows["adamw_fp32"]["budget_loss"] == 3.0
    assert rows["lion_fp32"]["budget_loss"] == pytest.approx(3.5 - 0.3 * (4.0 / 0.3 - 10) / 10)
    md = ttl.markdown(list(rows.values()), {key: "MEASURED"}, target, src, "val_loss")
    assert "val_loss at 4.00 s (at step)" in md and "| 3.0000 (20) |" in md
    times[key]["lion_fp32"]["step_s"] = 0.0                   # a broken measurement: no budget read from it
    rows = {r["variant"]: r for r in ttl.report_rows(curves, target, times, "adamw_fp32")}
    assert rows["lion_fp32"].get("budget_loss") is None and rows["adamw_fp32"]["budget_s"] == pytest.approx(4.0)


def test_loss_at_step_reads_between_evaluations_only():
    steps, losses = [10, 20, 40], [4.0, 3.0, 2.0]
    assert ttl.loss_at_step(steps, losses, 15) == pytest.approx(3.5)
    assert ttl.loss_at_step(steps, losses, 30) == pytest.approx(2.5)
    assert ttl.loss_at_step(steps, losses, 10) == 4.0 and ttl.loss_at_step(steps, losses, 40) == 2.0
    assert ttl.loss_at_step(steps, losses, 9.9) is None          # before the first evaluation
    assert ttl.loss_at_step(steps, losses, 40.5) is None         # past the last


def test_curve_of_several_seeds_and_run_store_entries(tmp_path):
    import gzip

    cfg = resolved("adamw_fp32")
    a = make_run(tmp_path / "s1", cfg, {10: 4.0, 20: 3.0, 30: 2.0}, steps=30)
    b = make_run(tmp_path / "s2", {**cfg, "train": {**cfg["train"], "seed": 7}}, {10: 3.0, 20: 2.0}, steps=30)
    entry = tmp_path / "store" / "adamw_s3.json.gz"   # bench.reproduce's run store: records and config
    entry.parent.mkdir()
    with gzip.open(entry, "wt") as f:
        json.dump({"config": cfg, "records": [{"step": 10, "val_loss": 2.0}, {"step": 20, "val_loss": 1.0},
                                              {"step": 20, "step_ms": 1.0, "tokens": 2560}]}, f)
    c = ttl.load_curve("adamw_fp32", [a, b, entry])
    assert c.runs == 3 and c.steps == [10, 20]                 # the steps every run evaluated
    assert c.losses == pytest.approx([3.0, 2.0]) and c.tokens_per_step == 128
    other = json.loads(json.dumps(cfg))
    other["optim"]["lr"] = 1.0
    with pytest.raises(ValueError, match="optim.lr"):
        ttl.load_curve("adamw_fp32", [a, make_run(tmp_path / "s4", other, {10: 3.0})])


def _auto(variant_cfg: dict) -> dict:
    """variant_cfg as the config of a run started with comm.mode=auto (before the trainer's choice)."""
    cfg = json.loads(json.dumps(variant_cfg))
    cfg["comm"] = {"mode": "auto"}
    return cfg


def test_a_run_trained_with_comm_mode_auto_is_read_at_the_mode_it_chose(tmp_path, capsys):
    import gzip

    from trainer.advise import load_variant

    chosen = load_variant("lioncub_1bit")
    d = make_run(tmp_path / "runs" / "auto", _auto(resolved("lion_fp32")), {10: 3.0})
    (d / "auto_mode.json").write_text(json.dumps({"variant": chosen.name, "mode": "onebit", "predicted_step_s": 0.1,
                                                  "sections": chosen.sections}))
    c = ttl.load_curve("auto", d)
    assert c.config["comm"] == resolved("lioncub_1bit")["comm"] and c.config["comm"]["mode"] == "onebit"
    cl = ttl.parse_cluster("nodes=1 gpus_per_node=4 gpu=h100 mfu=0.5")
    ref = ttl.load_curve("lioncub_1bit", make_run(tmp_path / "lc", resolved("lioncub_1bit"), {10: 3.0}))
    assert ttl.predict_cluster_step(c, cl)["bytes_per_step"] == ttl.predict_cluster_step(ref, cl)["bytes_per_step"]
    # a run-store entry has no directory: the auto_mode event of its records names the variant
    entry = tmp_path / "store" / "auto_s1.json.gz"
    entry.parent.mkdir()
    with gzip.open(entry, "wt") as f:
        json.dump({"config": _auto(resolved("lion_fp32")), "records": [
            {"step": 0, "event": "auto_mode", "variant": "lioncub_1bit", "mode": "onebit"},
            {"step": 10, "val_loss": 2.0}, {"step": 10, "step_ms": 1.0, "tokens": 1280}]}, f)
    assert ttl.load_curve("auto", entry).config["comm"] == c.config["comm"]
    # nothing records the choice: one line naming the file and the fix, exit code 2
    (d / "auto_mode.json").unlink()
    with pytest.raises(ValueError, match="comm.mode=auto and nothing records the mode it chose"):
        ttl.load_curve("auto", d)
    assert ttl.main(["--variants", "lion_fp32", "--run", f"lion_fp32={d}", "--target", "3", "--out",
                     str(tmp_path / "out"), "--cluster", "nodes=1 gpus_per_node=4 gpu=h100 mfu=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "auto_mode.json" in err and "--run lion_fp32=DIR" in err


def test_measured_run_of_another_setting_is_not_used(tmp_path):
    cfg = resolved("adamw_fp32")
    make_run(tmp_path / "runs" / "adamw_fp32", cfg, {10: 3.0})
    other = json.loads(json.dumps(cfg))
    other["data"]["seq_len"] = 64
    make_run(tmp_path / "bd" / "runs" / "1gbit" / "adamw_fp32", other, {})
    got = ttl.measured_step(ttl.load_curve("adamw_fp32", tmp_path / "runs" / "adamw_fp32"), tmp_path / "bd",
                            "1gbit", 3)
    assert "step_s" not in got and "data.seq_len" in got["missing"]


def test_command_end_to_end_on_synthetic_runs(tmp_path, capsys):
    runs, bd = tmp_path / "runs", tmp_path / "bd" / "runs" / "100mbit"
    for name, vals, ms in (("adamw_fp32", {10: 4.0, 20: 3.0}, 300.0), ("lioncub_1bit", {10: 3.6, 20: 2.9}, 60.0)):
        make_run(runs / name, resolved(name), vals)
        make_run(bd / name, resolved(name), {}, step_ms=ms)
    # the check: adamw_fp32 also trained end to end under the simulator (train_time_s = 0.1 s a step)
    make_run(tmp_path / "e2e" / "adamw_fp32", resolved("adamw_fp32"), {10: 4.0, 20: 3.0})
    out = tmp_path / "out"
    assert ttl.main(["--variants", "adamw_fp32", "lioncub_1bit", "--runs", str(runs), "--breakdown",
                     str(tmp_path / "bd"), "--link", "100mbit", "--setting", "tiny-builtin", "--out", str(out),
                     "--e2e", str(tmp_path / "e2e")]) == 0
    md = (out / "results.md").read_text()
    assert "MEASURED" in md and (out / "time_to_loss.png").stat().st_size > 0
    (check,) = csv.DictReader((out / "end_to_end.csv").open())
    assert check["variant"] == "adamw_fp32" and float(check["e2e_target_s"]) == pytest.approx(2.0)
    assert float(check["built_target_s"]) == pytest.approx(20 * 0.3)
    rows = {r["variant"]: r for r in csv.DictReader((out / "results.csv").open())}
    # lioncub_1bit crosses 3.0 at step 10 + 10 * 0.6 / 0.7 at 60 ms a step
    assert float(rows["lioncub_1bit"]["target_s"]) == pytest.approx((10 + 10 * 0.6 / 0.7) * 0.06)
    assert float(rows["lioncub_1bit"]["speedup"]) == pytest.approx(20 * 0.3 / ((10 + 60 / 7) * 0.06))
    # the header says what each curve's runs trained; like for like: no difference flagged
    lr = resolved("adamw_fp32")["optim"]["lr"]   # the lr each curve trained at is said
    assert f"- adamw_fp32 (1 run, model debug, data builtin, 128 tokens/step, lr {lr:g}):" in md and "differ" not in md
    # nothing trained or measured here: the header does not claim a setting shaped the runs
    assert "No run trained or measured by this command (its --setting and overrides are unused)" in md
    assert "Setting `" not in md
    # a curve of another global batch is flagged (equal steps are not equal tokens)
    make_run(runs / "lioncub_1bit", resolved("lioncub_1bit"), {10: 3.6, 20: 2.9}, tokens=256)
    assert ttl.main(["--variants", "adamw_fp32", "lioncub_1bit", "--runs", str(runs), "--breakdown",
                     str(tmp_path / "bd"), "--link", "100mbit", "--setting", "tiny-builtin", "--out", str(out)]) == 0
    md = (out / "results.md").read_text()
    assert "**The curves differ in global batch** (adamw_fp32: 128, lioncub_1bit: 256)" in md
    assert "differ in model" not in md and "differ in dataset" not in md


# ---- (b) the cluster --------------------------------------------------------------------------------

def test_parse_cluster():
    c = ttl.parse_cluster("nodes=2 gpus_per_node=8 gpu=h100 inter=10gbit intra=nvlink")
    assert (c.nodes, c.gpus_per_node, c.ranks, c.gpu, c.mfu) == (2, 8, 16, "H100", None)
    assert c.inter_bps == 10e9 and c.intra_bps == ttl.NAMED_LINKS["nvlink"]
    assert c.world_link() == (ttl.DEFAULT_LATENCY["inter"], 1 / 10e9)
    one = ttl.parse_cluster("nodes=1 gpus_per_node=4 gpu=a100 intra=400gbit mfu=0.4 intra_latency=2us")
    assert one.world_link() == (pytest.approx(2e-6), 1 / 400e9) and one.mfu == 0.4 and one.layout() is None


@pytest.mark.parametrize("text,names", [
    ("nodes=2 gpus=8 gpu=h100 inter=10gbit", "'gpus'"),
    ("nodes=0 gpu=h100", "nodes=0"),
    ("nodes=2 gpu=h100", "inter="),
    ("nodes=1 gpu=tpu9", "gpu=tpu9"),
    ("nodes=1 gpu=h100 mfu=1.5", "mfu=1.5"),
    ("nodes=1 gpu=h100 intra=fast", "intra=fast"),
    ("nodes=1 gpu=h100 inter_latency=30", "inter_latency=30"),
    ("nodes=1 gpu=h100 nodes=2", "nodes given twice"),
    ("nodes 2", "'nodes' is not key=value"),
])
def test_bad_cluster_is_one_line_naming_the_key(text, names):
    with pytest.raises(ValueError) as e:
        ttl.parse_cluster(text)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_bad_cluster_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as e:
        ttl.main(["--variants", "adamw_fp32", "--cluster", "nodes=2 gpu_per_node=8 gpu=h100 inter=10gbit"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "'gpu_per_node'" in err


def test_predicted_compute_from_flops_and_mfu(tmp_path):
    import torch

    from model import GPT, resolve_config
    from trainer.logger import PEAK_FLOPS

    cfg = resolved("adamw_fp32")
    curve = ttl.load_curve("adamw_fp32", make_run(tmp_path / "a", cfg, {10: 3.0}, tokens=4096))
    fast = ttl.predict_cluster_step(curve, ttl.parse_cluster("nodes=1 gpus_per_node=2 gpu=h100 intra=nvlink mfu=0.5"))
    slow = ttl.predict_cluster_step(curve, ttl.parse_cluster("nodes=1 gpus_per_node=2 gpu=h100 intra=nvlink mfu=0.25"))
    with torch.device("meta"):
        fpt = GPT(resolve_config(cfg["model"])).flops_per_token(32)
    assert fast["compute_s"] == pytest.approx(fpt * 4096 / (2 * PEAK_FLOPS["H100"] * 0.5))
    assert slow["compute_s"] == pytest.approx(2 * fast["compute_s"])
    assert fast["comm_s"] == pytest.approx(slow["comm_s"]) and fast["comm_s"] > 0
    assert fast["step_s"] == pytest.approx(fast["compute_s"] + fast["comm_s"])


def test_predicted_bytes_at_the_runs_vocabulary(tmp_path):
    import torch

    from model import GPT, resolve_config

    curve = ttl.load_curve("adamw_fp32", make_run(tmp_path / "a", resolved("adamw_fp32"), {10: 3.0}))
    cl = ttl.parse_cluster("nodes=1 gpus_per_node=4 gpu=h100 mfu=0.5")
    with torch.device("meta"):
        n = {v: sum(p.numel() for p in GPT(resolve_config({"preset": "debug"}, vocab_size=v)).parameters())
             for v in (None, 8192)}
    assert n[8192] < n[None]
    assert ttl.predict_cluster_step(curve, cl)["bytes_per_step"] == 4 * n[None]       # fp32 gradients
    small = ttl.predict_cluster_step(curve, cl, vocab_size=8192)
    assert small["bytes_per_step"] == 4 * n[8192]
    import model

    assert model.resolve_config({"preset": "debug"}).vocab_size != 8192            # restored afterwards


def test_mfu_from_the_gpu_check(tmp_path):
    cols = ["rate", "variant", "status", "mfu"]
    for run, rows in ((2, [("adamw_fp32", 0.1)]), (10, [("adamw_fp32", 0.30), ("lion_fp32", 0.28)])):
        with open(tmp_path / f"h100_run{run}_train_results.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(cols)
            w.writerows([("unlimited", v, "ok", m) for v, m in rows])
    assert ttl.gpu_check_mfu("H100", "lion_fp32", results=tmp_path)[0] == 0.28   # run 10, not run 2
    with open(tmp_path / "h100_run10_rerun_lion_train_results.csv", "w", newline="") as f:   # a rerun's row wins
        csv.writer(f).writerows([cols, ("unlimited", "lion_fp32", "ok", 0.29), ("unlimited", "muon", "ok", 0.2)])
    mfu, src = ttl.gpu_check_mfu("H100", "lion_fp32", results=tmp_path)
    assert mfu == 0.29 and "rerun" in src and ttl.gpu_check_mfu("H100", "adamw_fp32", results=tmp_path)[0] == 0.30
    mfu, src = ttl.gpu_check_mfu("H100", "lioncub_1bit", results=tmp_path)
    assert mfu == 0.30 and "adamw_fp32 row" in src and "lioncub_1bit was not measured" in src
    with pytest.raises(ValueError, match="mfu=0.35"):
        ttl.gpu_check_mfu("A100", "lion_fp32", results=tmp_path)
    # neither the variant nor the reference measured on that GPU: the median of what was (a practitioner review:
    # on H200 the baseline got no step time while a variant did, and the comparison was lost)
    mfu, src = ttl.gpu_check_mfu("H100", "diloco_h10", reference="dion", results=tmp_path)
    assert mfu == 0.29 and "median of its 3 measured variant(s) (adamw_fp32, lion_fp32, muon)" in src
    assert "neither diloco_h10 nor dion" in src
    assert ttl.gpu_check_mfu("H100", "diloco_h10", reference="diloco_h10", results=tmp_path)[0] == 0.29


# ---- DiLoCo: step time over a whole outer cycle --------------------------------------------------

def diloco_config(**opts) -> dict:
    cfg = resolved("adamw_fp32")
    cfg["comm"] = {"mode": "diloco", "diloco": opts}
    return cfg


def test_measured_diloco_step_is_the_mean_over_whole_cycles():
    H = 4
    cfg = diloco_config(inner_steps=H)
    assert cycle_steps(cfg) == H and cycle_steps(resolved("adamw_fp32")) == 1
    recs = [{"step": s, "step_ms": 500.0 if s % H == 0 else 100.0, "comm_ms": 400.0 if s % H == 0 else 0.0,
             "fwdbwd_ms": 100.0, "comm_bytes": 1000 if s % H == 0 else 0} for s in range(1, 25)]
    s = summarize_run(recs, warmup=3, cycle=H)
    assert s["steps"] == 20 and s["step_ms"] == pytest.approx((3 * 100 + 500) / 4)
    assert summarize_run(recs, warmup=3)["step_ms"] == 100.0       # the median would drop the sync steps
    with pytest.raises(ValueError, match="one cycle"):
        summarize_run(recs[:5], warmup=3, cycle=H)


def test_predicted_diloco_step_spreads_a_cycle_over_its_inner_steps(tmp_path):
    from comm import cost_model
    from optim.sync.diloco import DiLoCoOptions, cycle_bytes, cycle_seconds, fragment_numels, predict_cycle
    from trainer.advise import param_layout

    cfg = diloco_config(inner_steps=10, fragments=2, wire="e3m0")
    curve = ttl.load_curve("diloco", make_run(tmp_path / "d", cfg, {10: 3.0}))
    cl = ttl.parse_cluster("nodes=2 gpus_per_node=2 gpu=h100 inter=1gbit mfu=0.4")
    got = ttl.predict_cluster_step(curve, cl)
    o = DiLoCoOptions(inner_steps=10, fragments=2, wire="e3m0")
    numels = fragment_numels(o, param_layout(ttl._model(cfg)))
    assert len(numels) == 2 and sum(numels) == sum(p.numel() for p in ttl._model(cfg).parameters())
    with cost_model.node_layout(cl.layout()):
        cycle = cycle_seconds(o, 4, numels, *cl.world_link())
    assert got["comm_s"] == pytest.approx(cycle / 10) and got["comm_s"] > 0
    cb = cycle_bytes(o, 4, numels)
    assert got["bytes_per_step"] == pytest.approx(cb.sent / 10)
    assert got["peak_step_bytes"] == cb.peak_step and 0 < got["peak_step_bytes"] < cb.sent
    assert got["comm_how"].startswith("diloco: ") and "over 10 inner steps" in got["comm_how"]
    # an exchange on a background thread: tau inner steps of compute hide part of each average
    o2 = DiLoCoOptions(inner_steps=10, fragments=2, wire="e3m0", overlap_steps=2)
    exposed = predict_cycle(o2, 4, numels, 1e-5, 1e-9)
    hidden = predict_cycle(o2, 4, numels, 1e-5, 1e-9, step_compute_s=1e-4, background=True)
    assert hidden.comm_s < exposed.comm_s and exposed.wire_s == pytest.approx(hidden.wire_s)
    assert math.isclose(predict_cycle(o2, 4, numels, 1e-5, 1e-9, step_compute_s=10.0, background=True).comm_s, 0.0)
    # the cluster prediction runs them as the trainer does (background at overlap_steps > 0): hidden by compute
    tau = ttl.predict_cluster_step(ttl.load_curve("tau", make_run(tmp_path / "t", diloco_config(
        inner_steps=10, fragments=2, wire="e3m0", overlap_steps=2), {10: 3.0})), cl)
    with cost_model.node_layout(cl.layout()):
        want = predict_cycle(o2, 4, numels, *cl.world_link(), step_compute_s=tau["compute_s"], background=True)
    assert tau["comm_s"] == pytest.approx(want.comm_s) and tau["comm_s"] < got["comm_s"]
    bad = diloco_config(inner_steps=10, nonsense=1)
    with pytest.raises(ValueError, match="comm.diloco.nonsense"):
        ttl.predict_cluster_step(ttl.load_curve("bad", make_run(tmp_path / "b", bad, {10: 3.0})), cl)


def test_predicted_sharded_diloco_step_adds_fsdp_and_runs_the_replicate_axis(tmp_path):
    """parallel.shard_size = 2 on 2 nodes of 4 GPUs: 4 workers of 2 ranks (2 per node). Each rank's
    average carries its shards (rank 0's: ceil(rows / 2) rows); the 2 replicate rings share each node's
    port; FSDP's traffic inside a shard group is added on the intra link (fsdp_comm, checked against
    FSDP2's collectives in tests/workers/parallel_dist.py). A step-synchronous scheme at S > 1 and a
    shard group wider than a node are refused by name."""
    from comm import cost_model
    from optim.sync.diloco import DiLoCoOptions, cycle_bytes, cycle_seconds, fragment_numels
    from trainer.comm_prediction import fsdp_comm, param_layout, sharded_param_layout

    cfg = diloco_config(inner_steps=10, fragments=2, wire="e3m0")
    cfg["parallel"] = {"shard_size": 2}
    curve = ttl.load_curve("diloco_s2", make_run(tmp_path / "d", cfg, {10: 3.0}))
    cl = ttl.parse_cluster("nodes=2 gpus_per_node=4 gpu=h100 inter=1gbit intra=nvlink mfu=0.4")
    got = ttl.predict_cluster_step(curve, cl)
    model = ttl._model(cfg)
    o = DiLoCoOptions(inner_steps=10, fragments=2, wire="e3m0")
    whole, shards = param_layout(model), sharded_param_layout(model, 2)
    assert [layer for layer, _ in shards] == [layer for layer, _ in whole]
    assert sum(n for _, n in whole) / 2 <= sum(n for _, n in shards) < sum(n for _, n in whole)
    numels = fragment_numels(o, shards)
    layout = cl.layout(2)
    assert (layout.world_size, layout.node_size) == (4, 2)
    alpha, beta = cl.replicate_link(2)
    assert beta == pytest.approx(2 / 1e9) and cl.replicate_link(1) == cl.world_link()
    with cost_model.node_layout(layout):
        cycle = cycle_seconds(o, 4, numels, alpha, beta)
    fsdp_s, fsdp_bytes = fsdp_comm(model, 2, cl.intra_latency, 1 / cl.intra_bps)
    assert fsdp_s > 0 and fsdp_bytes > 0
    assert got["comm_s"] == pytest.approx(cycle / 10 + fsdp_s) and got["fsdp_bytes_per_step"] == fsdp_bytes
    assert got["bytes_per_step"] == pytest.approx(cycle_bytes(o, 4, numels).sent / 10)  # the slow axis only
    assert "4 workers" in got["comm_how"] and "FSDP in each node's shard groups of 2" in got["comm_how"]
    # the same run unsharded on the cluster: 8 workers, each sending its whole model's average
    flat = ttl.predict_cluster_step(ttl.load_curve("diloco", make_run(tmp_path / "f", diloco_config(
        inner_steps=10, fragments=2, wire="e3m0"), {10: 3.0})), cl)
    assert got["bytes_per_step"] < flat["bytes_per_step"]
    step_sync = resolved("adamw_fp32")
    step_sync["parallel"] = {"shard_size": 2}
    with pytest.raises(ValueError, match="local-update schemes only"):
        ttl.predict_cluster_step(ttl.load_curve("a", make_run(tmp_path / "a", step_sync, {10: 3.0})), cl)
    wide = ttl.parse_cluster("nodes=2 gpus_per_node=2 gpu=h100 inter=1gbit mfu=0.4")
    cfg4 = dict(cfg, parallel={"shard_size": 4})
    with pytest.raises(ValueError, match="does not divide gpus_per_node=2"):
        ttl.predict_cluster_step(ttl.load_curve("w", make_run(tmp_path / "w", cfg4, {10: 3.0})), wide)


def test_measure_rounds_a_diloco_measurement_up_to_whole_cycles(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    make_run(runs / "adamw_fp32", resolved("adamw_fp32"), {10: 3.0})
    make_run(runs / "diloco", diloco_config(inner_steps=4), {10: 3.1})
    (tmp_path / "diloco.yaml").write_text("comm:\n  mode: fp32\n")   # a config file: not runnable by name
    calls = []
    monkeypatch.setattr(ttl, "measure_steps", lambda names, overrides, link, bd, nproc, steps, warmup, nodes:
                        calls.append((names, overrides, steps)))
    assert ttl.main(["--variants", "adamw_fp32", str(tmp_path / "diloco.yaml"), "--runs", str(runs), "--link",
                     "1gbit", "--measure", "--measure-steps", "10", "--setting", "tiny-builtin", "optim.lr=3e-4",
                     "--out", str(tmp_path / "out")]) == 0
    (names, overrides, steps), = calls
    # the config file is named as not measurable; adamw_fp32 is measured as its curve trained (the debug
    # model, not the setting's): the variant plus the step-shaping settings in which the curve differs
    assert names == ["adamw_fp32@model.preset=debug@data.batch_size=2@data.seq_len=32"] and steps == 10
    assert overrides[-1] == "optim.lr=3e-4" and "optim.lr=1e-3" not in overrides   # yours replace the setting's
    # the short run keeps the curves' lr schedule (their horizon), yours coming after it
    horizon = max(resolved("adamw_fp32")["train"]["max_steps"], diloco_config(inner_steps=4)["train"]["max_steps"])
    assert overrides[0] == f"optim.schedule_steps={horizon}"
    calls.clear()
    monkeypatch.setattr(ttl, "measured_step", lambda c, bd, link, warmup, as_name=None: {"missing": "none"})
    monkeypatch.setattr(ttl, "load_curve", lambda n, d, metric: ttl.Curve(n, d, [1.0], [3.0], 1.0, diloco_config(
        inner_steps=4)))
    ttl.main(["--variants", "adamw_fp32", "--runs", str(runs), "--link", "1gbit", "--measure", "--measure-steps",
              "10", "--target", "3", "--setting", "tiny-builtin", "--out", str(tmp_path / "out2")])
    assert calls[0][2] == 12                                   # 10 steps rounded up to 3 cycles of 4


def test_a_variant_with_its_own_overrides_is_trained_and_measured_as_itself(tmp_path, monkeypatch):
    """`--variants adamw_fp32 diloco_h10@comm.diloco.inner_steps=4`: the override is that variant's alone
    (the AdamW run would refuse a comm.diloco key), its runs live under the entry's name, and --measure
    times it as the variant file plus the override. A config file outside configs/variants is said not
    measured (and why) in its row, not "--measure runs it"."""
    runs = tmp_path / "runs"
    trained, measured = [], []

    def train(name, files, overrides, run_dir, nproc, steps, evals, link="", nodes=0):
        trained.append((name, list(overrides)))
        cfg = resolved("adamw_fp32") if name == "adamw_fp32" else diloco_config(inner_steps=4)
        make_run(run_dir, cfg, {10: 3.0 if name == "adamw_fp32" else 3.1})
    monkeypatch.setattr(ttl, "train_curve", train)
    monkeypatch.setattr(ttl, "measure_steps", lambda names, overrides, link, bd, nproc, steps, warmup, nodes:
                        measured.extend(names))
    (tmp_path / "mine.yaml").write_text("comm:\n  mode: fp32\n")
    entry = "diloco_h10@comm.diloco.inner_steps=4"
    assert ttl.main(["--variants", "adamw_fp32", entry, str(tmp_path / "mine.yaml"), "--runs", str(runs), "--train",
                     "--link", "1gbit", "--measure", "--setting", "tiny-builtin", "--out", str(tmp_path / "out")]) == 0
    own = dict(trained)
    assert set(own) == {"adamw_fp32", entry, "mine"} and (runs / entry / "metrics.jsonl").is_file()
    assert own[entry][-1] == "comm.diloco.inner_steps=4" and not any("diloco" in o for o in own["adamw_fp32"])
    [timed] = [m for m in measured if m.startswith("diloco_h10")]
    assert "@comm.diloco.inner_steps=4" in timed, measured
    rows = {r["variant"]: r for r in csv.DictReader(open(tmp_path / "out" / "results.csv"))}
    assert "is not a bare configs/variants file" in rows["mine"]["missing"], rows["mine"]
    with pytest.raises(SystemExit):
        ttl.parse_args(["--variants", "diloco_h10@inner_steps", "--link", "1gbit"])
    # one file however it is spelt: two lrs of it are two candidates, the same lr twice is refused
    ns = ttl.parse_args(["--variants", "adamw_fp32@optim.lr=1e-3", "configs/variants/adamw_fp32.yaml@optim.lr=2e-3",
                         "--link", "1gbit"])
    assert [n for n, _ in ns.candidates] == ["adamw_fp32@optim.lr=1e-3", "adamw_fp32@optim.lr=2e-3"]
    for twice in (["adamw_fp32@optim.lr=1e-3", str(ttl.ROOT / "configs/variants/adamw_fp32.yaml") + "@optim.lr=1e-3"],
                  ["adamw_fp32@data.dataset=/data/x"]):  # ... and a '/' in an entry's own override
        with pytest.raises(SystemExit):
            ttl.parse_args(["--variants", *twice, "--link", "1gbit"])
    # --run names a candidate, '=' in its name included (the longest name the entry starts with)
    ns = ttl.parse_args(["--variants", "diloco_h10", "diloco_h10@parallel.shard_size=2", "--link", "1gbit",
                         "--run", "diloco_h10@parallel.shard_size=2=a/x=1.json.gz,b", "--run", "diloco_h10=c"])
    assert ns.given == {"diloco_h10@parallel.shard_size=2": "a/x=1.json.gz,b", "diloco_h10": "c"}
    for bad in (["--run", "diloco_h5=c"], ["--run", "diloco_h10"], ["--run", "diloco_h10=c", "--run", "diloco_h10=d"]):
        with pytest.raises(SystemExit):
            ttl.parse_args(["--variants", "diloco_h10", "--link", "1gbit", *bad])


def test_a_measured_run_shorter_than_the_curves_warmup_keeps_their_schedule(tmp_path):
    """The study's runs warm up for 20 of 1,200 steps; a measured run of 3 + 10 steps with their overrides is
    refused by the trainer's config check, and with schedule_of's override it is a valid run of their first
    steps (the lr, which does not shape a step, as in the curves' runs)."""
    from trainer.config import ConfigError, load_config

    files = ["configs/variants/adamw_fp32.yaml"]
    cfg = load_config(files, [*DEBUG, "optim.warmup_steps=20", "train.max_steps=1200"])
    long = ttl.Curve("adamw_fp32", str(tmp_path), [1200.0], [3.0], 1.0, cfg.to_dict())
    short = [*DEBUG, "optim.warmup_steps=20", "train.max_steps=13"]
    with pytest.raises(ConfigError, match="optim.warmup_steps: 20 >= train.max_steps=13"):
        load_config(files, short)
    extra = ttl.schedule_of([long, ttl.Curve("x", str(tmp_path), [1.0], [3.0], 1.0, {"train": {"max_steps": 300}})])
    assert extra == ["optim.schedule_steps=1200"]                    # the longest horizon of the curves
    ran = load_config(files, [*extra, *short])                        # valid: the curves' first 13 steps
    assert ran.train.max_steps == 13 and ran.optim.schedule_steps == 1200
    cfg2 = cfg.to_dict()
    cfg2["optim"]["schedule_steps"] = 5000                             # a curve's own schedule horizon wins
    assert ttl.schedule_of([ttl.Curve("y", str(tmp_path), [1.0], [3.0], 1.0, cfg2)]) == ["optim.schedule_steps=5000"]
    assert ttl.schedule_of([ttl.Curve("z", str(tmp_path), [1.0], [3.0], 1.0, {})]) == []


def test_train_curve_command(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(ttl.subprocess, "run", fake_run)
    ttl.train_curve("adamw_fp32", ["configs/variants/adamw_fp32.yaml"], ["model.preset=debug"], tmp_path / "r",
                    nproc=2, steps=40, evals=4)
    cmd = seen["cmd"]
    assert cmd[1:3] == ["-m", "launch.torchrun"] and "--nproc_per_node=2" in cmd
    i = cmd.index("train.py")
    assert cmd[i + 1:i + 3] == ["configs/variants/adamw_fp32.yaml", "model.preset=debug"]
    assert {"train.max_steps=40", "train.eval_every=10", f"train.out_dir={tmp_path / 'r'}"} <= set(cmd)

    def failing(cmd, stdout=None, **kw):      # the trainer's error as bench.step_breakdown reads it: heading + problems
        stdout.write("config:\n  - model.preset: debug\nError: 2 config problem(s):\n  - optim.lr: -1 must be > 0\n"
                     "  - train.max_steps: 0 must be >= 1\nTraceback (most recent call last):\n")
        return subprocess.CompletedProcess(cmd, 2)

    monkeypatch.setattr(ttl.subprocess, "run", failing)
    with pytest.raises(RuntimeError) as err:
        ttl.train_curve("x", [], [], tmp_path / "x", nproc=1, steps=4, evals=1)
    assert ("training x failed (exit 2: Error: 2 config problem(s): - optim.lr: -1 must be > 0 - train.max_steps: 0 "
            "must be >= 1); see") in str(err.value) and "model.preset" not in str(err.value)

    def killed(cmd, stdout=None, **kw):
        stdout.write("step 3 loss 4.1\n")
        return subprocess.CompletedProcess(cmd, -9)

    monkeypatch.setattr(ttl.subprocess, "run", killed)
    with pytest.raises(RuntimeError, match=r"training x failed \(exit -9\); see"):
        ttl.train_curve("x", [], [], tmp_path / "x", nproc=1, steps=4, evals=1)


def test_several_clusters_and_links_each_get_a_table(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs / "adamw_fp32", resolved("adamw_fp32"), {10: 4.0, 20: 3.0})
    for rate in ("100mbit", "1gbit"):
        make_run(tmp_path / "bd" / "runs" / rate / "adamw_fp32", resolved("adamw_fp32"), {},
                 step_ms=300.0 if rate == "100mbit" else 100.0)
    out = tmp_path / "out"
    assert ttl.main(["--variants", "adamw_fp32", "--runs", str(runs), "--breakdown", str(tmp_path / "bd"), "--link",
                     "100mbit,1gbit", "--cluster", "nodes=1 gpus_per_node=4 gpu=h100 mfu=0.5", "--cluster",
                     "nodes=2 gpus_per_node=4 gpu=h100 inter=1gbit mfu=0.5", "--setting", "tiny-builtin",
                     "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["setting"][:3] for r in rows] == ["(a)", "(a)", "(b)", "(b)"]
    assert [float(r["step_s"]) for r in rows[:2]] == [pytest.approx(0.3), pytest.approx(0.1)]
    assert float(rows[3]["comm_s"]) > float(rows[2]["comm_s"])       # 1 Gbit/s ports against NVLink


def test_time_to_loss_imports_no_study_so_a_study_may_import_it():
    """bench.time_to_loss reads run-store entries and settings through bench.runstore, never through
    bench.reproduce (whose package registers the studies): a study importing it adds no cycle."""
    from tests.project.test_imports import cycles, import_graph

    graph = import_graph()
    seen, todo = set(), ["bench.time_to_loss"]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    assert "bench.runstore" in seen and not any(m.startswith("bench.reproduce") for m in seen), sorted(seen)
    graph["bench.reproduce.studies"].add("bench.time_to_loss")
    assert cycles(graph) == []
    from bench import runstore
    from bench.reproduce import framework

    assert framework.load_stored is runstore.load_stored and framework.SETTINGS is runstore.SETTINGS


def test_seeds_mean_reaches_a_target_taken_from_the_same_finals(tmp_path):
    """A study takes its target as statistics.fmean of the reference's final losses; the curve's mean of the
    same seeds must be those bits, or the reference would not reach its own target (with these three finals
    sum / 3 is one ulp above fmean)."""
    import statistics

    finals = [4.9721, 4.6007, 4.9342]
    assert sum(finals) / 3 > statistics.fmean(finals)
    runs = [make_run(tmp_path / f"s{i}", resolved("adamw_fp32"), {10: 6.0, 20: v}) for i, v in enumerate(finals)]
    c = ttl.load_curve("adamw_fp32", runs)
    assert c.losses[-1] == statistics.fmean(finals)
    assert ttl.crossing_step(c.steps, c.losses, statistics.fmean(finals)) == 20.0


def test_an_lr_does_not_make_a_measured_step_another_one_but_a_dion_rank_does(tmp_path):
    """Settings that change a step's numbers but not its work or bytes (lrs, DiLoCo's outer lr) do not stop
    a measured run from timing a curve; any other step-shaping setting does (Dion's rank: another factor
    size on the wire), and measured_name then asks bench.step_breakdown for the curve's own."""
    dion = resolved("dion")
    curve = json.loads(json.dumps(dion))
    curve["optim"]["lr"], curve["optim"]["matrix_lr"] = 0.5, 0.7
    assert ttl.config_mismatch(curve, dion) is None
    curve["optim"]["rank_fraction"] = dion["optim"]["rank_fraction"] / 4
    assert "optim.rank_fraction" in ttl.config_mismatch(curve, dion)
    assert ttl.step_differences(curve, dion) == [("optim.rank_fraction", curve["optim"]["rank_fraction"])]
    make_run(tmp_path / "runs" / "dion", curve, {10: 3.0})
    c = ttl.load_curve("dion", tmp_path / "runs" / "dion")
    name = ttl.measured_name("dion", ["configs/variants/dion.yaml"], DEBUG, c)
    assert name == f"dion@optim.rank_fraction={curve['optim']['rank_fraction']}"
    from bench.variants import variant_args
    assert variant_args(name, "configs/variants")[1] == [name.split("@")[1]]   # what step_breakdown adds
    # the variant's own run measures another step; the one at the curve's rank is read under its name
    make_run(tmp_path / "bd" / "runs" / "1gbit" / "dion", dion, {}, step_ms=300.0)
    assert "optim.rank_fraction" in ttl.measured_step(c, tmp_path / "bd", "1gbit", 3)["missing"]
    make_run(tmp_path / "bd" / "runs" / "1gbit" / name, curve, {}, step_ms=200.0)
    assert ttl.measured_step(c, tmp_path / "bd", "1gbit", 3, name)["step_s"] == pytest.approx(0.2)
    # DiLoCo: the swept outer lr is not a difference, its inner steps are
    d = resolved("diloco_h10")
    e = json.loads(json.dumps(d))
    e["comm"]["diloco"]["outer_lr"] = 0.3
    assert ttl.config_mismatch(e, d) is None and ttl.step_differences(e, d) == []
    e["comm"]["diloco"]["inner_steps"] = 50
    assert ttl.step_differences(e, d) == [("comm.diloco.inner_steps", 50)]


def test_train_reuses_a_curve_run_only_when_it_is_the_run_it_would_train(tmp_path, monkeypatch):
    """--train: a run already in <runs>/<variant> is reused only when its config is what --train would
    train now; one trained on other data (or another model) is one error naming the key, not silently the
    curve. With no --target and no reference among the variants, nothing trains before the error."""
    from trainer.config import load_config

    trained = []
    monkeypatch.setattr(ttl, "train_curve", lambda name, files, overrides, run_dir, *a, **kw: trained.append(name))
    runs = tmp_path / "runs"
    argv = ["--variants", "adamw_fp32", "--runs", str(runs), "--train", "--steps", "40", "--cluster",
            "nodes=2 gpus_per_node=8 gpu=h100 inter=10gbit intra=nvlink", "--setting", "tiny-builtin", "--out",
            str(tmp_path / "out"), "data.dataset=/data/B"]
    ns = ttl.parse_args(argv)
    overrides = list(ttl.runstore.merge_overrides(ns.setting_overrides, ns.overrides))
    files = ["configs/variants/adamw_fp32.yaml"]
    run = runs / "adamw_fp32"
    want = load_config(files, [*overrides, *ttl._curve_settings(40, ns.evals, run)]).to_dict()
    on_a = json.loads(json.dumps(want))
    on_a["data"]["dataset"] = "/data/A"
    make_run(run, on_a, {20: 3.0})
    assert ttl.main(argv) == 2 and not trained
    assert ttl.curve_run_mismatch(files, overrides, run, 40, ns.evals) == "data.dataset is '/data/A' there, '/data/B' now"
    make_run(run, want, {20: 3.0})                            # the run --train would train: reused as it is
    assert ttl.curve_run_mismatch(files, overrides, run, 40, ns.evals) is None
    older = json.loads(json.dumps(want))  # saved by older code (a key added since), another timeout: the same curve
    del older["comm"]["init_timeout_s"]
    older["comm"]["timeout_s"] = 1.0
    make_run(run, older, {20: 3.0})
    assert ttl.curve_run_mismatch(files, overrides, run, 40, ns.evals) is None
    assert ttl.main(argv) == 0 and not trained
    assert "Setting `tiny-builtin` (the overrides of the runs this command trains or measures); yours on top: " \
           "`data.dataset=/data/B`." in (tmp_path / "out" / "results.md").read_text()
    # no target to reach and no reference to take it from: refused before any variant trains
    assert ttl.main(["--variants", "lion_fp32", "--runs", str(tmp_path / "none"), "--train", "--cluster",
                     "nodes=2 gpus_per_node=8 gpu=h100 inter=10gbit intra=nvlink", "--out", str(tmp_path / "o2")]) == 2
    assert not trained


def test_train_keeps_each_variant_s_lr_unless_told():
    """--train asks which method reaches a loss first, each at its own lr: the setting gives the model, corpus,
    batch and warmup, not its shared lr (a practitioner review: every optimizer trained at 1e-3 unsaid); --lr
    setting restores the shared one. The up-front config check runs at the run's length: inner_steps=400 is
    valid at study-prose-1200's 1,200 steps (the review of the change: it was checked at 300)."""
    ns = ttl.parse_args(["--variants", "adamw_fp32", "--link", "1gbit", "--setting", "tiny-builtin"])
    keys = {o.partition("=")[0] for o in ns.setting_overrides}
    assert "model.preset" in keys and "data.batch_size" in keys and "optim.lr" not in keys
    assert "optim.warmup_steps=20" in ns.setting_overrides   # the setting's warmup for every variant
    ns = ttl.parse_args(["--variants", "adamw_fp32", "--link", "1gbit", "--setting", "tiny-builtin", "--lr", "setting"])
    assert "optim.lr=1e-3" in ns.setting_overrides and "optim.warmup_steps=20" in ns.setting_overrides
    steps = ttl.setting_overrides("study-prose-1200")[1]
    from trainer.config import load_config
    over = [*ttl.setting_overrides("study-prose-1200")[0], "comm.diloco.inner_steps=400",
            *ttl._curve_settings(steps, 6, ttl.ROOT / "x")]
    assert load_config([ttl.ROOT / "configs/variants/diloco_h10.yaml"], over).comm.options.diloco.inner_steps == 400


def test_a_misspelt_override_and_a_foreign_out_are_refused_before_anything(tmp_path, capsys):
    """`model.presett=debug` is one line naming the key (it was accepted without --train and the report written
    as if it applied); an --out holding a results.md this command did not write is not written over."""
    d = make_run(tmp_path / "runs" / "adamw_fp32", resolved("adamw_fp32"), {10: 4.0, 20: 3.0})
    base = ["--variants", "adamw_fp32", "--run", f"adamw_fp32={d}", "--cluster",
            "nodes=2 gpus_per_node=8 gpu=h100 inter=10gbit mfu=0.3"]
    out = tmp_path / "out"
    assert ttl.main([*base, "--out", str(out), "model.presett=debug"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "model.presett" in err and not out.exists()
    assert ttl.main([*base, "--out", str(out)]) == 0           # its own report: replaced by the next run
    assert ttl.main([*base, "--out", str(out)]) == 0
    capsys.readouterr()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.md").write_text("my notes")
    assert ttl.main([*base, "--out", str(mine)]) == 2
    assert "this command did not write" in capsys.readouterr().err and (mine / "results.md").read_text() == "my notes"
