"""Process-group helpers shared by the collectives: sizes, rank maps, cached node subgroups."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

_NODE_GROUPS: dict[tuple, tuple] = {}

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn on every call);
# the collectives call these, which keep older torch working. Same arguments: (output, input, group=...).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world(group) -> tuple[int, int]:
    """(size, rank) of `group`; (1, 0) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was passed but torch.distributed is not initialised")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def global_rank(group, r: int) -> int:
    """Global rank of group rank r (P2P calls address peers by global rank)."""
    if group is None or group is dist.group.WORLD:
        return r
    return dist.get_global_rank(group, r)


def resolve_node_size(node_size: int | None, P: int) -> int:
    """node_size, or LOCAL_WORLD_SIZE from the launcher, or P (one node); must divide P."""
    if node_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        node_size = int(env) if env else P
    if node_size < 1 or P % node_size:
        raise ValueError(f"hierarchical_sign_vote: node_size={node_size} must be >= 1 and divide "
                         f"the world size {P}; set comm.node_size to the ranks per node")
    return node_size


def node_groups(group, node_size: int) -> tuple:
    """(intra, inter) subgroups of this rank for contiguous nodes of `node_size` ranks.

    intra = the ranks of my node; inter = the ranks with my local index on every node (BinSGDM
    §4 step iii runs the 1-bit allreduce among those). None where the group would be a single
    rank. Created once per (group, node_size) with group-local synchronisation, so only member
    ranks take part, and cached."""
    P, rank = world(group)
    key = (group if group is not None else dist.group.WORLD, node_size)
    if key not in _NODE_GROUPS:
        m, k = node_size, P // node_size
        ranks = [global_rank(group, r) for r in range(P)]
        node, local = divmod(rank, m)
        intra = _subgroup([ranks[node * m + j] for j in range(m)], group, ranks) if m > 1 else None
        inter = _subgroup([ranks[i * m + local] for i in range(k)], group, ranks) if k > 1 else None
        _NODE_GROUPS[key] = (intra, inter)
    return _NODE_GROUPS[key]


_BY_RANKS: dict[tuple[int, ...], object] = {}


def _subgroup(members: list[int], group, all_ranks: list[int]):
    """One process group per set of global ranks: the parent itself when it has the same
    members, else a cached new group (groups made with local synchronisation are named by a
    hash of their ranks, so two groups over the same ranks must not be created)."""
    if members == all_ranks:
        return group
    key = tuple(members)
    if key not in _BY_RANKS:
        _BY_RANKS[key] = dist.new_group(members, use_local_synchronization=True)
    return _BY_RANKS[key]


def device_of(t: torch.Tensor) -> torch.device | None:
    """Device to synchronise before reading timers (only CUDA needs it)."""
    return t.device if t.device.type == "cuda" else None
