"""One resolution of the run: optim.registry.resolve turns (optim, comm, parallel, world) into one
frozen RunPlan, validated once; the config asks its problems-only twin; the optimizer takes the
plan without checking it again; what a step synchronises is the strategy of the scheme's kind."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import optim
import optim.base
import trainer.config_validate
from optim import sync
from optim.plan import MomentumSync, RunPlan
from optim.registry import build_from_plan, plan_problems, resolve
from optim.strategy import GradientSync, LocalSync, UpdateSync, register_strategy, strategy_for
from trainer.config import ConfigError, load_config


def _groups():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return [{"params": list(model.parameters()), "lr": 0.01, "weight_decay": 0.0, "role": "mlp"}]


def test_resolve_gives_a_frozen_plan():
    plan = resolve("lion", comm_mode="pbit", comm_options={"bits": 8}, bucket_mb=1.0,
                   momentum_sync={"every": 2, "layers": ["mlp"]})
    assert isinstance(plan, RunPlan) and plan.scheme is sync.get("pbit") and plan.scheme_options.bits == 8
    assert plan.bucket_bytes == 2 ** 20 and plan.momentum_sync == MomentumSync(every=2, layers=("mlp",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.grad_clip = 1.0
    with pytest.raises(TypeError):
        plan.shard_dims[1] = 0  # read-only mapping
    # every = 0: no momentum sync in the plan
    assert resolve("lion", comm_mode="onebit", momentum_sync={"every": 0}).momentum_sync is None


def test_resolve_lists_every_problem_in_one_error():
    with pytest.raises(ValueError) as e:
        resolve("lion", comm_mode="onebit", betas=(0.9, 1.0), overlap=True, kernels="fastest",
                momentum_sync={"every": 1, "start": 5, "stop": 2})
    msg = str(e.value)
    for key in ("optim.betas:", "comm.overlap:", "comm.kernels:", "comm.momentum_sync:"):
        assert key in msg, (key, msg)
    assert "; ".join(plan_problems("lion", comm_mode="onebit", betas=(0.9, 1.0), overlap=True, kernels="fastest",
                                   momentum_sync={"every": 1, "start": 5, "stop": 2})) == msg
    # an optimizer that does not accept the mode: the registry's message, and unknown keys named
    with pytest.raises(ValueError, match=r"optim.name=adamw needs .*unknown comm options \['bitz'\]|"
                                         r"unknown comm options \['bitz'\].*optim.name=adamw needs"):
        resolve("adamw", comm_mode="pbit", comm_options={"bitz": 3})


def test_config_validation_asks_the_plans_function(monkeypatch):
    """Change the function that resolves plans and the config's verdict changes with it."""
    real = trainer.config_validate.plan_problems
    monkeypatch.setattr(trainer.config_validate, "plan_problems",
                        lambda *a, **k: real(*a, **k) + ["comm.planted: from the plan's function"])
    with pytest.raises(ConfigError, match="comm.planted: from the plan's function"):
        load_config(None, ["model.preset=debug"])


def test_optimizer_takes_the_plan_and_does_not_validate_again(monkeypatch):
    plan = resolve("lion", comm_mode="onebit")

    def refuse(*a, **k):
        raise AssertionError("resolved again")

    monkeypatch.setattr(optim.base, "resolve", refuse)
    opt = build_from_plan(plan, _groups())
    assert opt.plan is plan and isinstance(opt, optim.DistributedLion) and isinstance(opt.strategy, UpdateSync)
    with pytest.raises(TypeError, match="either a plan or its settings"):
        optim.DistributedLion(_groups(), plan=plan, grad_clip=1.0)


def test_direct_construction_resolves_a_plan_from_its_keywords():
    opt = optim.Lion(_groups(), scheme="bf16", grad_clip=0.5)
    assert opt.plan.optimizer == "lion" and opt.plan.scheme.name == "bf16" and opt.plan.grad_clip == 0.5
    assert isinstance(opt.strategy, GradientSync)
    with pytest.raises(ValueError, match="for 2 ranks"):  # a plan of another world
        build_from_plan(dataclasses.replace(opt.plan, world_size=2), _groups())


def test_strategy_is_chosen_by_the_schemes_kind():
    for scheme in sync.schemes():
        want = {sync.GRADIENT: GradientSync, sync.UPDATE: UpdateSync, sync.LOCAL: LocalSync}[scheme.kind]
        assert strategy_for(scheme) is want, scheme.name
    base = Path(optim.base.__file__).read_text()
    assert "per_rank_state" not in base


def test_a_new_strategy_plugs_in_through_its_hook():
    """A strategy with an outer synchronisation after the update (as DiLoCo's would be) runs in
    the step without a change to the base: here every 2nd step it counts the step it saw."""
    seen = []

    class Outer(UpdateSync):
        def bind(self, opt):
            self.every = 2

        def after_update(self, opt, step):
            if step % self.every == 0:
                seen.append((step, opt.steps_done))

    register_strategy(Outer, replace=True)
    try:
        opt = optim.build_optimizer("lion", _groups(), comm_mode="onebit")
        assert isinstance(opt.strategy, Outer)
        for _ in range(4):
            for g in opt.param_groups:
                for p in g["params"]:
                    p.grad.copy_(torch.randn_like(p))
            opt.step()
    finally:
        register_strategy(UpdateSync, replace=True)
    assert seen == [(2, 2), (4, 4)]
