"""The run's optimizer plan: every setting of (optim, comm, parallel, world) an optimizer needs,
resolved and validated once, frozen.

`optim.registry.resolve(...)` builds a `RunPlan` (and `optim.registry.plan_problems(...)`, its
problems-only twin, is what the config's validation asks); `build_optimizer` hands the plan to the
registry entry's build, and `CommOptimizer.__init__` reads it without checking it again. What is
not in the plan is what only exists at run time: the process groups, the parameters and their
order.

This module holds the data only (no registry lookup), so the base can name the type without
importing the registry's table.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import sync
from .options import Options
from .strategy import strategy_for


@dataclass(frozen=True)
class MomentumSync:
    """Lion Cub §5: mean-allreduce (fp32, one flat buffer) the momenta of the selected roles after
    the momentum update of every step t with t % every == 0 and start <= t (<= stop unless 0)."""

    every: int = 0
    layers: tuple = ("all",)
    start: int = 0
    stop: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))

    def due(self, t: int) -> bool:
        if self.every <= 0 or t < self.start or (self.stop and t > self.stop):
            return False
        return t % self.every == 0

    def selects(self, role: str) -> bool:
        return "all" in self.layers or role in self.layers

    def problems(self) -> list[str]:
        """The schedule's own rules (which roles exist is the layout's to say, at build time)."""
        p = []
        if self.every < 0 or self.start < 0 or self.stop < 0:
            p.append("comm.momentum_sync: every, start and stop must be >= 0")
        if self.stop and self.start > self.stop:
            p.append(f"comm.momentum_sync: start={self.start} is after stop={self.stop}; no sync would run")
        if self.every and not self.layers:
            p.append("comm.momentum_sync.layers: empty; select layers (e.g. [head]) or set every: 0")
        return p

    @classmethod
    def of(cls, given: Any) -> "MomentumSync | None":
        """A MomentumSync from a dict of comm.momentum_sync keys, an object with those attributes,
        or None (no momentum sync)."""
        if given is None or isinstance(given, cls):
            return given
        if not isinstance(given, Mapping):
            given = {k: getattr(given, k) for k in ("every", "layers", "start", "stop") if hasattr(given, k)}
        return cls(**given)


@dataclass(frozen=True)
class RunPlan:
    """One run's optimizer settings after validation (see the module docstring)."""

    optimizer: str | None
    """The registry entry (optim.name); None for a class with no entry, checked by its scheme alone."""
    scheme: sync.SyncScheme
    scheme_options: sync.SchemeOptions
    optim_options: Options | None = None
    """The entry's extra optim.* options (None: a class built directly takes its own keywords)."""
    betas: tuple = (0.9, 0.99)
    eps: float = 1e-8
    grad_clip: float = 0.0
    momentum_sync: MomentumSync | None = None
    """None when it never runs (every = 0)."""
    bucket_bytes: float = 0.0
    overlap: bool = False
    kernels: str = "eager"
    fine_timing: bool = True
    world_size: int = 1
    """Ranks that exchange (the replicate group under hybrid sharding)."""
    shard_size: int = 1
    shard_dims: Mapping[int, int] = field(default_factory=lambda: types.MappingProxyType({}))
    """id(local parameter) -> the dimension its model parameter is sharded on (optimizers that
    declare `shard_dim`); read-only."""

    @property
    def bucket_mb(self) -> float:
        return self.bucket_bytes / 2 ** 20

    @property
    def strategy(self):
        """The strategy class of the scheme's kind (optim.strategy): what a step exchanges and when."""
        return strategy_for(self.scheme)


__all__ = ["MomentumSync", "RunPlan"]
