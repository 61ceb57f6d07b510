"""One validation path: whether an optimizer runs on a mode, with which options and run settings, is
decided by the registries (optim.registry.run_problems, SyncScheme.run_problems); the config asks
them, and an optimizer built directly gets the same answer. A scheme registered here, which
trainer/config.py has never heard of, is validated by its declared capabilities alone."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import optim
from optim.muon import Muon
from optim import sync
from optim.options import common_problems
from optim.registry import compatibility_problem, get_optimizer, optimizer_names, register_optimizer, run_problems
from trainer.config import ConfigError, load_config

TEST_MODE = "cap_test_vote"


def _problems(overrides: list[str]) -> str:
    try:
        load_config(None, ["model.preset=debug", *overrides])
    except ConfigError as e:
        return str(e)
    return ""


def test_every_optimizer_mode_verdict_is_the_registrys():
    """For every (optimizer, mode) pair the config refuses exactly when the registry does, with the
    registry's own message."""
    for name in optimizer_names():
        for scheme in sync.schemes():
            problem = compatibility_problem(name, scheme.name, scheme.default_options())
            msg = _problems([f"optim.name={name}", f"comm.mode={scheme.name}", "optim.grad_clip=0"])
            if problem:
                assert problem in msg, (name, scheme.name, msg)
            else:  # only option checks unrelated to the pair may remain (none with the defaults)
                assert "needs" not in msg and "optim.name" not in msg, (name, scheme.name, msg)


@pytest.fixture
def test_scheme():
    """An update-sync sign scheme, whole-vector, not on shards, declared only here."""
    onebit = sync.get("onebit")
    scheme = dataclasses.replace(onebit, name=TEST_MODE, bucketable=False, shards=False)
    sync.register(scheme)
    try:
        yield scheme
    finally:
        sync.unregister(TEST_MODE)


def test_config_follows_a_new_schemes_capabilities(test_scheme):
    base = [f"comm.mode={TEST_MODE}", "optim.grad_clip=0"]
    assert _problems(base) == ""  # lion accepts an update-sync sign scheme: Distributed Lion
    # its kind makes momentum sync apply and adamw refuse it, with the registry's words
    assert _problems([*base, "comm.momentum_sync.every=5", "comm.momentum_sync.layers=[all]"]) == ""
    assert compatibility_problem("adamw", TEST_MODE) in _problems([*base, "optim.name=adamw"])
    # not bucketable, not on shards: the config says so without knowing the name
    assert f"comm.mode={TEST_MODE} exchanges its vector as a whole" in _problems([*base, "comm.bucket_mb=1"])
    assert f"comm.mode={TEST_MODE} does not run across replicas" in _problems([*base, "parallel.shard_size=2"])
    # declare the capabilities and the same config passes
    sync.register(dataclasses.replace(test_scheme, bucketable=True, shards=True), replace=True)
    assert _problems([*base, "comm.bucket_mb=1"]) == ""
    assert _problems([*base, "parallel.shard_size=2"]) == ""


def test_config_follows_an_optimizer_entrys_accepts(monkeypatch):
    """Widen adamw's accepts in its registry entry only: the config's verdict changes with it."""
    assert "optim.name=adamw needs" in _problems(["optim.name=adamw", "comm.mode=onebit"])
    spec = get_optimizer("adamw")
    register_optimizer(dataclasses.replace(spec, accepts=lambda s: True), replace=True)
    try:
        assert "needs" not in _problems(["optim.name=adamw", "comm.mode=onebit", "optim.grad_clip=0"])
    finally:
        register_optimizer(spec, replace=True)


def _groups():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return [{"params": list(model.parameters()), "lr": 0.01, "weight_decay": 0.0, "role": "mlp"}]


@pytest.mark.parametrize("cls, name, mode", [(optim.DistributedLion, "lion", "compressed"),
                                             (Muon, "muon", "onebit"),
                                             (optim.BinSGDM, "binsgdm", "pbit"),
                                             (optim.OneBitAdam, "onebit_adam", "fp32")])
def test_direct_construction_raises_the_registry_problem(cls, name, mode):
    with pytest.raises(ValueError) as e:
        cls(_groups(), scheme=mode)
    assert compatibility_problem(name, mode, sync.get(mode).default_options()) in str(e.value)


def test_common_keys_have_one_rule():
    """betas = 1 is refused by the config and by every constructor with the same message."""
    want = common_problems(betas=[0.9, 1.0])[0]
    assert want in _problems(["optim.betas=[0.9, 1.0]"])
    for cls, mode in [(optim.Lion, "fp32"), (optim.DistributedLion, "onebit"), (Muon, "fp32")]:
        with pytest.raises(ValueError, match=r"optim.betas: \[0.9, 1.0\] must be two numbers in \[0, 1\)"):
            cls(_groups(), betas=(0.9, 1.0), scheme=mode)
    assert common_problems(betas=[0.9, 0.99], lr=1e-3, eps=0.0, weight_decay=0.1, grad_clip=1.0) == []


def test_scheme_run_problems_are_what_the_optimizer_raises():
    """A constructor raises the scheme's run_problems text (here: overlap without buckets)."""
    problem = sync.get("onebit").run_problems(sync.get("onebit").default_options(), 1, overlap=True)
    assert problem == ["comm.overlap: true needs buckets; set comm.bucket_mb > 0 (e.g. 25, DDP's default)"]
    with pytest.raises(ValueError, match="comm.overlap: true needs buckets"):
        optim.build_optimizer("lion", _groups(), comm_mode="onebit", overlap=True)
    assert run_problems("lion", "loco", sync.get("loco").default_options(), 4, bucket_mb=1.0) == [
        "comm.bucket_mb / comm.overlap: comm.mode=loco exchanges its vector as a whole (its state or its scales "
        "span it); set comm.bucket_mb=0 and comm.overlap=false"]


def test_dion_built_directly_is_checked_against_its_own_entry():
    import torch

    from optim.dion import Dion

    p = torch.nn.Parameter(torch.zeros(8, 8))
    groups = [{"params": [p], "names": ["w"], "role": "attn", "lr": 1e-3, "weight_decay": 0.0, "lr_mult": 1.0}]
    with pytest.raises(ValueError, match=r"comm.mode: loco .* optim.name=dion needs a mean-allreduce scheme"):
        Dion(groups, lr=1e-3, scheme="loco")  # muon's entry accepts loco: Dion must be checked against its own
