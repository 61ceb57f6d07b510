"""The registry of optimizers (`optim.name`): how a name becomes an optimizer on a sync scheme.

An entry declares its extra options (a dataclass of `optim.*` keys beyond the common ones),
which sync schemes it can run on, and its build function. `build_optimizer` is the one place the
trainer and the benchmarks turn (optim.name, comm.mode, options) into an optimizer.

`resolve` turns (optim, comm, parallel, world) into the run's frozen `RunPlan` (optim/plan.py),
running every check once; `plan_problems` is its problems-only twin, which the config's validation
asks. Every optimizer module registers its own entry at its end (`register_optimizer(OptimizerSpec(...))`:
adamw.py, lioncub.py for "lion", muon.py, ...); this module imports none of them, and the base
(optim/base.py) asks `resolve` for a plan only when a class is built directly, so the dependencies
run one way: optimizer module -> base -> registry -> plan, sync. `optim/__init__.py` imports every optimizer module, so the table is full
once `optim` is imported.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

import comm

from comm import kernels as _kernels

from . import sync
from .layout import is_matrix_param
from .options import Options, choice, common_problems
from .plan import MomentumSync, RunPlan


@dataclass
class OptimOptions(Options):
    """Options of an optimizer beyond the common optim.* keys; keys live in the `optim` section."""

    section = "optim"


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    options: type[OptimOptions]
    build: Callable[..., torch.optim.Optimizer]
    """build(param_groups, *, plan, group, param_order, shard_group) -> the entry's CommOptimizer for the
    resolved RunPlan (optim/plan.py) on those process groups."""
    accepts: Callable[[sync.SyncScheme], bool]
    needs: str
    """What kind of scheme it runs on, for error messages."""
    state: str
    """Optimizer state per parameter (README table)."""
    help: str
    scheme_problems: Callable[[sync.SchemeOptions], list[str]] | None = None
    """Problems with the selected scheme's options for this optimizer (e.g. a compressor it cannot
    use), each naming the comm.* key; None = any options of an accepted scheme."""
    state_words: Callable[[OptimOptions, sync.SyncScheme, bool], float] | None = None
    """fp32 words of optimizer state per element of a parameter, hidden matrix or not:
    state_words(options, scheme, matrix) (model.memory; the exchange's own state is the scheme's
    `state_bytes`). None = unknown (the memory model says so)."""
    update_buffer: Callable[[int, bool], int] | None = None
    """Elements of the buffer an update-sync run holds its exchanged vector in, for n local elements:
    update_buffer(n, separate) (separate: comm.overlap with buckets, the vector made during backward;
    model.memory). None = the whole vector, n."""
    shards: bool = False
    """Runs on the local shards of a sharded model (parallel.shard_size > 1): its math is element-wise
    on the flat layout, so the shards of a parameter need no view of the whole tensor."""
    shard_dim: Callable[[OptimOptions, bool, tuple[int, ...], int], int] | None = None
    """The dimension FSDP2 shards a parameter on: shard_dim(options, matrix, whole shape, shard size)
    (matrix: a hidden matrix, layout.is_matrix_param)
    (trainer/parallel.py asks before sharding: `shard_dims`). None = dim 0 for every parameter (FSDP2's
    default; its only uneven split). Dion shards the side of its Q factor (Dion Alg. 2)."""
    sends: str | None = None
    """What crosses the network where the optimizer, not the scheme, decides it (the scheme still
    carries it: its wire dtype and algorithm), for reports that say what each run sent; None = the
    scheme's own vector (its `wire`)."""


_OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec, *, replace: bool = False) -> OptimizerSpec:
    if spec.name in _OPTIMIZERS and not replace:
        raise ValueError(f"optimizer {spec.name!r} is already registered; pass replace=True to override it")
    _OPTIMIZERS[spec.name] = spec
    return spec


def get_optimizer(name: str) -> OptimizerSpec:
    if name not in _OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is unknown; valid names: {', '.join(_OPTIMIZERS)}")
    return _OPTIMIZERS[name]


def optimizer_names() -> list[str]:
    return list(_OPTIMIZERS)


def optimizers() -> list[OptimizerSpec]:
    return list(_OPTIMIZERS.values())


def compatibility_problem(name: str, mode: str, comm_options: sync.SchemeOptions | None = None) -> str | None:
    """Why optimizer `name` cannot run on scheme `mode`, or with these `comm_options` of it (None
    if it can)."""
    spec, scheme = get_optimizer(name), sync.get(mode)
    if accepts(spec, scheme):
        if comm_options is not None and spec.scheme_problems is not None \
                and isinstance(comm_options, scheme.options):
            problems = spec.scheme_problems(comm_options)
            return "; ".join(problems) if problems else None
        return None
    fits = [s.name for s in sync.schemes() if accepts(spec, s)]   # a local-update scheme's too (`accepts`)
    users = [o.name for o in optimizers() if accepts(o, scheme)]
    article = "an" if scheme.kind[0] in "aeiou" else "a"
    return (f"comm.mode: {mode} is {article} {scheme.kind}-sync scheme returning a {scheme.result}, and optim.name={name} "
            f"needs {spec.needs}: one of {', '.join(fits)}"
            + (f"; {mode} works with optim.name={' or '.join(users)}" if users else ""))


def run_problems(name: str, mode: str, comm_options: sync.SchemeOptions | None = None,
                 world_size: int | None = None, **run) -> list[str]:
    """Every problem of running optimizer `name` on comm.mode `mode`: whether the entry accepts the
    scheme (and its options), whether both run on shards (`run["shard_size"]` > 1), and the scheme's
    own `run_problems` at `world_size` with the `run` settings (bucket_mb, overlap, grad_clip,
    momentum_sync_every, shard_size). The config's validation and build_optimizer both ask this."""
    problem = compatibility_problem(name, mode, comm_options)
    if problem:
        return [problem]
    spec, scheme = get_optimizer(name), sync.get(mode)
    p = []
    S = run.get("shard_size", 1)
    if S > 1 and not spec.shards:
        fits = [o.name for o in optimizers() if o.shards]
        p.append(f"parallel.shard_size: {S} but optim.name={name} does not run on sharded parameters yet; use "
                 f"parallel.shard_size=1 or one of optim.name={', '.join(fits)}")
    if comm_options is not None:
        p += scheme.run_problems(comm_options, world_size, **run)
    return p


def shard_dims(name: str, optim_options: dict | OptimOptions | None, param_groups: list[dict],
               shard_size: int) -> dict[int, int]:
    """id(parameter) -> the dimension FSDP2 shards it on over `shard_size` ranks, as optimizer
    `name` declares (`OptimizerSpec.shard_dim`; 0 when it declares nothing), for the parameters of
    `param_groups` (whole tensors)."""
    spec = get_optimizer(name)
    if spec.shard_dim is None:
        return {id(p): 0 for g in param_groups for p in g["params"]}
    options = _options(spec.options, optim_options, "optim")
    return {id(p): int(spec.shard_dim(options, is_matrix_param(p, g), tuple(p.shape), shard_size))
            for g in param_groups for p in g["params"]}


def accepts(spec: OptimizerSpec, scheme: sync.SyncScheme) -> bool:
    """Whether optimizer `spec` runs on `scheme`: its own rule, and a local-update scheme (LOCAL,
    comm.mode=diloco) for every optimizer that runs on a gradient mean (its inner steps are its
    ordinary steps on the worker's own gradient, with nothing to average)."""
    if spec.accepts(scheme):
        return True
    return scheme.kind == sync.LOCAL and any(gradient_mean(s) and spec.accepts(s) for s in sync.schemes())


def gradient_mean(s: sync.SyncScheme) -> bool:
    """The scheme averages gradients (one shared state): what gradient optimizers accept."""
    return s.kind == sync.GRADIENT and s.result == sync.MEAN


@dataclass
class NoOptions(OptimOptions):
    """No options beyond the common optim.* keys."""


def optimizers_table() -> str:
    """The README's table of optimizers: one row per registered optimizer (`python -m optim`)."""
    rows = ["| `optim.name` | runs on `comm.mode` | optimizer state per parameter | options (`optim.*`) |",
            "|---|---|---|---|"]
    for spec in optimizers():
        modes = ", ".join(f"`{s.name}`" for s in sync.schemes() if accepts(spec, s))
        keys = ", ".join(f"`{k}`" for k in spec.options.field_names()) or "-"
        rows.append(f"| `{spec.name}` | {modes} | {spec.state} | {keys} |")
    return "\n".join(rows)


def plan_problems(name: str | None, **settings: Any) -> list[str]:
    """Every problem `resolve` would raise for these settings, as a list (the config's validation
    asks this; `comm_mode=None`: the mode is not resolved yet, e.g. comm.mode=auto, so only the
    other checks run). Run-time facts the config does not have (the placements of a sharded model)
    are not checked."""
    return _resolve(name, build=False, **settings)[1]


def resolve(name: str | None, **settings: Any) -> RunPlan:
    """Turn (optim, comm, parallel, world) into the run's frozen `RunPlan`, validated once: the
    entry's accepts and scheme problems, sharding, the scheme's run_problems at `world_size`, the
    entry's and the scheme's options, the common optim.* keys, momentum sync and comm.kernels. Raises
    one ValueError listing every problem, each naming its key. `name=None`: a class with no registry
    entry (only the scheme and the common keys are checked). Settings: comm_mode (a name or a
    SyncScheme), comm_options, optim_options, betas, eps, grad_clip, momentum_sync, world_size,
    shard_size, bucket_mb, overlap, kernels, fine_timing, shard_dims, and lr / weight_decay / beta1
    (checked when given)."""
    plan, problems = _resolve(name, build=True, **settings)
    if problems:
        raise ValueError("; ".join(problems))
    return plan


def _resolve(name: str | None, *, build: bool, comm_mode: str | sync.SyncScheme | None = "fp32",
             comm_options: dict | sync.SchemeOptions | None = None, optim_options: dict | OptimOptions | None = None,
             betas: Any = (0.9, 0.99), eps: float | None = 1e-8, grad_clip: float = 0.0, momentum_sync: Any = None,
             world_size: int | None = 1, shard_size: int = 1, bucket_mb: float = 0.0, overlap: bool = False,
             kernels: str | None = "eager", fine_timing: bool = True, shard_dims: dict[int, int] | None = None,
             lr: float | None = None, weight_decay: float | None = None,
             beta1: float | None = None) -> tuple[RunPlan | None, list[str]]:
    p: list[str] = []
    spec = scheme = scheme_options = options = None
    if name is not None:
        try:
            spec = get_optimizer(name)
        except ValueError as e:
            p.append(str(e))
    if isinstance(comm_mode, sync.SyncScheme):
        scheme = comm_mode
    elif comm_mode is not None:
        try:
            scheme = sync.get(comm_mode)
        except ValueError as e:
            p.append(str(e))
    if scheme is not None:
        scheme_options = _parse(scheme.options, comm_options, "comm", p)
    if spec is not None:
        options = _parse(spec.options, optim_options, "optim", p)
        if options is not None:
            p += options.problems(world_size)
    elif isinstance(optim_options, OptimOptions):  # the config's options of an unknown name
        p += optim_options.problems(world_size)
    try:
        ms = MomentumSync.of(momentum_sync)
    except TypeError as e:
        ms = None
        p.append(f"comm.momentum_sync: {e}; its keys are every, layers, start, stop")
    every = ms.every if ms is not None else 0
    if scheme is not None:
        if scheme_options is None:  # its options did not parse: whether the pair fits can still be said
            problem = compatibility_problem(name, scheme.name) if spec is not None else None
            p += [problem] if problem else []
        else:
            run = dict(bucket_mb=bucket_mb, overlap=overlap, grad_clip=grad_clip, momentum_sync_every=every,
                       shard_size=shard_size)
            p += run_problems(name, scheme.name, scheme_options, world_size, **run) if spec is not None else \
                scheme.run_problems(scheme_options, world_size, **run)
    p += common_problems(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grad_clip=grad_clip, beta1=beta1)
    if ms is not None:
        p += ms.problems()
    if kernels is not None:
        choice(p, "comm.kernels", kernels, _kernels.IMPLS)
    if build and spec is not None:
        if spec.shard_dim is not None:  # it asked for its placements: it is told what they are
            if shard_size > 1 and shard_dims is None:
                p.append(f"optim.name={name} on a sharded model needs the placements it asked for: shard the model "
                         f"with optim.shard_dims and pass shard_dims (trainer.parallel.local_dims)")
        elif any((shard_dims or {}).values()):
            p.append(f"optim.name={name} runs on dim-0 shards only; shard the model with optim.shard_dims")
    if p or not build:
        return None, p
    return RunPlan(optimizer=name, scheme=scheme, scheme_options=scheme_options, optim_options=options,
                   betas=tuple(betas) if betas is not None else None, eps=eps, grad_clip=float(grad_clip),
                   momentum_sync=ms if ms is not None and ms.every > 0 else None, bucket_bytes=bucket_mb * 2 ** 20,
                   overlap=bool(overlap), kernels=kernels, fine_timing=bool(fine_timing), world_size=int(world_size),
                   shard_size=int(shard_size), shard_dims=types.MappingProxyType(dict(shard_dims or {}))), []


def build_optimizer(name: str, param_groups: list[dict], *, betas: tuple[float, float] = (0.9, 0.99),
                    eps: float = 1e-8, comm_mode: str = "fp32", comm_options: dict | sync.SchemeOptions | None = None,
                    optim_options: dict | OptimOptions | None = None, momentum_sync: Any = None,
                    grad_clip: float = 0.0, group=None,
                    param_order: list[torch.nn.Parameter] | None = None, kernels: str = "eager",
                    fine_timing: bool = True, bucket_mb: float = 0.0, overlap: bool = False,
                    shard_group=None, shard_dims: dict[int, int] | None = None) -> torch.optim.Optimizer:
    """Build optimizer `name` for `param_groups` (dicts with params, names, role, lr, weight_decay,
    lr_mult; optionally layers) on sync scheme `comm_mode`. Raises ValueError naming the bad value
    and the valid ones. `param_order` (the model's parameter order) fixes the flat gradient layout.
    With hybrid sharding the parameters are local shards, `group` the replicate group and
    `shard_group` the group holding the other shards (its optimizer must declare `shards`), and
    `shard_dims` maps id(local parameter) to the dimension its model parameter is sharded on (the
    placements `shard_dims()` chose; absent: 0). `momentum_sync`: a dict of comm.momentum_sync keys or
    an optim.plan.MomentumSync. Resolves the run's plan (`resolve`) and hands it to the entry's build;
    returns the entry's CommOptimizer (optim/base.py)."""
    plan = resolve(name, comm_mode=comm_mode, comm_options=comm_options, optim_options=optim_options, betas=betas,
                   eps=eps, grad_clip=grad_clip, momentum_sync=momentum_sync, world_size=comm.world(group)[0],
                   shard_size=comm.world(shard_group)[0] if shard_group is not None else 1, bucket_mb=bucket_mb,
                   overlap=overlap, kernels=kernels, fine_timing=fine_timing,
                   shard_dims=shard_dims)
    return build_from_plan(plan, param_groups, group=group, param_order=param_order, shard_group=shard_group)


def build_from_plan(plan: RunPlan, param_groups: list[dict], *, group=None,
                    param_order: list[torch.nn.Parameter] | None = None, shard_group=None) -> torch.optim.Optimizer:
    """The entry's optimizer for a resolved `plan` over `param_groups`, on the run's process groups."""
    for g in param_groups:
        for key in ("params", "lr", "weight_decay"):
            if key not in g:
                raise ValueError(f"param group {g.get('role', '?')!r} lacks {key!r}; every group needs "
                                 "params, names, role, lr, weight_decay, lr_mult")
    return get_optimizer(plan.optimizer).build(param_groups, plan=plan, group=group, param_order=param_order,
                                               shard_group=shard_group)


def _parse(cls, given, section: str, problems: list[str]):
    """`given` (a dict of keys or an instance) as an instance of options class `cls`; None (with the
    problem appended) when it names unknown keys."""
    if isinstance(given, cls):
        return given
    given = dict(given or {})
    unknown = sorted(set(given) - set(cls.field_names()))
    if unknown:
        problems.append(f"unknown {section} options {unknown}; valid keys: {cls.field_names()}")
        return None
    return cls(**given)


def _options(cls, given, section: str):
    if isinstance(given, cls):
        return given
    given = dict(given or {})
    unknown = sorted(set(given) - set(cls.field_names()))
    if unknown:
        raise ValueError(f"unknown {section} options {unknown}; valid keys: {cls.field_names()}")
    opts = cls(**given)
    problems = opts.problems(None)
    if problems:
        raise ValueError("; ".join(problems))
    return opts
