"""Checkpoints: one directory per step, written atomically, verified on resume.

Layout: ckpt/step_000100/{model.pt, rank_00000.pt, ..., meta.json}. The model is identical on all
ranks and saved once; every rank saves its own optimizer state (update-sync optimizers keep a
different momentum per rank), data-loader state and RNG states. Ranks write into a hidden temp
directory; every file's sha256 is taken from the bytes written, and rank 0 writes meta.json LAST
with every file's checksum. After a barrier rank 0 renames the directory into place and rewrites
`latest` (temp + rename), so a save killed half-way never touches the last good checkpoint.

Nothing non-finite is ever saved: before a save every rank checks its model and optimizer
tensors, all ranks agree, and a non-finite value stops the save with a NonFiniteError. Rotation
(`keep`) deletes the oldest step directories but never the new one, and never the newest
checkpoint whose meta says it was verified finite.

On resume and rollback (`find_resumable`) candidates are tried newest first: each rank checks
meta.json (which must list every file in the directory) and the checksums of the files it will
read and loads them as model/checkpoint_files.py says (weights_only: a pickle that names code is
refused, never run; a sharded model's DCP metadata through model/dcp_metadata.py's allow-list;
finite); all ranks agree; a
corrupt, incomplete or foreign checkpoint is reported by name and the next older one is tried.
RNG states are stored as tensors and plain numbers so that a weights_only load reads them. Leftover temp directories of killed saves are
removed at start (`clean_partial`). A full disk is reported as such (CheckpointError).
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

# the reading rule (checksums, weights_only loads, finiteness) has one home, shared with model/load.py
from model.checkpoint_files import (META, MODEL, CheckpointError, candidates, check_sharded_metadata, load_verified,
                                    nonfinite_keys, read_meta, sha256_file, step_dirs, verify)
from util import atomic_write, replace_dir

__all__ = ["META", "MODEL", "CheckpointError", "NonFiniteError", "candidates", "find_resumable", "read_meta",
           "save_checkpoint", "sha256_file", "step_dirs", "verify"]


class NonFiniteError(CheckpointError):
    """The state to save holds NaN or inf."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def rng_state() -> dict:
    """Every generator's state as tensors and plain numbers (what a weights_only load reads back)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    if isinstance(npst, dict):
        npst = (npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                npst["cached_gaussian"])
    np.random.set_state(npst)  # a tuple holding an ndarray: a checkpoint of an older version
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _disk_error(path: Path, err: BaseException) -> CheckpointError:
    try:
        free = shutil.disk_usage(path if path.exists() else path.parent).free
    except OSError:
        free = -1
    full = (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or (0 <= free < 1 << 20)
    if full:
        return CheckpointError(f"disk full while writing {path} ({free} bytes free on its file system); free space "
                               f"or point train.out_dir at a larger disk. The previous checkpoint is intact.")
    return CheckpointError(f"could not write {path}: {err}")


def _write(obj: Any, path: Path) -> str:
    """torch.save `obj` to `path` (fsynced) and return the sha256 of the bytes written."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:
        raise _disk_error(path, e) from None
    return hashlib.sha256(data).hexdigest()


def _agree(flag: bool) -> bool:
    """True on every rank if `flag` is True on any rank (no process group: the flag itself)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _gather(obj: Any, world_size: int) -> list:
    if world_size == 1:
        return [obj]
    out = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def clean_partial(ckpt_root: Path) -> list[Path]:
    """Remove the temp directories of saves that were killed (rank 0, at start); returns them."""
    if not ckpt_root.is_dir():
        return []
    leftovers = [p for p in ckpt_root.iterdir() if p.name.startswith((".tmp_step_", ".old_step_"))
                 or p.name == "latest.tmp"]
    for p in leftovers:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return leftovers


def save_checkpoint(ckpt_root: Path, step: int, model_state: dict | None, rank_state: dict, meta: dict,
                    rank: int, world_size: int, keep: int,
                    write_sharded: Callable[[Path], dict[str, str]] | None = None) -> Path:
    """Write checkpoint `step` (collective over the default group); returns its directory.
    `write_sharded(tmp)` (every rank; trainer/sharded_checkpoint.py) writes a sharded model into
    the temp directory and returns {relative file name: sha256} of the files this rank wrote;
    model_state is then None (no model.pt)."""
    bad = nonfinite_keys(model_state, "model") if rank == 0 and model_state is not None else []
    bad += nonfinite_keys(rank_state, f"rank {rank}")
    if _agree(bool(bad)):
        raise NonFiniteError(f"refusing to save checkpoint step {step}: non-finite values in "
                             f"{', '.join(bad[:5]) or 'another rank'}" + (" ..." if len(bad) > 5 else "")
                             + "; the last good checkpoint is kept")
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            raise _disk_error(tmp, e) from None
    _barrier(world_size)
    files = {}
    if rank == 0 and model_state is not None:
        files[MODEL] = _write(model_state, tmp / MODEL)
    if write_sharded is not None:
        files.update(write_sharded(tmp))
    files[rank_file(rank)] = _write(rank_state, tmp / rank_file(rank))
    all_files = {k: v for d in _gather(files, world_size) for k, v in d.items()}
    if rank == 0:
        meta = {**meta, "files": all_files, "finite": True}
        try:
            (tmp / META).write_text(json.dumps(meta, indent=2))  # last: its presence marks a complete save
        except OSError as e:
            raise _disk_error(tmp / META, e) from None
        # a re-save of the same step keeps the old copy aside until the new one is in place
        replace_dir(tmp, final, aside=ckpt_root / f".old_step_{step:06d}")
        atomic_write(ckpt_root / "latest", final.name, suffix=".tmp")
        _rotate(ckpt_root, keep, final)
    _barrier(world_size)
    return final


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def _verified_finite(path: Path) -> bool:
    try:  # read_meta: a meta.json of the wrong shape is not verified, never an AttributeError
        return read_meta(path).get("finite") is True
    except CheckpointError:
        return False


def _rotate(ckpt_root: Path, keep: int, new: Path) -> None:
    """Keep the newest `keep` step directories, the new one, and the newest known-good one."""
    dirs = step_dirs(ckpt_root)
    good = [p for p in dirs if _verified_finite(p)]
    protect = {new} | ({good[-1]} if good else set())
    for old in dirs[:-keep]:
        if old not in protect:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint `latest` names; if that pointer is missing or dangling (a save killed between
    its renames), the newest step directory with a meta.json. Not verified: see find_resumable."""
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        path = ckpt_root / pointer.read_text().strip()
        if (path / META).is_file():
            return path
    complete = [p for p in step_dirs(ckpt_root) if (p / META).is_file()]
    return complete[-1] if complete else None


def files_needed(meta: dict, rank: int, world_size: int) -> list[str]:
    """The files a rank reads: the model, and its own rank file, or every rank file of the saved
    run when the world size changed (their states are combined)."""
    saved = int(meta["world_size"])
    if meta.get("sharded_model"):  # every rank verifies its share of the model's shard files
        shards = sorted(n for n in meta.get("files", {}) if n.startswith(meta["sharded_model"] + "/"))
        return shards[rank::world_size] + ([rank_file(rank)] if rank < saved else [])
    if saved == world_size:
        return [MODEL, rank_file(rank)]
    return [MODEL] + [rank_file(r) for r in range(saved)]


def find_resumable(ckpt_root: Path, rank: int, world_size: int,
                   report: Callable[[str], None] = print) -> tuple[Path, dict, dict[str, Any]] | None:
    """The newest checkpoint every rank can verify and load (collective): (its directory, meta, the
    files this rank reads, loaded by model.checkpoint_files.load_verified: checksums, weights_only,
    finite), or None when there is none at all. Each corrupt, incomplete or foreign one is reported
    by name (rank 0) and skipped; CheckpointError when step directories exist but none is intact."""
    tried = []
    for path in candidates(ckpt_root):
        problem = ""
        meta: dict = {}
        files: dict[str, Any] = {}
        try:
            meta = read_meta(path)
            names = files_needed(meta, rank, world_size)
            shards = [n for n in names if meta.get("sharded_model") and n.startswith(meta["sharded_model"] + "/")]
            if meta.get("sharded_model"):  # every rank reads DCP's .metadata: every rank checks it, safely
                shards = sorted(set(shards) | {f"{meta['sharded_model']}/.metadata"})
            verify(path, shards)  # a sharded model's DCP files: checked here, read by trainer/sharded_checkpoint.py
            if meta.get("sharded_model"):
                check_sharded_metadata(path, meta)
            files, meta = load_verified(path, [n for n in names if n not in shards])
        except CheckpointError as e:
            problem = str(e)
        problems = _gather(problem, world_size)
        bad = [p for p in problems if p]
        if not bad:
            for skipped in tried:
                if rank == 0:
                    report(f"skipped checkpoint {skipped}")
            return path, meta, files
        tried.append(f"{path.name}: {bad[0]}")
    if tried:
        raise CheckpointError(f"train.resume=auto found no intact checkpoint in {ckpt_root}: "
                              + "; ".join(tried) + ". Restore a checkpoint, or pass train.resume=overwrite to start over")
    return None
