"""The model of a sharded run (parallel.shard_size > 1) in a checkpoint, through
torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the model into `<step>/model/` (DCP's `__<rank>_<i>.distcp`
files, rank 0 also `.metadata`) in parallel; DCP writes each model shard once although every replica
holds it (the replicas' shards are bit-identical). Each rank returns the sha256 of the files it
wrote, so meta.json (trainer/checkpoint.py) lists every file with its checksum, the resume verifies
them (each rank its share, all ranks agree) and falls back to the previous intact checkpoint.

The optimizer state is not in here: every rank's file (rank_*.pt) holds its own shards' state,
momenta and error feedback included, which differ across replicas and are never deduplicated.

Loading: DCP fills the model's DTensors from whichever files hold their shards (so the model part
would load at another mesh as well); a replicated checkpoint's model.pt loads into a sharded
model (`parallel.load_full_state_dict`)."""
from __future__ import annotations

from pathlib import Path

import torch

from . import parallel
from .checkpoint import NonFiniteError, _agree, nonfinite_keys, sha256_file

MODEL_DIR = "model"


def _model_state(model: torch.nn.Module) -> dict:
    parallel.reshard(model)
    return {"model": model.state_dict()}


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

    state = _model_state(model)
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path / MODEL_DIR)))
    model.load_state_dict(state["model"])


__all__ = ["MODEL_DIR", "check_finite", "load_model", "writer"]
