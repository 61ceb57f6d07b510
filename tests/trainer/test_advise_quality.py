"""comm.mode=auto trusts quality evidence, not modes (trainer.advise.quality_verdicts over the
study-prose tables that trainer/auto_quality.yaml points at) and leaves fp32 only for a predicted
gain above comm.auto_min_gain (trainer.advise.pick). The measurements are faked: offline, CPU, fast."""
from __future__ import annotations

import pytest

from tests.dist import ROOT
from trainer import advise, comm_prediction
from trainer.config import ConfigError, load_config

COMM_S = {"lion_fp32": 0.200, "lioncub_8bit_l1": 0.050, "lioncub_1bit": 0.030, "lioncub_1bit_plus": 0.010}


def _table2(arm: str) -> tuple[float, float, int]:
    """(paired delta mean, its std, seeds) of `arm` vs 32-bit Lion in the committed study-prose Table 2."""
    import csv

    path = ROOT / "docs/results/reproduction/study-prose/table2.csv"
    r = next(r for r in csv.DictReader(path.open()) if r["arm"] == arm)
    return float(r["delta_vs_fp32_mean"]), float(r["delta_vs_fp32_std"]), int(r["delta_vs_fp32_n"])


class _FakeOpt:
    def __init__(self, comm_s: float) -> None:
        self.comm_s = comm_s

    def wire_bytes_per_step(self, P, rank):
        return {"flat": (1e6, 0)}


@pytest.fixture
def fake_measurements(monkeypatch):
    """advise() with links, compute and local work faked: each variant's comm time is COMM_S's."""
    links = {"world": {"P": 4, "alpha_s": 1e-4, "beta_s_per_bit": 1e-9, "gbit_s": 1.0, "node_size": 1}}
    monkeypatch.setattr(advise.dist, "get_world_size", lambda *a, **k: 4)
    monkeypatch.setattr(advise.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(advise, "measure_links", lambda *a, **k: links)
    monkeypatch.setattr(advise, "build_model", lambda *a, **k: None)
    monkeypatch.setattr(advise, "measure_compute", lambda *a, **k: {"fwdbwd_s": 0.1, "compile_s": 0.0})
    current = {}

    def local(cfg, model, device, steps=3):
        return {"local_s": 0.0, "predictor": _FakeOpt(COMM_S[current["name"]])}

    real_config = advise.config_from_dict

    def config_from_dict(d):
        cfg = real_config(d)
        current["name"] = next(n for n in COMM_S if advise.load_variant(n).sections["comm"] == {
            k: v for k, v in d["comm"].items() if k in advise.load_variant(n).sections["comm"]})
        return cfg
    monkeypatch.setattr(advise, "measure_local", local)
    monkeypatch.setattr(advise, "config_from_dict", config_from_dict)
    # predict_candidate_comm (trainer/comm_prediction.py) calls predict_comm from its own module
    monkeypatch.setattr(comm_prediction, "predict_comm", lambda opt, links, P: opt.comm_s)

    def run(names=tuple(COMM_S), **kw):
        cfg = load_config(ROOT / "configs/default.yaml", [])
        return advise.advise(cfg, [advise.load_variant(n) for n in names], advise.torch.device("cpu"), None,
                             log=lambda *a: None, **kw)
    return run


def test_the_ablation_is_excluded_with_its_reason_even_when_fastest(fake_measurements):
    result = fake_measurements(exclude=True)
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["lioncub_1bit_plus"]["status"] == "excluded"
    assert "ablation" in rows["lioncub_1bit_plus"]["reason"] and "Fig. 10" in rows["lioncub_1bit_plus"]["reason"]
    row, _ = advise.pick(result, 0.10)
    assert row["variant"] == "lioncub_8bit_l1"
    md = advise.table_markdown(result)
    assert "| lioncub_1bit_plus | | | excluded from auto: " in md and "study-prose" in md


def test_a_variant_measured_worse_beyond_noise_is_excluded_and_naming_it_allows_it(fake_measurements):
    result = fake_measurements(exclude=True)
    one = next(r for r in result["rows"] if r["variant"] == "lioncub_1bit")
    # the committed study-prose Table 2 (five seeds: +0.017 ± 0.007, mean - 2 s.e. = +0.011 > 0)
    mean, std, n = _table2("1bit")
    assert mean - 2 * std / n ** 0.5 > 0  # the premise: worse beyond noise in the committed table
    assert one["status"] == "excluded" and "worse beyond noise" in one["reason"] and f"{mean:+.3f}" in one["reason"]
    named = fake_measurements(exclude=True, named=["lioncub_1bit"])
    one = next(r for r in named["rows"] if r["variant"] == "lioncub_1bit")
    assert one["status"] == "ok" and "allowed by you" in one["evidence"]
    assert advise.pick(named, 0.10)[0]["variant"] == "lioncub_1bit"  # the fastest allowed now


def test_the_noise_rule_on_a_study_table(tmp_path):
    (tmp_path / "t.csv").write_text("arm,val_loss_mean,val_loss_n,d_mean,d_std,status\n"
                                    "ref,5.0,3,0,0,ok\nworse,5.1,3,0.05,0.01,ok\nnoisy,5.0,3,0.01,0.03,ok\n"
                                    "single,5.0,1,0.0,,ok\n")
    ev = tmp_path / "q.yaml"
    ev.write_text(f"setting: my-setting\nresults: {tmp_path}\nk_se: 2\nvariants:\n"
                  + "".join(f"  {a}: {{study: t, key: arm, arm: {a}, delta: d, against: ref}}\n"
                            for a in ("worse", "noisy", "single")))
    v = advise.quality_verdicts(["worse", "noisy", "single", "unknown"], path=ev)
    assert not v["worse"].allowed and "mean - 2 s.e. = +0.038 > 0" in v["worse"].evidence
    assert v["noisy"].allowed and "my-setting t" in v["noisy"].evidence
    assert not v["single"].allowed and "no noise estimate" in v["single"].evidence
    assert not v["unknown"].allowed and "no quality evidence" in v["unknown"].evidence
    assert advise.quality_verdicts(["unknown"], named=["unknown"], path=ev)["unknown"].allowed


def test_auto_stays_on_fp32_below_auto_min_gain_and_leaves_it_above(fake_measurements):
    result = fake_measurements(names=("lion_fp32", "lioncub_8bit_l1"), exclude=True)
    # predicted steps: fp32 0.1 + 0.2 = 0.3 s, 8-bit L1 0.1 + 0.05 = 0.15 s: a 100 % gain
    row, why = advise.pick(result, 1.5)
    assert row["variant"] == "lion_fp32" and why.startswith("stays on fp32") and "comm.auto_min_gain=1.5" in why
    row, why = advise.pick(result, 0.10)
    assert row["variant"] == "lioncub_8bit_l1" and "100% faster" in why


def test_the_evidence_column_names_the_study_prose_setting():
    v = advise.quality_verdicts(["lion_fp32", "lioncub_8bit_l1"])
    assert v["lion_fp32"].reference and "study-prose table2" in v["lion_fp32"].evidence
    assert v["lioncub_8bit_l1"].allowed and "study-prose" in v["lioncub_8bit_l1"].evidence
    assert f"{_table2('8bit_l1')[0]:+.3f}" in v["lioncub_8bit_l1"].evidence


def test_auto_min_gain_and_variant_names_in_auto_allow_are_checked():
    with pytest.raises(ConfigError, match=r"comm.auto_min_gain: -0.1 must be a finite fraction >= 0"):
        load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", "comm.auto_min_gain=-0.1"])
    cfg = load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", "comm.auto_allow=[fp32, lioncub_1bit]"])
    from trainer import automode
    assert [c.name for c in automode.candidates(cfg)] == ["lion_fp32", "lioncub_1bit"]


def test_advise_check_judges_the_pick_among_the_variants_auto_may_choose():
    from bench import advise_check

    def row(name, mode, step_s, evidence):
        return {"variant": name, "status": "ok", "mode": mode, "step_s": step_s, "compute_s": 0.1, "local_s": 0.0,
                "comm_s": step_s - 0.1, "evidence": evidence}
    advice = {"rows": [row("lioncub_1bit_plus", "onebit", 0.11, "not for auto: ...; out: ablation, ..."),
                       row("lioncub_8bit_l1", "pbit", 0.15, "val -0.025 ± 0.022 std vs 32-bit Lion"),
                       row("lion_fp32", "fp32", 0.30, "reference (study-prose table2)")]}
    measured = [{"rate": "1gbit", "variant": v, "status": "ok", "step_ms": ms}
                for v, ms in (("lioncub_1bit_plus", 100), ("lioncub_8bit_l1", 140), ("lion_fp32", 290))]
    _, summary = advise_check.join(advice, measured, "1gbit", ["fp32", "onebit", "pbit"])
    assert summary["pick"] == "lioncub_8bit_l1" and summary["measured_fastest"] == "lioncub_8bit_l1"
