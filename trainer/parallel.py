"""Hybrid sharding (`parallel.shard_size` = S > 1): FSDP2 inside a group of S ranks over the fast
links, the optimizer's sync scheme across the R = world / S replicas over the slow ones (the
setting of Dion §1 and LoCo's abstract; Lion Cub's vote is what crosses between replicas).

- The mesh: a 2-D DeviceMesh (replicate = R, shard = S), row-major, so a shard group is S
  consecutive ranks (one node's, LOCAL_WORLD_SIZE) and a replicate group holds the ranks with the
  same shard index on every group.
- The model: every transformer block and then the root are `fully_shard`ed over the 1-D shard
  sub-mesh, each parameter on the dimension its optimizer declares (optim.registry `shard_dims`:
  dim 0 unless the optimizer says otherwise; Dion puts the side of its Q factor there), so FSDP
  all-gathers parameters for forward/backward and reduce-scatters gradients (their mean over the
  shard group) inside the group only; FSDP runs no all-reduce across replicas.
- The optimizer sees local shards: for every DTensor parameter p a plain Parameter aliasing
  p's local tensor (same storage, so an in-place update is the update of p's shard). The
  optimizer's flat gradient buffer is built over these aliases (optim/layout.py attach_flat_grads),
  and p.grad is set once to a DTensor whose local tensor is that buffer's view, so FSDP's
  reduce-scatter accumulates straight into the flat buffer. The optimizer's process group is the
  replicate group (its exchange runs across replicas on N / S elements); its `shard_group` makes
  the per-tensor reductions (gradient norm for clipping, the divergence guard) global.

S = 1 builds nothing here: the trainer runs exactly as before.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from optim import shard_dims
from optim.base import digest

from .config import ConfigError
from .param_groups import param_groups


@dataclass
class Parallel:
    """The mesh of a run: shard_size ranks per model copy, `replicas` copies."""

    shard_size: int = 1
    replicas: int = 1
    mesh: Any = None
    """The 2-D DeviceMesh (replicate, shard); None when replicated (S = 1)."""
    replicate_group: Any = None
    """The optimizer's process group (None = the world, S = 1)."""
    shard_group: Any = None

    @property
    def sharded(self) -> bool:
        return self.shard_size > 1

    @property
    def shard_mesh(self):
        return self.mesh["shard"]

    def describe(self) -> str:
        """The mesh in the console's words: '' when replicated, else '2 x 4 (replicas x shard size)'."""
        return f"{self.replicas} x {self.shard_size} (replicas x shard size)" if self.sharded else ""


def make_mesh(shard_size: int, world_size: int, device: torch.device) -> Parallel:
    """The Parallel of `parallel.shard_size` at this world size (a ConfigError when it does not fit)."""
    S = int(shard_size)
    if S <= 1:
        return Parallel(1, world_size)
    if world_size % S:
        raise ConfigError(f"parallel.shard_size: {S} does not divide the world size {world_size}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local % S:
        raise ConfigError(f"parallel.shard_size: {S} does not divide the ranks per node (LOCAL_WORLD_SIZE={local}); "
                          f"a shard group must share a node's fast links: choose a divisor of {local}")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size // S, S), mesh_dim_names=("replicate", "shard"))
    return Parallel(S, world_size // S, mesh, mesh.get_group("replicate"), mesh.get_group("shard"))


def shard_model(model: torch.nn.Module, par: Parallel, dims: dict[int, int] | None = None) -> None:
    """fully_shard every transformer block, then the root (embedding, final norm, head), over the
    shard sub-mesh; `dims`: id(parameter) -> the dimension to shard it on (optim.shard_dims; absent:
    0). FSDP2 splits a dimension other than 0 only evenly, which the optimizers' rules respect."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    dims = dims or {}

    def placement(p: torch.nn.Parameter) -> Shard:
        return Shard(dims.get(id(p), 0))

    for block in model.transformer.h:
        fully_shard(block, mesh=par.shard_mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=par.shard_mesh, shard_placement_fn=placement)


def local_aliases(model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """id(DTensor parameter) -> a plain Parameter over the same storage as its local shard."""
    with torch.no_grad():
        return {id(p): torch.nn.Parameter(p.to_local(), requires_grad=True) for p in model.parameters()}


def local_dims(model: torch.nn.Module, aliases: dict[int, torch.nn.Parameter]) -> dict[int, int]:
    """id(alias) -> the dimension its DTensor parameter is sharded on (for build_optimizer)."""
    return {id(aliases[id(p)]): p.placements[0].dim for p in model.parameters()}


def localize_groups(groups: list[dict], aliases: dict[int, torch.nn.Parameter]) -> list[dict]:
    """Parameter groups (trainer/param_groups.py) with every parameter replaced by its local alias."""
    return [{**g, "params": [aliases[id(p)] for p in g["params"]]} for g in groups]


def route_grads(model: torch.nn.Module, aliases: dict[int, torch.nn.Parameter]) -> None:
    """Point every DTensor parameter's .grad at its alias's gradient view (a slice of the
    optimizer's flat buffer), so FSDP's reduce-scatter accumulates into the flat buffer in place."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        local = aliases[id(p)]
        if local.grad is None:
            raise RuntimeError("route_grads: build the optimizer (it attaches the flat gradient views) first")
        p.grad = DTensor.from_local(local.grad, device_mesh=p.device_mesh, placements=p.placements,
                                    run_check=False, shape=p.shape, stride=p.stride())


def grads_routed(model: torch.nn.Module, aliases: dict[int, torch.nn.Parameter]) -> bool:
    """Every DTensor parameter's gradient still writes into its alias's view (nothing replaced it)."""
    return all(p.grad is not None and p.grad.to_local().data_ptr() == aliases[id(p)].grad.data_ptr()
               for p in model.parameters() if aliases[id(p)].numel())


def reshard(model: torch.nn.Module) -> None:
    """Back to sharded parameters after a forward without backward (evaluation leaves the root's
    parameters gathered; the optimizer's aliases are the shards)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


__all__ = ["Parallel", "grads_routed", "local_aliases", "local_dims",
           "localize_groups", "make_mesh", "reshard", "route_grads", "shard_model"]


def place(model: torch.nn.Module, par: Parallel, optim_cfg) -> tuple[list[dict], list, dict | None, dict | None]:
    """What the optimizer is built over on mesh `par`: (param groups, parameters in model order,
    id(whole parameter) -> its local alias, id(alias) -> the dimension it is sharded on). Replicated:
    the model's own parameters, None, None. Sharded: the model is sharded first, each parameter on the
    dimension its optimizer asks for (Dion: its Q side), and the groups hold the local aliases."""
    groups, order = param_groups(model, optim_cfg), list(model.parameters())
    if not par.sharded:
        return groups, order, None, None
    shard_model(model, par, shard_dims(optim_cfg.name, optim_cfg.options, groups, par.shard_size))
    aliases = local_aliases(model)
    return (localize_groups(param_groups(model, optim_cfg), aliases), [aliases[id(p)] for p in model.parameters()],
            aliases, local_dims(model, aliases))


def param_digests(model: torch.nn.Module, par: Parallel, world_size: int) -> list[str]:
    """sha256 of each rank's parameters, gathered from every rank (the invariant: all equal). Sharded,
    of the whole tensors (gathered in the shard group): equal iff the replicas are."""
    out = [None] * world_size
    params = (p for _, p in sorted(model.named_parameters()))
    if par.sharded:
        reshard(model)
        params = [p.full_tensor() for p in params]
    dist.all_gather_object(out, digest(params))
    return out
