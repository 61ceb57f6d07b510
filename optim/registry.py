"""The registry of optimizers (`optim.name`): how a name becomes an optimizer on a sync scheme.

An entry declares its extra options (a dataclass of `optim.*` keys beyond the common ones),
which sync schemes it can run on, and its build function. `build_optimizer` is the one place the
trainer and the benchmarks turn (optim.name, comm.mode, options) into an optimizer.

Every optimizer module registers its own entry at its end (`register_optimizer(OptimizerSpec(...))`:
adamw.py, lioncub.py for "lion", muon.py, ...); this module imports none of them, and the base
(optim/base.py) asks it for an entry's rules, so the dependencies run one way: optimizer module ->
base -> registry -> sync. `optim/__init__.py` imports every optimizer module, so the table is full
once `optim` is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

import comm

from . import sync
from .layout import is_matrix_param
from .options import Options


@dataclass
class OptimOptions(Options):
    """Options of an optimizer beyond the common optim.* keys; keys live in the `optim` section."""

    section = "optim"


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    options: type[OptimOptions]
    build: Callable[..., torch.optim.Optimizer]
    """build(param_groups, *, betas, eps, options, **comm_kwargs) -> the entry's CommOptimizer."""
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
    if spec.accepts(scheme):
        if comm_options is not None and spec.scheme_problems is not None \
                and isinstance(comm_options, scheme.options):
            problems = spec.scheme_problems(comm_options)
            return "; ".join(problems) if problems else None
        return None
    fits = [s.name for s in sync.schemes() if spec.accepts(s)]
    users = [o.name for o in optimizers() if o.accepts(scheme)]
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
        modes = ", ".join(f"`{s.name}`" for s in sync.schemes() if spec.accepts(s))
        keys = ", ".join(f"`{k}`" for k in spec.options.field_names()) or "-"
        rows.append(f"| `{spec.name}` | {modes} | {spec.state} | {keys} |")
    return "\n".join(rows)


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
    an optim.base.MomentumSync. Returns the entry's CommOptimizer (optim/base.py)."""
    spec = get_optimizer(name)
    scheme = sync.get(comm_mode)
    problem = compatibility_problem(name, comm_mode)
    if problem:
        raise ValueError(problem)
    scheme_options = _options(scheme.options, comm_options, "comm")
    every = momentum_sync.get("every", 0) if isinstance(momentum_sync, dict) else getattr(momentum_sync, "every", 0)
    problems = run_problems(name, comm_mode, scheme_options, comm.world(group)[0], bucket_mb=bucket_mb,
                            overlap=overlap, grad_clip=grad_clip, momentum_sync_every=every,
                            shard_size=comm.world(shard_group)[0] if shard_group is not None else 1)
    if problems:
        raise ValueError("; ".join(problems))
    options = _options(spec.options, optim_options, "optim")
    extra = {"shard_group": shard_group} if shard_group is not None else {}
    if spec.shard_dim is not None:  # it asked for its placements: it is told what they are
        if shard_group is not None and shard_dims is None:
            raise ValueError(f"optim.name={name} on a sharded model needs the placements it asked for: shard the "
                             f"model with optim.shard_dims and pass shard_dims (trainer.parallel.local_dims)")
        extra["shard_dims"] = dict(shard_dims or {})
    elif any((shard_dims or {}).values()):
        raise ValueError(f"optim.name={name} runs on dim-0 shards only; shard the model with optim.shard_dims")
    for g in param_groups:
        for key in ("params", "lr", "weight_decay"):
            if key not in g:
                raise ValueError(f"param group {g.get('role', '?')!r} lacks {key!r}; every group needs "
                                 "params, names, role, lr, weight_decay, lr_mult")
    return spec.build(param_groups, betas=tuple(betas), eps=eps, options=options, scheme=scheme,
                      scheme_options=scheme_options, group=group, grad_clip=grad_clip, momentum_sync=momentum_sync,
                      param_order=param_order, kernels=kernels, fine_timing=fine_timing, bucket_mb=bucket_mb,
                      overlap=overlap, **extra)


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
