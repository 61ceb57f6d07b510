"""The model of a sharded run (parallel.shard_size > 1) in a checkpoint, through
torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the model into `<step>/model/` (DCP's `__<rank>_<i>.distcp`
files, rank 0 also `.metadata`) in parallel; DCP writes each model shard once although every replica
holds it (the replicas' shards are bit-identical). Each rank returns the sha256 of the files it
wrote, so meta.json (trainer/checkpoint.py) lists every file with its checksum, the resume verifies
them (each rank its share, all ranks agree) and falls back to the previous intact checkpoint.

The optimizer state is not in here: every rank's file (rank_*.pt) holds its own shards' state,
momenta and error feedback included, which differ across replicas and are never deduplicated.

Loading: `.metadata` is read by model/dcp_metadata.py (an allow-list of DCP's own metadata types,
never DCP's unrestricted unpickling) and handed to DCP, which fills the model's DTensors from whichever files
hold their shards (so the model part
would load at another mesh as well); a replicated checkpoint's model.pt loads into a sharded
model (`parallel.load_full_state_dict`)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from optim.base import StateMean

from . import parallel
from .checkpoint import CheckpointError, NonFiniteError, _agree, nonfinite_keys, read_meta, sha256_file

MODEL_DIR = "model"


def _model_state(model: torch.nn.Module) -> dict:
    """{"model": state dict} with a weight shared by two names (the tied embedding / head) once:
    DCP would write it under both names."""
    parallel.reshard(model)
    out, seen = {}, set()
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in seen:
            seen.add(id(v))
            out[k] = v.detach()
    return {"model": out}


def check_finite(model: torch.nn.Module, step: int) -> None:
    """Every rank checks its local shards; all agree; NonFiniteError when any holds NaN / inf."""
    local = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in model.state_dict().items()}
    bad = nonfinite_keys(local, "model")
    if _agree(bool(bad)):
        raise NonFiniteError(f"refusing to save checkpoint step {step}: non-finite values in "
                             f"{', '.join(bad[:5]) or 'another rank'}; the last good checkpoint is kept")


def writer(model: torch.nn.Module, rank: int):
    """The `write_sharded` callback of checkpoint.save_checkpoint: DCP-save the model into
    tmp/model and return {model/<file>: sha256} of the files this rank wrote."""

    def write(tmp: Path) -> dict[str, str]:
        import torch.distributed.checkpoint as dcp

        out = tmp / MODEL_DIR
        dcp.save(_model_state(model), storage_writer=dcp.FileSystemWriter(str(out), sync_files=True))
        # .metadata is written by the coordinator (rank 0) after every rank's files
        mine = [f for f in out.iterdir() if f.name.startswith(f"__{rank}_") or (rank == 0 and f.name == ".metadata")]
        return {f"{MODEL_DIR}/{f.name}": sha256_file(f) for f in sorted(mine)}

    return write


def load_model(model: torch.nn.Module, path: Path) -> None:
    """Fill the sharded model from checkpoint `path`'s DCP files (collective)."""
    import torch.distributed.checkpoint as dcp

    from model.dcp_metadata import MetadataError, SafeReader, read_metadata

    listed = [n[len(MODEL_DIR) + 1:] for n in read_meta(path).get("files", {}) if n.startswith(MODEL_DIR + "/")]
    try:  # never DCP's own reader: it unpickles .metadata without restriction (model/dcp_metadata.py)
        md = read_metadata(path / MODEL_DIR, listed)
    except MetadataError as e:
        raise CheckpointError(str(e)) from None
    state = _model_state(model)
    dcp.load(state, storage_reader=SafeReader(path / MODEL_DIR, md))
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    tied = set(model.state_dict()) - set(state["model"])
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint {path}: model keys missing {sorted(set(missing) - tied)}, unexpected {unexpected}")


def load_full_model(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A whole (replicated run's model.pt) state into the model, sharded or not: every rank keeps
    its own chunk of each tensor along the dimension the tensor is sharded on."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"model state lacks {missing}")
    with torch.no_grad():
        for k, v in own.items():
            if hasattr(v, "to_local"):
                mesh = v.device_mesh
                v.to_local().copy_(_chunk(state[k], mesh.size(), mesh.get_local_rank(), v.placements[0].dim))
            else:
                v.copy_(state[k])


def _per_param(opt_state: dict, exchange=None) -> list[tuple[dict, list[str]]]:
    """Every torch-style {"state": {index: {key: tensor}}} part of an optimizer state with its path
    (the optimizer's own, and the torch optimizer inside it: optim/adamw.py, the matrix optimizers'
    AdamW), or ValueError when the state holds anything a mesh change cannot map (flat-layout
    vectors, exchange state)."""
    nodes = [(opt_state, [])] if "state" in opt_state else []
    if "inner" in opt_state:
        nodes.append((opt_state["inner"], ["inner"]))
    extra = sorted(set(opt_state) - {"state", "param_groups", "comm", "inner", "shard_dims"})
    saved = (opt_state.get("comm") or {}).get("exchange")
    if saved and not extra and not getattr(exchange, "remaps_state", False):
        raise ValueError(f"its comm.mode's exchange{' ' + type(exchange).__name__ if exchange is not None else ''} "
                         f"keeps per-rank state sized for the saved mesh ({', '.join(sorted(saved))}: error "
                         f"feedback, or a local-update scheme's outer state and workers)")
    if extra:
        raise ValueError(f"its optimizer state holds {extra}, which is laid out over the saved mesh's flat vector")
    if not nodes or any("state" not in node for node, _ in nodes):
        raise ValueError("its optimizer state has no per-parameter ('state') entry to remap")
    return nodes


def _chunk(t: torch.Tensor, shards: int, index: int, dim: int = 0) -> torch.Tensor:
    """FSDP2's chunk `index` of `shards` along `dim` (ceil(size / shards) each; trailing ones may be empty)."""
    chunk = -(-t.shape[dim] // shards)
    start = min(index * chunk, t.shape[dim])
    return t.narrow(dim, start, min(chunk, t.shape[dim] - start))


def remesh_optimizer_state(states: Sequence[dict], saved_shard: int, shard: int, replicas: int, replica: int,
                           shard_index: int, group_rank: int, dims: dict | None = None, exchange=None) -> dict:
    """This rank's optimizer state on a new mesh, from every rank's saved state (`states`, old rank
    order, `saved_shard` ranks per model copy). Per-parameter tensors are joined into each old
    replica's whole tensors along the dimension the saved state names for them (its "shard_dims":
    {index: {key: dim or None}}, None = whole on every shard rank; unlisted: dim 0, FSDP2's default);
    with as many replicas as before, replica r takes old replica r's state exactly (and reads no
    other replica's ranks); otherwise every per-replica tensor is the mean over the old replicas (one
    momentum synchronisation, as `CommOptimizer.load_resharded` does for a world-size change),
    folded one old replica at a time (StateMean). Then this rank's chunk is cut along the dimension
    `dims` names (the new optimizer's state_shard_dims, same form). Scalars (step counts) are kept.
    ValueError for state that is not per parameter.

    The exchange's own per-rank state (comm.exchange) is refused, unless this run's `exchange` remaps
    it (Exchange.remaps_state: pbit's generator), which then gives this rank's (Exchange.reshard_state
    of the saved ones this rank read: its old replica's ranks, or every old rank when the replica count
    changes), as CommOptimizer.load_resharded does with every old rank's for a world-size change.

    `states` is indexed, never iterated whole: a sequence that loads rank q's file when `states[q]`
    is read (trainer/state.py) holds about one old replica's state and the running mean at a time."""
    old_replicas = len(states) // saved_shard
    dims = dims or {}
    read_exchanges: list[dict] = []  # the saved exchange states of every rank read, in rank order

    def replica_whole(r: int) -> tuple[dict, list[dict]]:
        """Old replica r: rank r * saved_shard's state (its scalars, param_groups) and, per
        torch-style node of it (`_per_param`), {index: {key: whole tensor}}."""
        group = [states[r * saved_shard + k] for k in range(saved_shard)]
        parts = [_per_param(g, exchange) for g in group]
        read_exchanges.extend((g.get("comm") or {}).get("exchange") or {} for g in group)
        saved_dims = group[0].get("shard_dims") or {}  # the same on every rank of the replica
        wholes = []
        for j, (_, path) in enumerate(parts[0]):
            nodes = [p[j][0]["state"] for p in parts]
            joined = {}
            for i, st in nodes[0].items():
                joined[i] = {}
                for key, v in st.items():
                    d = 0 if path else saved_dims.get(i, {}).get(key, 0)
                    if torch.is_tensor(v) and v.ndim and d is not None:
                        v = torch.cat([n[i][key] for n in nodes], dim=d)
                    joined[i][key] = v
            wholes.append(joined)
        return group[0], wholes

    if old_replicas == replicas:
        first, mine = replica_whole(replica)
    else:
        first, means = None, None
        for r in range(old_replicas):
            head, wholes = replica_whole(r)
            if means is None:
                first, means = head, [StateMean() for _ in wholes]
            for mean, whole in zip(means, wholes):
                mean.add(whole)  # per-replica state (Dion's M) meaned, state equal everywhere kept
            del head, wholes
        mine = [mean.result() for mean in means]
    out = dict(first)
    for (base, path), whole in zip(_per_param(first, exchange), mine):
        def cut(i: int, key: str, v):
            if not (torch.is_tensor(v) and v.ndim):
                return v
            d = 0 if path else dims.get(i, {}).get(key, 0)
            return v.clone() if d is None else _chunk(v, shard, shard_index, d).clone()

        local = {i: {key: cut(i, key, v) for key, v in st.items()} for i, st in whole.items()}
        node = {**base, "state": local}
        if path:
            out[path[0]] = node
        else:
            out.update(node)
    out.pop("shard_dims", None)  # the saved mesh's layout
    comm = dict(out.get("comm") or {})
    comm.update(world_size=replicas, rank=group_rank,
                exchange=exchange.reshard_state(read_exchanges) if any(read_exchanges) else {})
    out["comm"] = comm
    return out


__all__ = ["MODEL_DIR", "check_finite", "load_full_model", "load_model", "remesh_optimizer_state", "writer"]
