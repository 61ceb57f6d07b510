"""The quick training studies fig5, fig6_17, compressors and lr_sweep end to end (the others:
test_reproduce.py::test_quick_training_studies_end_to_end). A file of its own so the suite's two workers
run the two halves side by side (pytest-xdist --dist loadfile keeps a file on one worker)."""
from __future__ import annotations

import csv
import json

import pytest

from bench.reproduce import framework
from bench.reproduce.__main__ import main

from .quick_launch import direct_launches
from .test_reproduce import check_quick_study


@pytest.mark.slow
def test_quick_training_studies_end_to_end_second_half(tmp_path, monkeypatch):
    out, work = tmp_path / "results", tmp_path / "work"
    launches = direct_launches(monkeypatch)  # the first run by torchrun, the others forked (quick_launch.py)
    for name in ["fig5", "fig6_17", "compressors", "lr_sweep"]:
        assert main([name, "--quick", "--out", str(out), "--work", str(work)]) == 0, name
        runs = check_quick_study(out, name)
        if name == "fig6_17":  # reused from fig5 through the shared --work
            assert {r["how"] for r in runs} == {"reused"}
    assert launches.real == 1 and launches.direct > 0, vars(launches)

    # fig5: the head-sync arm really syncs (more bytes per logged window than the no-sync arm)
    def bytes_of(run):
        recs = map(json.loads, open(work / "runs" / run / "metrics.jsonl"))
        return [r["comm_bytes"] for r in recs if "comm_bytes" in r]
    assert min(bytes_of("b0.95_sync_head_every_2_p2_s1337")) > max(bytes_of("b0.95_none_p2_s1337"))
    # and the paper's arm, embedding + head, more than the head alone (untied: two matrices of the same size)
    assert max(bytes_of("b0.95_sync_emb_head_every_2_p2_s1337")) > max(bytes_of("b0.95_sync_head_every_2_p2_s1337"))
    # lr_sweep: three values of one arm, the best written for --lr from-sweep
    assert len(list(csv.DictReader(open(out / "lr_sweep.csv")))) == 3
    assert set(json.loads((out / framework.BEST_LR_FILE).read_text())["best"]) == {"lion_fp32"}
    # compressors: every optimizer ran, and 1-bit Adam's exchanges (after its one fp32 warm-up step) send far
    # fewer bytes than AdamW's fp32 mean
    comp = {r["optimizer"]: r for r in csv.DictReader(open(out / "compressors.csv"))}
    assert set(comp) == {"adamw_fp32", "onebit_adam"} and all(r["status"] == "ok" for r in comp.values()), comp
    assert float(comp["onebit_adam"]["bytes_per_step"]) < 0.1 * float(comp["adamw_fp32"]["bytes_per_step"])
    # wire bytes at P = 2: a ring allreduce sends its buffer once (2(P-1)/P = 1); the all-to-all keeps half at home
    assert float(comp["adamw_fp32"]["wire_factor"]) == 1.0 and float(comp["onebit_adam"]["wire_factor"]) < 1
    assert float(comp["adamw_fp32"]["wire_bytes_per_step"]) == float(comp["adamw_fp32"]["bytes_per_step"])
