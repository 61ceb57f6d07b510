"""The sync-scheme registry: a scheme defined outside the project trains end to end; every
registered scheme is complete (options validate, byte formula, cost prediction) and shows up in
the config's help, the benchmarks and the README's table."""
from __future__ import annotations

import json
import pytest
import torch

from model import GPT, get_preset
from optim import sync
from tests.dist import ROOT, torchrun


def test_a_scheme_defined_in_a_test_file_trains_via_config(tmp_path):
    run = tmp_path / "toy"
    torchrun(2, "toy_scheme.py", str(run), timeout=300)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "train_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert steps[-1]["train_loss"] < steps[0]["train_loss"] - 0.5, [r["train_loss"] for r in steps]
    # bytes per step are the declared formula: 4 bytes per parameter (fp32 signs), every step
    n = GPT(get_preset("debug")).num_params()
    assert {r["comm_bytes"] for r in steps} == {4 * n}
    final = [r for r in recs if "params_identical" in r][-1]
    assert final["params_identical"] and len(final["param_sha256"]) == 2
    assert "toy_signmean" in (run / "config.yaml").read_text()


@pytest.mark.parametrize("name", sync.names())
def test_every_scheme_is_complete(name):
    scheme = sync.get(name)
    opts = scheme.default_options()
    assert opts.problems(4) == [] or name == "hierarchical"  # node_size 0 = LOCAL_WORLD_SIZE
    assert scheme.wire and scheme.help
    n, a, b = 1_000_003, 1e-5, 1e-9
    for P in (2, 4, 8):
        sent, recv = scheme.bytes_per_call(opts, P, n, rank=1)
        assert 0 < sent and 0 < recv, (name, P)
        assert scheme.predict(opts, P, n, a, b) > 0
    assert scheme.bytes_per_call(opts, 1, n) == (0, 0)
    assert scheme.predict(opts, 1, n, a, b) == 0.0
    # an exchange at P = 1 returns the right shape and leaves a gradient scheme's mean exact
    x = torch.randn(1000)
    out = scheme.build(opts, sync.ExchangeContext(world_size=1, rank=0))(x.clone(), 1)
    assert out.shape == x.shape
    if scheme.kind in (sync.GRADIENT, sync.LOCAL) and name != "loco":  # a local scheme sends nothing per step
        assert torch.equal(out, x)
    elif name == "loco":  # compresses at P = 1 too (int4, one block here): within half a level of x
        assert (out - x).abs().max() <= x.abs().max() / 14 * (1 + 1e-6)
    elif scheme.result == sync.MEAN:  # compressed: scaled signs of x, mean |x| each at P = 1
        assert torch.allclose(out.abs(), x.abs().mean().expand_as(x), rtol=1e-4) and torch.equal(out >= 0, x >= 0)
    else:
        assert set(out.unique().tolist()) <= {-1.0, 0.0, 1.0}


def test_registry_drives_help_benchmarks_and_readme():
    from bench import comm as bench_comm
    from trainer.config import describe

    assert bench_comm.default_modes() == sync.names()
    text = describe()
    assert all(n in text for n in sync.names())
    table = sync.markdown_table()
    assert all(f"| `{n}` |" in table for n in sync.names())
    readme = (ROOT / "README.md").read_text()
    assert table in readme, "README's mode table is stale: paste the output of `python -m optim`"
    from optim import optimizers_table

    assert optimizers_table() in readme, "README's optimizer table is stale: paste the output of `python -m optim`"


def test_register_rejects_duplicates_and_clashing_options():
    from dataclasses import dataclass

    with pytest.raises(ValueError, match="already registered"):
        sync.register(sync.get("onebit"))

    @dataclass
    class Clash(sync.SchemeOptions):
        bits: str = "four"  # pbit's bits is an int with default 4

    bad = sync.SyncScheme(name="clash", kind=sync.UPDATE, result=sync.SIGN, options=Clash,
                          build=lambda o, c: None, wire_bytes=lambda *a: (0, 0), predict=lambda *a, **k: 0.0,
                          wire="-", help="-")
    with pytest.raises(ValueError, match="option 'bits' clashes with scheme 'pbit'"):
        sync.register(bad)
    assert "clash" not in sync.names()


def test_sign_flip_denominator_is_stated_in_code_and_metrics_docs():
    import optim.diagnostics as diag

    assert "Denominator: ALL elements" in diag.__doc__
    docs = (ROOT / "docs" / "running.md").read_text()  # the diagnostics table (the README links it)
    row = next(ln for ln in docs.splitlines() if ln.startswith("| `diag/sign_flip` |"))
    assert "Denominator: all elements" in row


def test_cycle_steps_come_from_the_scheme_so_a_new_local_scheme_needs_no_bench_edit():
    """A per-step scheme repeats every step; a local-update scheme declares its cycle (DiLoCo: its
    inner_steps), and the benchmarks' cycle (bench.step_breakdown.cycle_steps, read from a run's
    config) is the scheme's, also for a local-update scheme registered here."""
    from dataclasses import dataclass

    from bench.step_breakdown import cycle_steps
    from optim.sync.registry import LocalScheme

    diloco = sync.get("diloco")
    assert diloco.cycle_steps(diloco.options(diloco={"inner_steps": 7})) == 7
    assert all(sync.get(n).cycle_steps(sync.get(n).default_options()) == 1
               for n in sync.names() if sync.get(n).kind != sync.LOCAL)
    assert cycle_steps({"comm": {"mode": "diloco", "diloco": {"inner_steps": 5}}}) == 5
    assert cycle_steps({"comm": {"mode": "fp32"}}) == 1

    @dataclass
    class Every(sync.SchemeOptions):
        toy_period: int = 3

    def local(**kw):
        return LocalScheme(name="toy_local", kind=sync.LOCAL, result=sync.MEAN, options=Every, build=lambda o, c: None,
                           wire_bytes=lambda *a, **k: (0, 0), predict=lambda *a, **k: 0.0, wire="-", help="-", **kw)

    with pytest.raises(ValueError, match="declares its cycle"):
        local(predict_cycle=lambda *a: None)
    with pytest.raises(ValueError, match="declares its prediction"):
        local(cycle=lambda o: 1)
    sync.register(local(cycle=lambda o: 2 * o.toy_period, predict_cycle=lambda *a: None))
    try:
        assert cycle_steps({"comm": {"mode": "toy_local", "toy_period": 4, "diloco": {"inner_steps": 9}}}) == 8
    finally:
        sync.unregister("toy_local")
    with pytest.raises(ValueError, match="comm.mode='auto' is not a registered sync scheme"):
        cycle_steps({"comm": {"mode": "auto"}})


def test_a_local_scheme_registered_here_is_predicted_by_its_own_method_in_auto_and_the_lab():
    """comm.mode=auto's row (trainer.advise.predict_candidate_comm) and bench.time_to_loss's cluster
    prediction ask a local-update scheme for its communication (LocalScheme.predict_local): a scheme
    registered here, unknown to both, gets its own numbers from the model's parameters, P, the link
    and the step's compute, not DiLoCo's."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    from bench import time_to_loss as ttl
    from trainer import advise
    from optim.sync.registry import LocalPrediction, LocalScheme

    @dataclass
    class Toy(sync.SchemeOptions):
        toy_period: int = 3

    seen = []

    def predict_cycle(o, P, params, alpha, beta, step_compute_s, background):
        seen.append((o, P, params, alpha, beta, step_compute_s, background))
        n = sum(k for _, k in params)
        wire = alpha * P + 8 * 4 * n * beta           # one fp32 send of every parameter a cycle
        exposed = max(0.0, wire - step_compute_s) if background else wire
        return LocalPrediction(cycle_steps=o.toy_period, comm_s=exposed / o.toy_period, cycle_comm_s=exposed,
                               wire_s=wire, bytes_per_step=4 * n / o.toy_period, peak_step_bytes=4 * n,
                               cycle_bytes=4 * n)

    sync.register(LocalScheme(name="toy_local", kind=sync.LOCAL, result=sync.MEAN, options=Toy,
                              build=lambda o, c: None, wire_bytes=lambda *a, **k: (0, 0),
                              predict=lambda *a, **k: 123.0, wire="-", help="-", cycle=lambda o: o.toy_period,
                              predict_cycle=predict_cycle))
    try:
        cfg = {"model": {"preset": "debug"}, "data": {"seq_len": 32}, "comm": {"mode": "toy_local", "toy_period": 4,
                                                                             "bucket_mb": 0.0}}
        curve = ttl.Curve("toy", "-", [10.0], [3.0], tokens_per_step=64.0, config=cfg)
        cl = ttl.parse_cluster("nodes=2 gpus_per_node=2 gpu=h100 inter=1gbit mfu=0.4")
        got = ttl.predict_cluster_step(curve, cl, vocab_size=512)
        model = ttl._model(cfg, 512)
        n = sum(p.numel() for p in model.parameters())
        opts, P, params, alpha, beta, compute, background = seen[-1]
        assert opts == Toy(toy_period=4) and P == 4 and (alpha, beta) == cl.world_link()
        assert params == advise.param_layout(model) and sum(k for _, k in params) == n
        assert any(layer.startswith("block.") for layer, _ in params) and ("", 512 * 64) in params
        assert compute == pytest.approx(got["compute_s"]) and compute > 0 and background is True
        wire = alpha * 4 + 32 * n * beta
        assert got["comm_s"] == pytest.approx(max(0.0, wire - compute) / 4) and got["comm_s"] != 123.0
        assert got["bytes_per_step"] == pytest.approx(n) and got["peak_step_bytes"] == 4 * n
        assert got["comm_how"].startswith("toy_local: ") and "over 4 inner steps" in got["comm_how"]
        # auto's row: the candidate config's scheme and options, the measured links, the row's compute
        links = {"world": {"alpha_s": 2e-5, "beta_s_per_bit": 1e-9, "node_size": 1}}
        row = SimpleNamespace(comm=SimpleNamespace(mode="toy_local", options=Toy(toy_period=5)))
        comm_s, sent = advise.predict_candidate_comm(row, None, links, 2, model, 1e-6)
        assert seen[-1] == (Toy(toy_period=5), 2, advise.param_layout(model), 2e-5, 1e-9, 1e-6, True)
        assert comm_s == pytest.approx((2e-5 * 2 + 32 * n * 1e-9 - 1e-6) / 5) and comm_s != 123.0
        assert sent == pytest.approx(4 * n / 5)
    finally:
        sync.unregister("toy_local")
