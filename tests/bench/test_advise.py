"""comm.mode=auto's measure-and-predict core (trainer/advise.py), its thin command bench.advise and
trainer/automode.py: candidates merged over the user's config, the quality evidence,
config errors, the pick and its survival across a resume, and (under bench.netsim, root and
iproute2 only) the link measurement against a known rate and the pick at a slow link."""
from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import advise as advise_command
from bench import netsim
from optim import sync
from tests.dist import ROOT, torchrun
from model import resolve_config
from trainer import advise
from trainer.config import ConfigError, load_config

NETSIM_SKIP = netsim.unavailable_reason(need_tc=True)
needs_netsim = pytest.mark.skipif(NETSIM_SKIP is not None, reason=NETSIM_SKIP or "")

SMALL = ["model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.eval_every=0", "train.log_every=1",
         "optim.warmup_steps=1", "train.ckpt_every=2"]


def test_candidate_config_keeps_the_users_common_keys_and_drops_the_old_modes_options():
    user = load_config(ROOT / "configs/default.yaml", ["comm.mode=pbit", "comm.bits=4", "optim.lr=3e-4",
                                                       "comm.kernels=eager"]).to_dict()
    cfg = advise.config_from_dict(advise.candidate_config(user, advise.load_variant("lioncub_1bit")))
    assert cfg.comm.mode == "onebit" and cfg.optim.name == "lion"
    assert cfg.optim.lr == 3e-4 and cfg.comm.kernels == "eager"       # the user's common keys stay
    assert "bits" not in cfg.comm.options.field_names()               # pbit's option did not follow
    dion = advise.config_from_dict(advise.candidate_config(user, advise.load_variant("dion_r16")))
    assert dion.optim.name == "dion" and dion.optim.rank_fraction == 0.0625  # `extends:` resolved


def test_an_auto_candidate_of_the_users_optimizer_keeps_the_users_recipe():
    """adamw_fp32.yaml is a benchmark recipe (lr 6e-4, betas 0.9/0.95, lr multipliers 1): as comm.mode=auto's
    candidate for a user running AdamW it changes the mode only, never the user's lr, betas or multipliers
    (it replaced them, silently); a variant's own options of the optimizer (dion_r16's rank) do apply, and
    replaced_keys names them. Across optimizers (bench.advise) the candidate's section is its own."""
    user = load_config(ROOT / "configs/default.yaml", ["optim.name=adamw", "optim.lr=1e-3", "optim.betas=[0.9,0.99]",
                                                       "optim.head_lr_mult=3"]).to_dict()
    cfg = advise.config_from_dict(advise.candidate_config(user, advise.load_variant("adamw_fp32")))
    assert (cfg.optim.lr, list(cfg.optim.betas), cfg.optim.head_lr_mult) == (1e-3, [0.9, 0.99], 3.0)
    assert advise.replaced_keys(user, cfg.to_dict()) == []
    d = load_config(ROOT / "configs/default.yaml", ["optim.name=dion", "optim.matrix_lr=0.05", "optim.lr=3e-3"]).to_dict()
    r16 = advise.config_from_dict(advise.candidate_config(d, advise.load_variant("dion_r16"))).to_dict()
    assert r16["optim"]["rank_fraction"] == 0.0625 and r16["optim"]["lr"] == 3e-3
    assert "optim.rank_fraction: 0.25 -> 0.0625" in advise.replaced_keys(d, r16)
    lion = load_config(ROOT / "configs/default.yaml", ["optim.lr=1e-4"]).to_dict()
    other = advise.config_from_dict(advise.candidate_config(lion, advise.load_variant("adamw_fp32")))
    assert other.optim.name == "adamw" and other.optim.lr == 6e-4   # another optimizer: its own recipe


def test_quality_evidence_comes_from_the_committed_study():
    import csv

    ev = advise.quality_verdicts(["lion_fp32", "lioncub_8bit_l1", "loco_adamw"])
    assert ev["lion_fp32"].evidence.startswith("reference (study-prose table2")
    path = ROOT / "docs/results/reproduction/study-prose/table2.csv"
    l1 = next(r for r in csv.DictReader(path.open()) if r["arm"] == "8bit_l1")
    d, n = float(l1["delta_vs_fp32_mean"]), int(l1["delta_vs_fp32_n"])
    assert f"{d:+.3f}" in ev["lioncub_8bit_l1"].evidence and f"{n} seeds" in ev["lioncub_8bit_l1"].evidence
    assert "vs AdamW fp32" in ev["loco_adamw"].evidence


def test_table_ranks_by_predicted_step_and_lists_inadmissible_last():
    rows = [{"variant": "b", "status": "ok", "optimizer": "lion", "mode": "onebit", "step_s": 0.2, "compute_s": 0.1,
             "local_s": 0.05, "comm_s": 0.05, "bytes_per_step": 1e6, "speedup_vs_fp32": 2.0, "evidence": "x"},
            {"variant": "c", "status": "not admissible", "reason": "comm.bits: why"}]
    md = advise.table_markdown({"rows": rows})
    lines = md.splitlines()
    assert lines[2].startswith("| 1 | b |") and "200.0" in lines[2] and "2.00x" in lines[2]
    assert "not admissible: comm.bits: why" in lines[3]


@pytest.mark.parametrize("override,match", [
    ("comm.auto_allow=[fp32, nope]", r"comm.auto_allow: \['nope'\] not among the modes fp32, bf16, onebit"),
    ("comm.auto_allow=[]", r"comm.auto_allow: \[\] not among the modes"),
])
def test_bad_auto_allow_entries_are_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", override])


def test_auto_with_sharding_is_a_config_error_not_a_wrong_prediction():
    with pytest.raises(ConfigError, match=r"comm.mode=auto with parallel.shard_size=2: the advisor .* replicated"):
        load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", "parallel.shard_size=2"])
    assert advise_command.main([str(ROOT / "configs/default.yaml"), "parallel.shard_size=2"]) == 2


def test_auto_allow_that_the_optimizer_cannot_run_is_a_config_error():
    """The advice names the modes of the optimizer's variant files, which auto chooses among (it listed
    every mode AdamW can run, bf16 included, and auto then found no bf16 variant of AdamW)."""
    from trainer.config_validate import auto_variants

    mine = auto_variants("adamw")
    assert mine == {"adamw_fp32": "fp32", "diloco_h10": "diloco", "diloco_h50": "diloco", "loco_adamw": "loco",
                    "streaming_diloco": "diloco"}
    for allow in ("[onebit]", "[bf16]"):
        with pytest.raises(ConfigError, match=r"comm.auto_allow: no variant of optim.name=adamw runs on \['(onebit|bf16)'\]; "
                                              r"allow one of diloco, fp32, loco \(its variants: adamw_fp32, diloco_h10"):
            load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", "optim.name=adamw", f"comm.auto_allow={allow}"])
    load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", "optim.name=adamw", "comm.auto_allow=[loco_adamw]"])
    # a variant that extends another is read as auto reads it (dion_r16 extends dion: a Dion variant)
    assert auto_variants("dion") == {"dion": "fp32", "dion_r16": "fp32"} and "dion_r16" not in auto_variants("lion")
    load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", "optim.name=dion", "comm.auto_allow=[dion_r16]"])


def test_auto_candidates_follow_the_optimizer_and_the_allow_list():
    cfg = load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", "comm.auto_allow=[onebit, pbit]"])
    from trainer import automode

    names = [c.name for c in automode.candidates(cfg)]
    assert names and all(advise.load_variant(n).sections["comm"]["mode"] in ("onebit", "pbit") for n in names)
    assert "lioncub_4bit_synchead" not in names  # momentum sync is a quality choice, not auto's


@pytest.mark.slow
def test_auto_picks_the_only_allowed_mode_logs_it_and_keeps_it_on_resume(tmp_path):
    out = tmp_path / "run"
    args = [str(ROOT / "configs/default.yaml"), *SMALL, "comm.mode=auto", "comm.auto_allow=[fp32]",
            "train.max_steps=2", f"train.out_dir={out}"]
    p = torchrun(2, ROOT / "train.py", *args, timeout=240)
    assert "comm.mode=auto -> lion_fp32 (comm.mode=fp32; measured now" in p.stdout
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in recs if r.get("event") == "auto_mode"]
    assert len(ev) == 1 and ev[0]["mode"] == "fp32" and ev[0]["table"][0]["variant"] == "lion_fp32"
    assert json.loads((out / "auto_mode.json").read_text())["variant"] == "lion_fp32"
    assert "mode: fp32" in (out / "config.yaml").read_text()
    # resume: the stored decision is used, nothing is measured again
    p = torchrun(2, ROOT / "train.py", *args[:-2], "train.max_steps=4", f"train.out_dir={out}",
                 "train.resume=auto", timeout=240)
    assert "kept from auto_mode.json" in p.stdout and "measuring links" not in p.stdout
    assert "resumed from" in p.stdout
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["source"] for r in recs if r.get("event") == "auto_mode"] == ["measured", "stored"]


def test_auto_at_one_rank_says_the_ranking_has_no_network_in_it(tmp_path):
    """At one rank nothing crosses a network: auto (and bench.advise) say the ranking is compute and local
    work only and how to measure the run's links, instead of printing an "inf Gbit/s" link."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "train.py", str(ROOT / "configs/default.yaml"), *SMALL, "comm.mode=auto",
                        "comm.auto_allow=[fp32]", "train.max_steps=2", f"train.out_dir={out}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "advise: one rank: no link to measure" in p.stdout and "torchrun --nproc_per_node=N" in p.stdout
    assert "inf Gbit/s" not in p.stdout and "links measured" not in p.stdout


@needs_netsim
@pytest.mark.slow
def test_link_measurement_recovers_the_simulated_rate(tmp_path):
    """100 Mbit/s per link (tbf on both ends of every veth): the fitted bandwidth within 25 %."""
    out = tmp_path / "links.json"
    codes = netsim.run(2, [sys.executable, "-m", "bench.advise", str(ROOT / "configs/default.yaml"),
                           "--links-only", "--json", str(out)], rate="100mbit", timeout=180, cwd=str(ROOT),
                       env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR"},
                       tag="tadvl", stream=io.StringIO())
    assert codes == [0, 0]
    gbit = json.loads(out.read_text())["links"]["world"]["gbit_s"]
    assert 0.075 <= gbit <= 0.125, gbit


@needs_netsim
@pytest.mark.slow
def test_auto_at_100mbit_picks_a_quantized_update_sync_mode(tmp_path):
    out = tmp_path / "run"
    allow = "[" + ", ".join(s.name for s in sync.schemes() if s.name != "hierarchical") + "]"
    log = io.StringIO()
    codes = netsim.run(2, [sys.executable, str(ROOT / "train.py"), str(ROOT / "configs/default.yaml"), *SMALL,
                           "comm.mode=auto", f"comm.auto_allow={allow}", "train.max_steps=1", "optim.warmup_steps=0",
                           f"train.out_dir={out}"],
                       rate="100mbit", timeout=300, cwd=str(ROOT),
                       env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR",
                            "WANDB_MODE": "disabled", "LIONCUB_KERNELS": "eager"}, tag="tadva", stream=log)
    assert codes == [0, 0], log.getvalue()[-3000:]
    mode = json.loads((out / "auto_mode.json").read_text())["mode"]
    assert sync.get(mode).kind == sync.UPDATE and mode in ("onebit", "pbit", "ps"), mode


# ---- several nodes: bench.netsim --nodes, comm.cost_model.NodeLayout ------------------------------

def test_node_layout_corrects_what_crosses_the_ports_and_keeps_rings():
    from comm import cost_model as cm

    a, b, bits = 1e-4, 1e-8, 8e6
    flat = {k: f(4, bits, a, b) for k, f in (("ring", cm.allreduce_time), ("a2a", cm.all_to_all_time),
                                              ("ag", cm.all_gather_time))}
    layout = cm.NodeLayout(4, 2, intra=(1e-5, 1e-11), inter=(2e-4, 2e-8))
    with cm.node_layout(layout):
        assert cm.allreduce_time(4, bits, a, b) == flat["ring"] and cm.all_gather_time(4, bits, a, b) == flat["ag"]
        # each node's port carries L(P-L)/P = 1 of the buffer, a flat rank (P-1)/P = 3/4
        assert cm.all_to_all_time(4, bits, a, b) == pytest.approx(3 * a + bits * b)
        assert cm.all_to_all_time(2, bits, a, b) == cm.all_to_all_time(2, bits, a, b)  # not the whole layout
        # the server's node receives P-L = 2 payloads through its port, not P-1 = 3
        assert cm.ps_naive_packed(4, 1000, a, b) == pytest.approx(6 * a + 2 * 1000 * 2 * b)
        # hierarchical: reduce-scatter and all-gather inside the node, the vote across at the inter fit
        want = (cm.reduce_scatter_time(2, 32e6, 1e-5, 1e-11) + cm.all_gather_time(2, 1e6, 1e-5, 1e-11)
                + 2 * 2e-4 + 1.5 * 0.5e6 * 2e-8)
        assert cm.hierarchical_onebit(4, 1e6, 32, a, b, node_size=2) == pytest.approx(want)
    assert cm.current_layout() is None and cm.all_to_all_time(4, bits, a, b) == flat["a2a"]
    with pytest.raises(ValueError, match="node_size=3 must be >= 1 and divide world_size=4"):
        cm.NodeLayout(4, 3)


def _links(node_size: int) -> dict:
    world = {"P": 4, "alpha_s": 1e-4, "beta_s_per_bit": 1e-8, "node_size": node_size}
    links = {"world": world}
    if node_size > 1:
        links["intra-node"] = {"P": 2, "alpha_s": 1e-5, "beta_s_per_bit": 1e-11}
        links["inter-node"] = {"P": 2, "alpha_s": 2e-4, "beta_s_per_bit": 2e-8}
    return links


class _SchemeOnly:
    """The registry's prediction of one exchange of n elements (what CommOptimizer sums)."""

    def __init__(self, mode: str, n: int, **options) -> None:
        self.scheme, self.n = sync.get(mode), n
        self.options = self.scheme.options(**options)

    def predict_comm_seconds(self, alpha, beta, P):
        return self.scheme.predict(self.options, P, self.n, alpha, beta)


def test_a_candidates_momentum_sync_is_in_its_predicted_bytes_and_time():
    """lioncub_syncall (4-bit, every layer's momentum synchronised every 10 steps) was predicted at plain 4-bit's
    bytes while its run logged 1.8x: the fp32 allreduce of the selected momenta, booked as its buffer's bytes,
    is added averaged over its interval, and nothing without momentum sync."""
    from model import GPT, param_roles
    from optim.plan import MomentumSync

    cfg = load_config(ROOT / "configs/default.yaml", ["model.preset=debug", "model.tie_embeddings=false", "comm.mode=pbit",
                                                       "comm.bits=4"])
    model = GPT(resolve_config(cfg.model))
    n, P = sum(p.numel() for p in model.parameters()), 4

    class Opt(_SchemeOnly):
        momentum_sync = None

        def wire_bytes_per_step(self, P, rank):
            return {"update": (1000, 2000)}

    plain = Opt("pbit", n, bits=4)
    base_s, base_b = advise.predict_candidate_comm(cfg, plain, _links(1), P, model, 0.0)
    assert base_b == 1000 and base_s == pytest.approx(advise.predict_comm(plain, _links(1), P))
    synced = Opt("pbit", n, bits=4)
    synced.momentum_sync = MomentumSync(every=10, layers=("head",))
    s, b = advise.predict_candidate_comm(cfg, synced, _links(1), P, model, 0.0)
    roles, named = param_roles(model), dict(model.named_parameters())
    m = sum(named[k].numel() for k, r in roles.items() if r == "head")
    assert 0 < m < n and b == pytest.approx(1000 + 4 * m / 10)
    from comm import cost_model as cm
    assert s == pytest.approx(base_s + cm.ring_allreduce(P, m, 32, 1e-4, 1e-8) / 10)
    synced.momentum_sync = MomentumSync(every=10, layers=("all",))
    assert advise.predict_candidate_comm(cfg, synced, _links(1), P, model, 0.0)[1] == pytest.approx(1000 + 0.4 * n)


def test_prediction_on_two_nodes_feeds_the_world_ring_fit_and_the_layout():
    n, P = 8_000_000, 4
    onebit = _SchemeOnly("onebit", n)
    flat = advise.predict_comm(onebit, _links(1), P)
    assert flat == pytest.approx(onebit.predict_comm_seconds(1e-4, 1e-8, P))
    # two nodes of 2: the all-to-all half puts L(P-L) - (P-1) = 1 quarter of n more bits through a port
    assert advise.predict_comm(onebit, _links(2), P) == pytest.approx(flat + 0.25 * n * 1e-8)
    fp32 = _SchemeOnly("fp32", n)  # a ring: the world fit as is
    assert advise.predict_comm(fp32, _links(2), P) == pytest.approx(advise.predict_comm(fp32, _links(1), P))
    hier = _SchemeOnly("hierarchical", n, node_size=2)  # its vote runs at the inter-node axis's fit
    from comm import cost_model as cm
    assert advise.predict_comm(hier, _links(2), P) == pytest.approx(
        cm.reduce_scatter_time(2, 32 * n, 1e-5, 1e-11) + cm.onebit_allreduce(2, n / 2, 1, 2e-4, 2e-8)
        + cm.all_gather_time(2, n, 1e-5, 1e-11))
    assert advise.node_layout(_links(1), P) is None


def test_advise_check_passes_nodes_to_both_netsim_launches(monkeypatch, tmp_path):
    from bench import advise_check

    seen = []
    monkeypatch.setattr(netsim, "run", lambda nproc, cmd, **kw: seen.append((nproc, kw["ranks_per_ns"])) or [3] * nproc)
    assert advise_check.main(["--nproc", "4", "--nodes", "2", "--rates", "1gbit", "--out", str(tmp_path)]) == 1
    assert seen == [(4, 2)]
    argv = []

    class Done:
        returncode = 5
    monkeypatch.setattr(netsim, "run", lambda nproc, cmd, **kw: [0] * nproc)
    monkeypatch.setattr(advise_check.subprocess, "run", lambda cmd, **kw: argv.extend(cmd) or Done())
    assert advise_check.main(["--nproc", "4", "--nodes", "2", "--rates", "1gbit", "--out", str(tmp_path)]) == 1
    assert argv[argv.index("--nodes") + 1] == "2" and "bench.step_breakdown" in argv
    with pytest.raises(SystemExit) as e:
        advise_check.main(["--nproc", "4", "--nodes", "3"])
    assert e.value.code == 2


def test_advise_check_refuses_what_it_cannot_check_in_one_line(monkeypatch, capsys):
    """A config word (it takes --overrides) and a shard size (auto predicts replicated runs) are one line
    on stderr and exit 2 before any namespace or rank starts (it printed argparse's usage block, or
    started the ranks)."""
    from bench import advise_check

    monkeypatch.setattr(netsim, "run", lambda *a, **kw: pytest.fail("netsim started"))
    for argv, says in ((["configs/default.yaml"], "configs/default.yaml"),
                       (["--overrides", "model.preset=debug parallel.shard_size=2"],
                        "--overrides parallel.shard_size=2: bench.advise_check checks comm.mode=auto")):
        with pytest.raises(SystemExit) as e:
            advise_check.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and err.count("\n") == 1 and "usage:" not in err, err


def test_a_candidate_may_be_a_preset_with_optim_or_comm_keys_set():
    """`name@section.key=value` (bench.step_breakdown's syntax): the preset with the key set, the whole
    string as its name; a key outside optim / comm or a malformed entry is a ValueError naming it."""
    base, r16 = advise.load_variant("dion"), advise.load_variant("dion@optim.rank_fraction=0.0625@comm.mode=fp32")
    assert r16.name == "dion@optim.rank_fraction=0.0625@comm.mode=fp32"
    assert r16.sections["optim"] == {**base.sections["optim"], "rank_fraction": 0.0625}
    assert r16.sections["comm"] == {**base.sections["comm"], "mode": "fp32"}
    synched = advise.load_variant("lioncub_4bit_synchead@comm.momentum_sync.every=5")  # nested: merged key by key
    assert synched.sections["comm"]["momentum_sync"] == {"every": 5, "layers": ["head"]}
    assert advise.load_variant("lioncub_4bit_synchead").sections["comm"]["momentum_sync"]["every"] == 10
    with pytest.raises(ValueError, match=r"'dion@model.n_layer=2': model\.\* is not an optimizer or mode key"):
        advise.load_variant("dion@model.n_layer=2")
    with pytest.raises(ValueError, match=r"'dion@rank': override 'rank': expected section.key=value"):
        advise.load_variant("dion@rank")
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        advise.load_variant("nope@optim.lr=1")


def test_advise_check_measured_reuses_step_breakdown_runs(monkeypatch, tmp_path):
    """--measured DIR: bench.advise runs in the measured runs' layout and config, nothing is trained again,
    and the table joins the predictions with DIR's rows; a differing layout or a missing run is refused."""
    from bench import advise_check

    d = tmp_path / "breakdown"
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"nproc": 4, "nodes": 2, "config_dir": "configs/variants",
                                             "overrides": ["model.preset=study", "data.order=shuffled"],
                                             "steps": 10, "warmup": 3, "rates": ["100mbit"],
                                             "variants": ["lion_fp32", "dion@optim.rank_fraction=0.0625"]}))
    rows = [("lion_fp32", 10, 8000.0), ("dion@optim.rank_fraction=0.0625", 10, 4000.0), ("diloco_h10", 50, 3000.0)]
    (d / "results.csv").write_text("rate,variant,status,steps,step_ms,coll_ms,load1\n" + "".join(
        f"100mbit,{v},ok,{n},{ms},{ms / 2},6.0\n" for v, n, ms in rows))
    seen = []

    def fake_advise(nproc, cmd, rate, ranks_per_ns, **kw):
        seen.append((nproc, ranks_per_ns, rate, cmd))
        names = cmd[cmd.index("--variants") + 1].split(",")
        pred = {"lion_fp32": 7.6, "dion@optim.rank_fraction=0.0625": 4.4, "diloco_h10": 3.3}
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"rows": [
            {"variant": v, "status": "ok", "mode": "x", "step_s": pred[v], "compute_s": 2.0, "local_s": 0.1,
             "comm_s": pred[v] - 2.1, "evidence": "not for auto: none"} for v in names]}))
        return [0] * nproc

    monkeypatch.setattr(netsim, "run", fake_advise)
    monkeypatch.setattr(advise_check.subprocess, "run", lambda *a, **kw: pytest.fail("trained again"))
    out = tmp_path / "out"
    assert advise_check.main(["--measured", str(d), "--out", str(out)]) == 0
    (nproc, per_ns, rate, cmd), = seen
    assert (nproc, per_ns, rate) == (4, 2, "100mbit")
    assert "configs/variants/lion_fp32.yaml" in " ".join(cmd) and {"model.preset=study", "data.order=shuffled"} <= set(cmd)
    assert cmd[cmd.index("--variants") + 1] == "lion_fp32,dion@optim.rank_fraction=0.0625"
    table = {r["variant"]: r for r in csv.DictReader((out / "validation.csv").open())}
    assert set(table) == {"lion_fp32", "dion@optim.rank_fraction=0.0625"}
    assert float(table["lion_fp32"]["pred_over_meas"]) == pytest.approx(0.95)
    assert float(table["dion@optim.rank_fraction=0.0625"]["pred_over_meas"]) == pytest.approx(1.1)
    md = (out / "validation.md").read_text()
    assert f"median of 10 steps after 3 warm-up (bench.step_breakdown, `{d}`)" in md and "2 nodes of 2 ranks" in md
    seen.clear()
    assert advise_check.main(["--measured", str(d), "--variants", "lion_fp32,diloco_h10", "--out", str(out)]) == 0
    assert "median of 10-50 steps" in (out / "validation.md").read_text()
    for bad, says in ((["--nproc", "8"], "--nproc 8 differs from the measured runs' 4"),
                      (["--overrides", "model.preset=debug"], "--overrides 'model.preset=debug' differs"),
                      (["--steps", "5"], "--steps: the measured runs"),
                      (["--variants", "lioncub_1bit"], "no run of lioncub_1bit at 100mbit"),
                      (["--rates", "1gbit"], "no run of lion_fp32 at 1gbit")):
        with pytest.raises(SystemExit) as e:
            advise_check.main(["--measured", str(d), "--out", str(out), *bad])
        assert e.value.code == 2
    with pytest.raises(SystemExit):
        advise_check.main(["--measured", str(tmp_path / "none")])


@needs_netsim
@pytest.mark.slow
def test_two_node_links_match_the_layout_model(tmp_path):
    """bench.netsim --nodes 2 at 100 Mbit/s between nodes: the world's ring fit is the inter-node
    rate, and the all-to-all takes at least what the layout puts through a node's port (L(P-L)/P of
    the buffer: 4/3 of the flat model's bytes at 2 x 2)."""
    out = tmp_path / "links.json"
    codes = netsim.run(4, [sys.executable, "-m", "bench.advise", str(ROOT / "configs/default.yaml"),
                           "--links-only", "--json", str(out)], rate="100mbit", ranks_per_ns=2, timeout=180,
                       cwd=str(ROOT), env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                                           "TORCH_CPP_LOG_LEVEL": "ERROR"}, tag="tadvn", stream=io.StringIO())
    assert codes == [0] * 4
    links = json.loads(out.read_text())["links"]
    assert set(links) == {"world", "intra-node", "inter-node"} and links["world"]["node_size"] == 2
    assert 0.075 <= links["world"]["gbit_s"] <= 0.125, links["world"]
    a2a = links["world"]["checks"]["all_to_all"]
    # the layout model within 30 % and the flat model's 4/3 shortfall seen, with room for a loaded
    # machine (the ratios on an idle and a loaded one: docs/results/code_notes.md)
    assert 0.8 <= a2a["measured_over_model"] <= 1.3 and a2a["measured_s"] / a2a["model_flat_s"] >= 1.15, a2a


def _advise_main(monkeypatch, argv: list[str]) -> tuple[int, list]:
    """bench.advise's main up to the measurement: the run's config and the candidates it would compare."""
    from types import SimpleNamespace

    import torch

    seen: list = []
    monkeypatch.setattr(advise_command, "init_distributed",
                        lambda *a, **k: SimpleNamespace(is_main=True, device=torch.device("cpu"), world_size=1))
    monkeypatch.setattr(advise_command, "dist", SimpleNamespace(broadcast_object_list=lambda box, src: None,
                                                                destroy_process_group=lambda: None))
    monkeypatch.setattr(advise_command, "advise",
                        lambda cfg, cands, *a, **k: seen.append((cfg, cands)) or {"links": {}, "rows": []})
    return advise_command.main(argv), seen


def test_variants_files_are_compared_and_config_files_compose(monkeypatch, capsys):
    default, variants = str(ROOT / "configs/default.yaml"), ROOT / "configs/variants"
    one, eight = str(variants / "lioncub_1bit.yaml"), str(variants / "lioncub_8bit_l1.yaml")
    # --variants A.yaml B.yaml: each file one candidate, composed over the run's config and the overrides
    rc, seen = _advise_main(monkeypatch, [default, "--variants", one, eight, "optim.lr=2e-4", "--steps", "1"])
    assert rc == 0, capsys.readouterr().err
    (cfg, cands), = seen
    assert [c.name for c in cands] == ["lioncub_1bit", "lioncub_8bit_l1"] and cfg.optim.name == "lion"
    for c, f in zip(cands, (one, eight)):
        want = load_config([default, f], ["optim.lr=2e-4"]).to_dict()
        assert c.sections == {"optim": want["optim"], "comm": want["comm"]} and c.sections["optim"]["lr"] == 2e-4
    assert cfg.to_dict() == load_config([default], ["optim.lr=2e-4"]).to_dict()
    # without --variants the files compose into the run's config, and every configs/variants file is a candidate
    rc, seen = _advise_main(monkeypatch, [default, one, "--steps", "1", "optim.lr=2e-4"])
    (cfg, cands), = seen
    assert rc == 0 and cfg.comm.mode == "onebit" and cfg.optim.lr == 2e-4
    assert [c.name for c in cands] == advise.variant_names()
    # registry names keep working, and a candidate on another model is refused in one line
    rc, seen = _advise_main(monkeypatch, [default, "--variants", "lion_fp32,lioncub_1bit"])
    assert rc == 0 and [c.name for c in seen[0][1]] == ["lion_fp32", "lioncub_1bit"]
    capsys.readouterr()
    assert _advise_main(monkeypatch, ["--variants", "lion_fp32"])[0] == 2
    assert "--variants lion_fp32: names no model" in capsys.readouterr().err
    rc, _ = _advise_main(monkeypatch, [str(ROOT / "configs/gpt2_124m.yaml"), "--variants", one,
                                       str(ROOT / "configs/gpt2_774m/onebit_adam.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and "onebit_adam.yaml: its model section differs" in err and err.count("\n") == 1


def test_auto_with_no_candidate_the_evidence_allows_fails_before_measuring(monkeypatch, tmp_path):
    """comm.auto_allow=[diloco] for AdamW: its DiLoCo variants have no quality evidence, so auto has nothing
    to choose; it says so before measuring links and compute (minutes on a cluster), naming each reason."""
    import torch

    from trainer import automode
    from trainer.dist import DistInfo

    monkeypatch.setattr(advise, "advise", lambda *a, **k: pytest.fail("measured with nothing to choose"))
    cfg = load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", "optim.name=adamw", "comm.auto_allow=[diloco]",
                                                      f"train.out_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"the quality evidence allows none of its candidates \(diloco_h10: .*"
                                          r"name a variant in comm.auto_allow to allow it anyway"):
        automode.resolve(cfg, DistInfo(0, 1, 0, torch.device("cpu"), "gloo"), tmp_path, lambda s: None)


def test_advise_refuses_a_missing_dataset_and_no_steps_in_one_line(tmp_path, capsys):
    """A config whose dataset is not on this machine: one line, exit 2, on one rank as on several (rank 0's
    error is broadcast; it was a traceback on rank 0 and a closed connection on the others). --steps 0: one line."""
    assert advise_command.main([str(ROOT / "configs/default.yaml"), f"data.dataset={tmp_path / 'nope'}",
                                "model.preset=debug", "--variants", "lion_fp32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data dir ") and "does not exist" in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as e:
        advise_command.parse_args([str(ROOT / "configs/default.yaml"), "--steps", "0"])
    assert e.value.code == 2 and "--steps 0: time at least 1 step" in capsys.readouterr().err


def test_remeasuring_a_resumed_run_that_picks_another_mode_says_so(monkeypatch, tmp_path):
    """comm.auto_remeasure=true on a run with a checkpoint: the same pick continues; another pick is one error
    naming both and the two ways on (it was 'this config differs from checkpoint' about keys the user never set)."""
    import json

    import torch

    from trainer import automode
    from trainer.dist import DistInfo

    run = tmp_path / "run"
    (run / "ckpt" / "step_000005").mkdir(parents=True)
    (run / "ckpt" / "step_000005" / "meta.json").write_text("{}")
    old = advise.load_variant("lion_fp32")
    (run / automode.DECISION).write_text(json.dumps({"variant": old.name, "mode": "fp32", "sections": old.sections,
                                                     "predicted_step_s": 0.2}))
    cfg = load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", "comm.auto_allow=[fp32, pbit]",
                                                      "comm.auto_remeasure=true", "train.resume=auto",
                                                      f"train.out_dir={run}"])
    info = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")
    monkeypatch.setattr(advise, "advise", lambda *a, **k: {"rows": [{"variant": "x", "status": "ok"}], "links": {},
                                                           "compute": {}})
    monkeypatch.setattr(advise, "table_markdown", lambda result: "")
    for name, mode in (("lion_fp32", "fp32"), ("lioncub_8bit_l1", "pbit")):
        monkeypatch.setattr(advise, "pick", lambda result, gain, n=name, m=mode: ({"variant": n, "mode": m,
                                                                                    "step_s": 0.1}, ""))
        if name == "lion_fp32":
            assert automode.resolve(cfg, info, tmp_path, lambda s: None)[0].comm.mode == "fp32"
            continue
        with pytest.raises(ConfigError, match=r"comm.auto_remeasure=true picked lioncub_8bit_l1 now, but the checkpoint "
                                              r"in .* was trained with lion_fp32 \(auto_mode.json\); a run cannot "
                                              r"change its comm.mode mid-way"):
            automode.resolve(cfg, info, tmp_path, lambda s: None)
    # a decision file of the wrong shape: its error says to remeasure, and remeasuring gets past it
    (run / automode.DECISION).write_text(json.dumps({"variant": 3}))
    assert automode.resolve(cfg, info, tmp_path, lambda s: None)[0].comm.mode == "pbit"
    keep = load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", "comm.auto_allow=[fp32, pbit]",
                                                       "train.resume=auto", f"train.out_dir={run}"])
    with pytest.raises(ConfigError, match="comm.auto_remeasure=true"):
        automode.resolve(keep, info, tmp_path, lambda s: None)
