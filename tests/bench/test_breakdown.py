"""bench.step_breakdown / bench.variants / bench.quality: the table and summary arithmetic on
synthetic records, the cost-model mapping against a direct transcription of Lion Cub Table 1, and
a 2-rank smoke run of the real driver through bench.netsim (skipped without root / ip netns)."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from bench import quality, step_breakdown as sb, variants
from bench import netsim

NETSIM_SKIP = netsim.unavailable_reason(need_tc=False)


def _rec(step, step_ms, data, fwd, coll, pack, opt, nbytes=1000, **kw):
    return {"step": step, "train_loss": 5.0, "lr": 1e-3, "step_ms": step_ms, "data_ms": data, "fwdbwd_ms": fwd,
            "coll_ms": coll, "pack_ms": pack, "comm_ms": coll + pack, "opt_ms": opt, "comm_bytes": nbytes, **kw}


@pytest.mark.parametrize("caller,want", [(None, []), ("", []), ("/x{sep}{root}{sep}/x{sep}{sep}/y", ["/x", "/y"])])
def test_runs_get_the_repository_before_the_callers_pythonpath_each_entry_once(monkeypatch, caller, want):
    import os

    from bench import time_to_loss

    if caller is None:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONPATH", caller.format(sep=os.pathsep, root=sb.ROOT))
    expected = os.pathsep.join([str(sb.ROOT), *want])
    assert sb._env()["PYTHONPATH"] == expected and time_to_loss._env()["PYTHONPATH"] == expected


def test_summarize_run_drops_warmup_and_takes_medians():
    recs = [_rec(1, 9000, 1, 5000, 3000, 0, 999),            # warm-up outlier, must be dropped
            _rec(2, 100, 1, 19, 60, 10, 10),
            _rec(3, 120, 1, 29, 70, 10, 10),
            _rec(4, 110, 1, 24, 50, 20, 15),
            {"step": 4, "val_loss": 4.0}]
    s = sb.summarize_run(recs, warmup=1)
    assert s["steps"] == 3
    assert s["step_ms"] == 110
    assert s["compute_ms"] == 25          # median of 20, 30, 25 (data + fwd/bwd)
    assert s["comm_ms"] == 70             # median of 70, 80, 70
    assert s["coll_ms"] == 60 and s["pack_ms"] == 10 and s["other_ms"] == 10
    assert s["comm_share"] == pytest.approx(70 / 110)
    assert s["shard_bytes"] is None  # a replicated run logs none
    sharded = [{**r, "shard_bytes": b} for r, b in zip(recs[:4], (7, 300, 100, 200))]
    assert sb.summarize_run(sharded, warmup=1)["shard_bytes"] == 200
    with pytest.raises(ValueError, match="warm-up"):
        sb.summarize_run(recs, warmup=4)


def test_summarize_run_reports_throughput_and_mfu_only_when_every_step_has_it():
    recs = [_rec(1, 50, 1, 40, 0, 0, 5, tokens_per_s=1.0, mfu=0.01),   # warm-up (compile): dropped
            _rec(2, 30, 1, 20, 0, 0, 5, tokens_per_s=400.0, mfu=0.40),
            _rec(3, 31, 1, 20, 0, 0, 5, tokens_per_s=390.0, mfu=0.39),
            _rec(4, 32, 1, 20, 0, 0, 5, tokens_per_s=380.0, mfu=0.38)]
    s = sb.summarize_run(recs, warmup=1)
    assert s["tokens_per_s"] == 390.0 and s["mfu"] == pytest.approx(0.39)
    del recs[2]["mfu"]                     # CPU / unknown GPU: no MFU in a record -> no made-up number
    s = sb.summarize_run(recs, warmup=1)
    assert s["mfu"] is None and s["tokens_per_s"] == 390.0
    row = {"rate": "unlimited", "variant": "lion_fp32", "status": "ok", **sb.summarize_run(recs[:2] + recs[3:], 1)}
    line = next(ln for ln in sb.detail_markdown([row], "unlimited", ["lion_fp32"]).splitlines()
                if ln.startswith("| lion_fp32"))
    assert "| 390 |" in line and "| 39.0 % |" in line


def test_speedup_and_comm_reduction_per_rate():
    rows = [{"rate": "1gbit", "variant": "lion_fp32", "status": "ok", "step_ms": 900.0, "comm_ms": 700.0},
            {"rate": "1gbit", "variant": "lioncub_4bit", "status": "ok", "step_ms": 300.0, "comm_ms": 70.0},
            {"rate": "100mbit", "variant": "lioncub_4bit", "status": "ok", "step_ms": 500.0, "comm_ms": 100.0},
            {"rate": "1gbit", "variant": "dlion_mavo", "status": "failed rc=[1, 0]"}]
    for r in rows[:3]:
        r["comm_share"] = r["comm_ms"] / r["step_ms"]
    sb.add_relative(rows)
    assert rows[0]["speedup"] == 1.0
    assert rows[1]["speedup"] == pytest.approx(3.0) and rows[1]["comm_reduction"] == pytest.approx(10.0)
    assert rows[2]["speedup"] is None     # no baseline at that rate: no made-up number
    assert rows[3]["speedup"] is None
    md = sb.table4_markdown(rows, ["1gbit", "100mbit"], ["lion_fp32", "lioncub_4bit", "dlion_mavo"])
    line = next(ln for ln in md.splitlines() if ln.startswith("| lioncub_4bit"))
    assert line == "| lioncub_4bit | 0.300 | 23.3 | 0.500 | 20.0 |"
    assert "failed" in next(ln for ln in md.splitlines() if ln.startswith("| dlion_mavo"))


def test_a_hidden_exchange_makes_no_comm_ratio():
    """Streaming DiLoCo's average overlaps the next step and books only the wait: a comm time under the
    tables' resolution gives no comm ratio (it made 8661907.0x), and a missing ratio reads '-', not '-x'."""
    base = {"rate": "1gbit", "variant": "lion_fp32", "status": "ok", "step_ms": 900.0, "comm_ms": 600.0,
            "compute_ms": 250.0, "coll_ms": 590.0, "pack_ms": 10.0, "other_ms": 50.0, "comm_bytes": 4e7}
    hidden = {**base, "variant": "streaming_diloco", "step_ms": 300.0, "comm_ms": 0.0007, "coll_ms": 0.0007,
              "pack_ms": 0.0}
    some = {**base, "variant": "diloco_h50", "step_ms": 310.0, "comm_ms": 12.0}
    rows = sb.add_relative([base, hidden, some])
    assert hidden["comm_reduction"] is None and hidden["speedup"] == pytest.approx(3.0)
    assert some["comm_reduction"] == pytest.approx(50.0)
    for r in rows:
        r["comm_share"] = r["comm_ms"] / r["step_ms"]
    md = sb.detail_markdown(rows, "1gbit", ["lion_fp32", "streaming_diloco", "diloco_h50"])
    cells = next(ln for ln in md.splitlines() if ln.startswith("| streaming_diloco")).split(" | ")
    assert cells[10:13] == ["3.00x", "-", "-"]     # speedup, vs overlapped fp32 (no such row), comm ÷
    assert "| 50.0x |" in next(ln for ln in md.splitlines() if ln.startswith("| diloco_h50"))
    # a report over runs of several lengths names their range, not the command's --steps
    for r, n in zip(rows, (10, 50, 50)):
        r["steps"] = n
    assert sb._steps_measured(rows, {"steps": 10}) == "10-50"
    assert sb._steps_measured(rows[:1], {"steps": 7}) == "10" and sb._steps_measured([], {"steps": 7}) == "7"


def test_prediction_matches_table1_transcription():
    model = {"preset": "tiny", "tie_embeddings": False, "pos_emb": "rope", "block_size": 0}
    from model import get_preset

    pc = get_preset("tiny", tie_embeddings=False)
    roles = variants.role_params(model)
    n = variants.num_params(model)
    assert roles["head"] == pc.vocab_size * pc.n_embd and sum(roles.values()) == n
    P, a, b = 4, 50e-6, 1e-9
    ms_off = {"every": 0, "layers": ["head"], "start": 0, "stop": 0}
    cases = {  # comm section -> Lion Cub Table 1 bandwidth terms with ring latency per collective, by hand
        "fp32": ({"mode": "fp32"}, 2 * (P - 1) * a + 2 * (P - 1) / P * n * 32 * b),
        "bf16": ({"mode": "bf16"}, 2 * (P - 1) * a + 2 * (P - 1) / P * n * 16 * b),
        "onebit": ({"mode": "onebit"}, 2 * (P - 1) * a + (1 + (P - 1) / P) * n * b),
        "pbit4": ({"mode": "pbit", "bits": 4}, 2 * (P - 1) * a + 2 * (P - 1) / P * n * 4 * b),
        # our packed parameter server: the server's link carries P-1 payloads in, P-1 out
        "ps_tiebreak": ({"mode": "ps", "ps_topology": "naive", "ps_aggregate": "vote_tiebreak"},
                        2 * (P - 1) * a + 2 * (P - 1) * n * b),
        "ps_exact": ({"mode": "ps", "ps_topology": "naive", "ps_aggregate": "vote"},
                     2 * (P - 1) * a + (P - 1) * n * (2 + 2) * b),  # ternary signs: 2 bits each way
        "ps_avg": ({"mode": "ps", "ps_topology": "naive", "ps_aggregate": "avg"},
                   2 * (P - 1) * a + (P - 1) * n * (1 + 3) * b),  # ceil(log2(P+1)) = 3 bits back
        # mask_zero_updates adds one fp32 allreduce of a flag per parameter row
        "onebit_mask": ({"mode": "onebit", "mask_zero_updates": True},
                        4 * (P - 1) * a + (1 + (P - 1) / P) * n * b
                        + 2 * (P - 1) / P * variants.num_rows(model) * 32 * b),
    }
    for name, (c, want) in cases.items():
        got = variants.predict_step_comm_s({"model": model, "comm": {**c, "momentum_sync": ms_off}}, P, a, b)
        assert got == pytest.approx(want, rel=1e-12), name
    sync = {"mode": "pbit", "bits": 4, "momentum_sync": {"every": 10, "layers": ["head"], "start": 0, "stop": 0}}
    cfg = {"model": model, "comm": sync}
    extra = variants.predict_step_comm_s(cfg, P, a, b, sync_step=True) - variants.predict_step_comm_s(cfg, P, a, b)
    assert extra == pytest.approx(2 * (P - 1) * a + 2 * (P - 1) / P * roles["head"] * 32 * b)
    row = sb.add_prediction({"coll_ms": 30.0, "comm_ms": 45.0}, 0.020, a, b)
    assert row["pred_comm_ms"] == pytest.approx(20.0) and row["coll_over_pred"] == pytest.approx(1.5)
    assert row["comm_over_pred"] == pytest.approx(2.25)


def test_variant_configs_and_levels():
    from optim.sync import effective_levels
    from trainer.config import load_config

    four = load_config(variants.config_files("lioncub_4bit")).comm
    assert (four.bits, four.quantizer, four.levels) == (4, "sign", 0)  # the paper's +-1 votes
    eight = load_config(variants.config_files("lioncub_8bit_l1")).comm
    assert effective_levels(eight.bits, 4, eight.levels) == 31 and effective_levels(eight.bits, 8, eight.levels) == 15
    for v in variants.DEFAULT_VARIANTS + quality.DEFAULT_VARIANTS:
        paths, extra = variants.variant_args(v)
        assert all(p.is_file() for p in paths) and load_config(paths, extra)
    assert variants.variant_args("lion_fp32+overlap@train.seed=3")[1] == ["comm.bucket_mb=25", "comm.overlap=true",
                                                                          "train.seed=3"]
    with pytest.raises(ValueError, match="lioncub_4bit"):
        variants.config_files("lioncub_3bit")


def test_quality_summary_on_synthetic_records():
    def diag(step, match, flip, tie, emb, head, attn, mlp):
        return {"step": step, "diag/sign_match": match, "diag/sign_match/attn": match / 2, "diag/sign_flip": flip, "diag/tie_rate": tie,
                "diag/momentum_spread/embedding": emb, "diag/momentum_spread/head": head,
                "diag/momentum_spread/attn": attn, "diag/momentum_spread/mlp": mlp,
                "diag/momentum_spread/norm": 1e-9}
    recs = [_rec(10, 1, 0, 1, 0, 0, 0, train_time_s=3.0), diag(10, 0.9, 0.02, 0.1, 1e-2, 3e-2, 1e-4, 2e-4),
            {"step": 10, "val_loss": 6.0}, _rec(20, 1, 0, 1, 0, 0, 0, train_time_s=6.5),
            diag(20, 0.7, 0.04, 0.3, 3e-2, 1e-2, 4e-4, 2e-4), {"step": 20, "val_loss": 5.5}]
    s = quality.summarize_quality(recs)
    assert s["final_val_loss"] == 5.5 and s["train_time_s"] == 6.5 and s["n_diag"] == 2
    assert s["sign_match"] == pytest.approx(0.8) and s["sign_flip"] == pytest.approx(0.03)
    assert s["tie_rate"] == pytest.approx(0.2)
    assert s["sign_match_attn"] == pytest.approx(0.4) and s["sign_match_mlp"] is None
    assert s["spread_embedding"] == pytest.approx(2e-2) and s["spread_head"] == pytest.approx(2e-2)
    assert s["spread_other"] == pytest.approx(3e-4)                 # mean of per-step max(attn, mlp, norm)
    assert s["spread_ratio"] == pytest.approx(2e-2 / 3e-4)
    gradient_sync = quality.summarize_quality([r for r in recs if not any(k.startswith("diag/") for k in r)])
    assert gradient_sync["sign_match"] is None and gradient_sync["spread_ratio"] is None
    assert "| x | 5.5000 | - | - / - / - |" in quality.quality_markdown([{"variant": "x", "status": "ok", **gradient_sync}])


def test_quality_command_line_and_what_it_refuses_before_launching(tmp_path, monkeypatch, capsys):
    """bench.quality: variants space- or comma-separated, section.key=value words anywhere (after --overrides'),
    a variant's own name@key=value kept; --out relative to where it runs. An earlier run's directory is not
    replaced without --overwrite, a config the trainer would refuse is refused in one line, and --report-only
    without runs says so: nothing is launched for any of them."""
    monkeypatch.chdir(tmp_path)
    a = quality.parse_args(["--variants", "lion_fp32,lioncub_1bit", "onebit_adam@optim.freeze_step=24",
                            "data.batch_size=2", "--out", "q", "train.eval_steps=3"])
    assert a.variants == ["lion_fp32", "lioncub_1bit", "onebit_adam@optim.freeze_step=24"]
    assert a.overrides[-2:] == ["data.batch_size=2", "train.eval_steps=3"] and a.out == str(tmp_path / "q")
    with pytest.raises(SystemExit):
        quality.parse_args(["--steps", "3", "nonsense"])   # neither a flag nor a key=value word

    def launched(*_):
        raise AssertionError("launched")
    monkeypatch.setattr(quality, "run_variant", launched)
    earlier = tmp_path / "q" / "runs" / "lion_fp32"
    earlier.mkdir(parents=True)
    (earlier / "metrics.jsonl").write_text('{"step": 1, "val_loss": 5.0}\n')
    assert quality.main(["--variants", "lion_fp32", "--out", "q", "--report-only"]) == 0   # the earlier run, read
    table = (tmp_path / "q" / "quality.md").read_text()
    # refused: the earlier run, and the table it gave, kept; the variant before it not trained either
    assert quality.main(["--variants", "lioncub_4bit", "lion_fp32", "--out", "q", "--steps", "40"]) == 2
    assert "pass --overwrite to train it again" in capsys.readouterr().err
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 1, "val_loss": 5.0}\n'
    assert (tmp_path / "q" / "quality.md").read_text() == table
    assert quality.main(["--variants", "lioncub_1bit", "--out", "q", "--steps", "4"]) == 2   # warmup_steps=10
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "optim.warmup_steps" in err and "config error" in err
    assert quality.main(["--variants", "lioncub_4bit", "--out", "q", "--report-only"]) == 1
    assert "no run:" in (tmp_path / "q" / "quality.md").read_text()


@pytest.mark.skipif(NETSIM_SKIP is not None, reason=NETSIM_SKIP or "")
def test_smoke_two_ranks_through_netsim(tmp_path: Path):
    out = tmp_path / "sb"
    rc = sb.main(["--variants", "lioncub_1bit", "--rates", "unlimited", "--nproc", "2", "--steps", "2",
                  "--warmup", "1", "--no-calibrate", "--out", str(out), "--timeout", "240",
                  "--overrides", "model.preset=debug data.batch_size=1 data.seq_len=32"])
    assert rc == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 1 and rows[0]["status"] == "ok" and rows[0]["steps"] == "2"
    r = rows[0]
    assert float(r["step_ms"]) > 0 and float(r["comm_ms"]) > 0
    n = variants.num_params(variants.load_run_config(out / "runs" / "unlimited" / "lioncub_1bit")["model"])
    assert n == int(r["n_params"])
    # 1-bit vote: each rank hands its packed signs (n/8 bytes, padded to 8*P) to the collectives,
    # once for the all-to-all and once for the all-gather of its chunk: about n/8 .. 2n/8 bytes
    assert n / 8 * 0.9 <= float(r["comm_bytes"]) <= 2 * n / 8 * 1.1
    assert r["speedup"] == ""             # no lion_fp32 row at this rate: no speedup invented
    rss = [json.loads(p.read_text()) for p in (out / "rss" / "unlimited" / "lioncub_1bit").glob("rank*.json")
           if ".self" not in p.name]
    assert sorted(x["rank"] for x in rss) == [0, 1] and all(100 < x["max_rss_mib"] < 8000 for x in rss)
    # the rank process's own peak (written by step_breakdown's train_here) is at most its tree's largest process
    assert all(x["max_rss_mib"] <= x["tree_max_rss_mib"] + 1 for x in rss)
    assert float(r["peak_rss_mib"]) == max(x["max_rss_mib"] for x in rss)
    assert float(r["peak_tree_rss_mib"]) == max(x["tree_max_rss_mib"] for x in rss)
    assert (out / "breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| lioncub_1bit |" in (out / "results.md").read_text()
    # no lion_fp32 measured: the targets against it are said not evaluated, not printed empty
    assert "Not evaluated: the slow-link and fast-path targets" in (out / "results.md").read_text()
    assert "## Slow-link targets" not in (out / "results.md").read_text()
    assert not math.isnan(float(r["comm_share"]))
    # what a measurement is read from stays; the trainer's final checkpoint does not
    run = out / "runs" / "unlimited" / "lioncub_1bit"
    assert (run / "metrics.jsonl").is_file() and (run / "config.yaml").is_file() and not (run / "ckpt").exists()
    # what a measurement leaves behind is the tool's own: measuring again into the same --out replaces it
    assert sb.not_replaceable(out, "unlimited", "lioncub_1bit") is None, sorted(p.name for p in (out / "rss").rglob("*"))


def test_targets_are_checked_at_the_comm_bound_rate():
    def row(rate, v, step, comm, coll, pred):
        return {"rate": rate, "variant": v, "status": "ok", "step_ms": step, "comm_ms": comm, "coll_ms": coll,
                "comm_share": comm / step, "pred_comm_ms": pred, "coll_over_pred": coll / pred,
                "comm_over_pred": comm / pred}
    rows = [row("1gbit", "lion_fp32", 1000.0, 600.0, 590.0, 500.0),          # 60 %: not the target regime
            row("1gbit", "lioncub_4bit", 400.0, 50.0, 40.0, 30.0),
            row("100mbit", "lion_fp32", 6000.0, 5500.0, 5400.0, 5000.0),     # 92 %
            row("100mbit", "lioncub_1bit", 1900.0, 600.0, 300.0, 150.0),     # coll 2x the model: outside 1.5x
            row("100mbit", "lioncub_4bit", 2100.0, 500.0, 450.0, 400.0)]
    lines = sb.check_targets(sb.add_relative(rows))
    assert not any(ln.startswith("1gbit") for ln in lines)
    best = next(ln for ln in lines if "best Lion Cub" in ln)
    assert "lioncub_1bit" in best and "3.16x (MET" in best and "9.2x smaller (NOT met" in best
    assert any("lioncub_1bit: collectives 300 ms vs model 150 ms = 2.00x (NOT within" in ln for ln in lines)
    assert any("lioncub_4bit: collectives 450 ms vs model 400 ms = 1.12x (within" in ln for ln in lines)
    only_slow = sb.check_targets(sb.add_relative(rows[:2]))
    assert len(only_slow) == 1 and "no rate" in only_slow[0] and "60.0" in only_slow[0]
    # a Lion Cub whose exchange hides whole (comm under the tables' resolution: no ratio) is still a
    # candidate, judged on the least its reduction can be
    hidden = {**row("100mbit", "lioncub_1bit_overlap", 1500.0, 0.0004, 0.0004, 150.0), "comm_bytes": 2e6}
    best = next(ln for ln in sb.check_targets(sb.add_relative([*rows, hidden])) if "best Lion Cub" in ln)
    assert "lioncub_1bit_overlap" in best and "under 0.5 ms: at least 11000x smaller (MET" in best


def test_runs_without_fine_timing_are_not_judged_on_their_comm_split():
    """comm.fine_timing=false books no collective time: its step counts, its comm / other columns do
    not (they would read 0 ms of comm and an "other" that includes the communication)."""
    def row(v, step, comm, other, nbytes=2e6):
        return {"rate": "100mbit", "variant": v, "status": "ok", "step_ms": step, "comm_ms": comm, "coll_ms": comm,
                "other_ms": other, "comm_share": comm / step, "comm_bytes": nbytes, "pred_comm_ms": 100.0,
                "coll_over_pred": comm / 100.0, "comm_over_pred": comm / 100.0, "compute_ms": 100.0}
    rows = sb.add_relative([row("lion_fp32", 7000.0, 6800.0, 80.0, 5e7), row("lioncub_1bit", 500.0, 260.0, 100.0),
                            row("lioncub_1bit@comm.fine_timing=false", 480.0, 0.0, 370.0)])
    assert sb.untimed(rows[2]) and not sb.untimed(rows[1])
    lines = sb.check_targets(rows)
    assert "best Lion Cub lioncub_1bit:" in next(ln for ln in lines if "best Lion Cub" in ln)
    assert not any("fine_timing=false: collectives" in ln for ln in lines)
    fast = sb.check_fast_path_targets(rows)
    assert any("lioncub_1bit optimizer time 100 ms vs 80 ms" in ln for ln in fast)
    assert not any("fine_timing=false optimizer time" in ln for ln in fast)


def test_a_failed_run_says_the_trainers_error(tmp_path: Path, capsys, monkeypatch):
    """A measured run the trainer refuses prints the reason, not only its exit codes: the first rank log's
    error line and the problems listed under it, as the trainer prints them (and nothing when no log has
    one)."""
    import train

    monkeypatch.delenv("RANK", raising=False)
    assert train.main(["configs/variants/adamw_fp32.yaml", "model.preset=debug", "optim.warmup_steps=20",
                       "train.max_steps=13", "data.seq_len=100000"]) == 2
    said = capsys.readouterr().err
    (tmp_path / "rank0.log").write_text("starting\n")
    (tmp_path / "rank1.log").write_text("x\n" + said + "Traceback (most recent call last):\n  - not this one\n")
    got = sb.first_error(tmp_path)
    assert got.startswith("error: 2 config problem(s): - ") and "optim.warmup_steps: 20 >= train.max_steps=13" in got
    assert "data.seq_len: 100000" in got and "not this one" not in got
    (tmp_path / "rank1.log").write_text("Error (rank 3): data/prose/train_000001.bin: truncated\n")
    assert sb.first_error(tmp_path) == "Error (rank 3): data/prose/train_000001.bin: truncated"
    (tmp_path / "rank1.log").write_text("killed\n")
    assert sb.first_error(tmp_path) == ""


def test_override_words_are_read_among_the_flags_and_other_words_refused(capsys):
    """`section.key=value` words anywhere among the flags are overrides after --overrides' (they were swallowed
    silently: the runs trained on the default data); any other word is one line and exit 2; the module's
    own rank processes still take the command that follows their flag."""
    import pytest

    from bench.step_breakdown import parse_args

    a = parse_args(["--nproc", "2", "data.dataset=/data/mine", "--steps", "3", "--overrides", "model.preset=debug",
                    "train.seed=5"])
    assert a.overrides == ["model.preset=debug", "data.dataset=/data/mine", "train.seed=5"] and a.steps == 3
    with pytest.raises(SystemExit) as e:
        parse_args(["--nproc", "2", "configs/mine.yaml"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "'configs/mine.yaml': not a flag or a section.key=value override" in err
    assert parse_args(["--train-here", "--", "train.py", "cfg.yaml", "x.y=1"]).cmd == ["--", "train.py", "cfg.yaml", "x.y=1"]


def test_step_breakdown_replaces_only_its_own_earlier_measurements(tmp_path, capsys):
    """A rerun replaces a variant's earlier measurement (its run directory, which the trainer marked, and its
    rank<R>.json rss files), never a directory or file the tool did not make: refused before any run, nothing
    touched."""
    from trainer import rundir

    out = tmp_path / "bd"
    run_dir, rss = out / "runs" / "unlimited" / "lion_fp32", out / "rss" / "unlimited" / "lion_fp32"
    assert sb.not_replaceable(out, "unlimited", "lion_fp32") is None          # nothing there yet
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine")
    assert "not a run directory the trainer made" in sb.not_replaceable(out, "unlimited", "lion_fp32")
    assert sb.main(["--variants", "lion_fp32", "--rates", "unlimited", "--launcher", "torchrun", "--out", str(out),
                    "--no-calibrate"]) == 2
    assert "move it away or choose another --out" in capsys.readouterr().err
    assert (run_dir / "notes.txt").read_text() == "mine"
    (run_dir / "notes.txt").unlink()
    (run_dir / rundir.MARKER).write_text("{}")
    (run_dir / "metrics.jsonl").write_text("")
    rss.mkdir(parents=True)
    (rss / "rank0.json").write_text("{}")
    (rss / "rank0.self.json").write_text("{}")
    assert sb.not_replaceable(out, "unlimited", "lion_fp32") is None          # an earlier measurement: replaced
    (run_dir / "mine.txt").write_text("x")
    assert "mine.txt" in sb.not_replaceable(out, "unlimited", "lion_fp32")
    (run_dir / "mine.txt").unlink()
    (rss / "keep.txt").write_text("x")
    assert "keep.txt" in sb.not_replaceable(out, "unlimited", "lion_fp32")
