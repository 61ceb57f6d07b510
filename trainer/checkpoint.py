"""Checkpoints: one directory per step, written atomically, verified on resume.

Layout: ckpt/step_000100/{model.pt, rank_00000.pt, ..., meta.json}. The model is identical on all
ranks and saved once. Every rank saves its data-loader state, RNG states and its optimizer state;
where every rank steps one shared optimizer state (gradient sync: `shares_optimizer_state`, from
the sync-scheme registry's capability), that state is identical on every rank and only rank 0's
file holds it whole, the others only their per-rank entries (step counter, exchange state), and
meta.json names the file holding it (SHARED); update-sync optimizers keep a different momentum
per rank, which every rank writes. Checkpoints of older versions (every rank's whole state in
its own file, no SHARED) load as before. Ranks write into a hidden temp
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

train.async_ckpt (`save_checkpoint_async`): the state is copied to the CPU at the save (after the
same finite check), the files are written by a background thread and each rank then leaves a
marker with its files' checksums in the temp directory; rank 0 waits for them, writes meta.json
and renames the directory into place exactly as above, so verification, the meta.json listing
and the fallback to the newest intact checkpoint are the same. The next save, a rollback and the
run's final save wait for it (`wait_pending`); a failed background save is reported at once, is
never renamed into place, and makes the next wait raise a CheckpointError on every rank.
"""
from __future__ import annotations

import copy
import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

# the reading rule (checksums, weights_only loads, finiteness) has one home, shared with model/load.py
from model.checkpoint_files import (META, MODEL, CheckpointError, candidates, check_sharded_metadata, files_in,
                                    load_verified, nonfinite_keys, read_meta, sha256_file, step_dirs, verify)
from util import atomic_write, replace_dir

from .dist import before_shutdown

__all__ = ["META", "MODEL", "SHARED", "CheckpointError", "NonFiniteError", "candidates", "files_kept", "find_resumable",
           "optimizer_state", "read_meta", "remeshes", "save_checkpoint", "sha256_file", "shares_optimizer_state",
           "split_optimizer_state", "step_dirs", "verify"]


class NonFiniteError(CheckpointError):
    """The state to save holds NaN or inf."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


SHARED = "optimizer_shared"
"""meta.json's key naming the rank file that holds the optimizer state every rank shares (absent in
checkpoints of older versions and where the state is per rank: every rank file then holds its own)."""
PER_RANK_KEYS = ("comm",)
"""The entries of a CommOptimizer's state that stay in every rank's file under gradient sync: its
own rank, step counter and exchange state (a gradient scheme's error feedback is per rank)."""
UPDATE_PHASE = "update_sync"  # the phase an UPDATE-kind scheme books into (SyncScheme.phase)


def shares_optimizer_state(optimizer, world_size: int) -> bool:
    """Whether every rank steps one optimizer state (identical on every rank, so written once): its
    sync scheme shares state (the registry's `per_rank_state` is False: gradient sync) and none of
    its own exchanges is an update sync (Dion's factor exchange keeps a momentum per rank even
    under a gradient scheme). Anything without a registry scheme keeps its state per rank."""
    scheme = getattr(optimizer, "scheme", None)
    if world_size < 2 or scheme is None or getattr(scheme, "per_rank_state", True):
        return False
    phases = optimizer.wire_bytes_per_step(world_size=world_size, rank=0)
    return not any(sent or recv for phase, (sent, recv) in phases.items() if phase == UPDATE_PHASE)


def split_optimizer_state(state: dict, rank: int, shared: bool) -> dict:
    """What rank `rank` writes of its optimizer state: all of it on rank 0 or where the state is per
    rank; only its per-rank entries (PER_RANK_KEYS) on the other ranks when the rest is shared."""
    if not shared or rank == 0:
        return state
    return {k: v for k, v in state.items() if k in PER_RANK_KEYS}


def optimizer_state(files: dict[str, Any], meta: dict, name: str) -> dict:
    """The whole optimizer state of the rank whose file is `name`, from a loaded checkpoint's files:
    its own file's, completed by the shared state (meta[SHARED]'s file) when that was written once.
    A checkpoint of an older version holds every rank's state in its own file."""
    own = files[name]["optimizer"]
    shared = meta.get(SHARED)
    if not shared or name == shared:
        return own
    return {**files[shared]["optimizer"], **own}


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


# what a save writes in a step directory, for one whose meta.json cannot be read (damaged) or lists no
# files (older versions): meta.json, model.pt, the rank files and a sharded model's DCP files
SAVE_NAMES = re.compile(r"(meta\.json|model\.pt|rank_\d+\.pt|[^/]+/(__\d+_\d+\.distcp|\.metadata))")


def foreign_in_step(step: Path) -> list[str]:
    """Files of a checkpoint's step directory its save did not write (`verify`'s rule: not meta.json nor
    a file its meta.json lists; by SAVE_NAMES where meta.json cannot be read or lists none), as paths
    relative to it."""
    try:
        listed = read_meta(step).get("files")
    except CheckpointError:
        listed = None
    if listed is not None:
        return sorted(set(files_in(step)) - set(listed) - {META})
    return [f for f in files_in(step) if not SAVE_NAMES.fullmatch(f)]


KEPT = "kept_"  # prefix of a step directory set aside, not deleted, because it holds files no save wrote


def set_aside_foreign(ckpt_root: Path, step_dir: Path, why: str) -> Path | None:
    """Rank 0, before a step directory is deleted (rotated out, or replaced by a re-save of its step
    after a fallback past it): when it holds files its save did not write (a user's notes or plots),
    move it to ckpt/kept_<name>/ (never deleted; `overwrite` then names it) and say so; returns the
    new place, or None when the directory is the trainer's alone."""
    foreign = foreign_in_step(step_dir)
    if not foreign:
        return None
    dest, n = ckpt_root / f"{KEPT}{step_dir.name}", 1
    while dest.exists():
        dest, n = ckpt_root / f"{KEPT}{step_dir.name}.{n}", n + 1
    os.replace(step_dir, dest)
    print(f"{ckpt_root}: checkpoint {step_dir.name} holds files no save wrote ({', '.join(foreign[:5])}"
          f"{' ...' if len(foreign) > 5 else ''}); {why}, it was moved to {dest.name}/ instead of deleted", flush=True)
    return dest


def _refuse_nonfinite(step: int, model_state: dict | None, rank_state: dict, rank: int) -> None:
    """NonFiniteError on every rank (collective) when any rank's state to save holds a non-finite value."""
    bad = nonfinite_keys(model_state, "model") if rank == 0 and model_state is not None else []
    bad += nonfinite_keys(rank_state, f"rank {rank}")
    if _agree(bool(bad)):
        raise NonFiniteError(f"refusing to save checkpoint step {step}: non-finite values in "
                             f"{', '.join(bad[:5]) or 'another rank'}" + (" ..." if len(bad) > 5 else "")
                             + "; the last good checkpoint is kept")


def _make_temp(ckpt_root: Path, step: int, rank: int, world_size: int) -> tuple[Path, Path]:
    """(final, temp) directories of checkpoint `step`; rank 0 makes the temp one empty, every rank
    waits for it (collective)."""
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            raise _disk_error(tmp, e) from None
    _barrier(world_size)
    return final, tmp


def _finish(ckpt_root: Path, step: int, tmp: Path, final: Path, meta: dict, keep: int) -> None:
    """Rank 0, every file of the save in `tmp`: write meta.json last (its presence marks a complete
    save), put the directory in place, point `latest` at it and rotate old steps."""
    try:
        (tmp / META).write_text(json.dumps(meta, indent=2))
    except OSError as e:
        raise _disk_error(tmp / META, e) from None
    if final.exists():  # a fallback past this step (or a rollback) saves it again: a user's files in it stay
        try:
            set_aside_foreign(ckpt_root, final, f"saving step {step} again")
        except OSError as e:  # not moved: the save stops here rather than delete it with the old copy
            raise _disk_error(ckpt_root / f"{KEPT}{final.name}", e) from None
    # a re-save of the same step keeps the old copy aside until the new one is in place
    replace_dir(tmp, final, aside=ckpt_root / f".old_step_{step:06d}")
    atomic_write(ckpt_root / "latest", final.name, suffix=".tmp")
    _rotate(ckpt_root, keep, final)


def save_checkpoint(ckpt_root: Path, step: int, model_state: dict | None, rank_state: dict, meta: dict,
                    rank: int, world_size: int, keep: int,
                    write_sharded: Callable[[Path], dict[str, str]] | None = None) -> Path:
    """Write checkpoint `step` (collective over the default group); returns its directory.
    `write_sharded(tmp)` (every rank; trainer/sharded_checkpoint.py) writes a sharded model into
    the temp directory and returns {relative file name: sha256} of the files this rank wrote;
    model_state is then None (no model.pt)."""
    _refuse_nonfinite(step, model_state, rank_state, rank)
    final, tmp = _make_temp(ckpt_root, step, rank, world_size)
    files = {}
    if rank == 0 and model_state is not None:
        files[MODEL] = _write(model_state, tmp / MODEL)
    if write_sharded is not None:
        files.update(write_sharded(tmp))
    files[rank_file(rank)] = _write(rank_state, tmp / rank_file(rank))
    all_files = {k: v for d in _gather(files, world_size) for k, v in d.items()}
    if rank == 0:
        _finish(ckpt_root, step, tmp, final, {**meta, "files": all_files, "finite": True}, keep)
    _barrier(world_size)
    return final


# ---- background saves (train.async_ckpt) -------------------------------------------------------------------
ASYNC_WAIT_S = 600.0  # how long rank 0's writer waits for the other ranks' files before giving the save up
_pending: dict[str, "_Background"] = {}  # checkpoint root -> this process's save in flight


class _Background:
    """One rank's part of a background save: a thread writing the snapshot into the temp directory."""

    def __init__(self, step: int, target: Callable[["_Background"], None]) -> None:
        self.step, self.error = step, ""
        self.thread = threading.Thread(target=self._run, args=(target,), name=f"checkpoint-{step}", daemon=False)

    def _run(self, target) -> None:
        try:
            target(self)
        except Exception as e:  # noqa: BLE001 - every failure is reported and the save never marked intact
            self.error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            kept = "" if "previous checkpoint" in self.error else "; the previous checkpoint is kept"
            print(f"checkpoint step {self.step}: the background save failed: {self.error}{kept}", file=sys.stderr,
                  flush=True)


def _snapshot(obj: Any, memo: dict | None = None) -> Any:
    """A copy of a nested state on the CPU that training cannot change (it updates the originals in
    place while the copy is written). Each storage is copied once and its tensors become views of
    the copy, as torch.save stores them: a tied weight stays one storage and the file's bytes are
    those of a synchronous save."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        st = t.untyped_storage()
        key = (st.device.type, st.data_ptr(), st.nbytes())
        if key not in memo:
            memo[key] = st.clone() if st.device.type == "cpu" else st.cpu()
        out = torch.empty(0, dtype=t.dtype)
        out.set_(memo[key], t.storage_offset(), t.size(), t.stride())
        return out
    if isinstance(obj, dict):
        out = (OrderedDict if isinstance(obj, OrderedDict) else dict)((k, _snapshot(v, memo)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a module's state dict: its version metadata is saved with it
            out._metadata = copy.deepcopy(obj._metadata)
        return out
    if isinstance(obj, list):
        return [_snapshot(v, memo) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_snapshot(v, memo) for v in obj)
    return obj


def wait_pending(ckpt_root: Path, world_size: int = 1) -> None:
    """Wait for this process's background save under `ckpt_root` (if any). Collective when
    world_size > 1: every rank learns whether any rank's part failed, and then all raise a
    CheckpointError naming the step (the checkpoint itself was never marked intact)."""
    job = _pending.pop(str(ckpt_root), None)
    if job is None:
        return
    job.thread.join()
    if _agree(bool(job.error)) if world_size > 1 else bool(job.error):
        raise CheckpointError(f"the background save of checkpoint step {job.step} failed"
                              f"{': ' + job.error if job.error else ' on another rank'}; the previous checkpoint is "
                              f"kept. Free space or fix {ckpt_root}, or set train.async_ckpt=false")


def join_all() -> None:
    """Wait for every background save of this process, with no collective (the run is ending, maybe
    after an error): trainer.dist.shutdown calls it. A failure was reported by its thread."""
    while _pending:
        _pending.popitem()[1].thread.join()


def _marker(tmp: Path, rank: int, what: str) -> Path:
    return tmp / f".{rank_file(rank)}.{what}"


def _publish(path: Path, text: str) -> None:
    """Write a small file atomically (temp + rename): a reader never sees it half written."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def save_checkpoint_async(ckpt_root: Path, step: int, model_state: dict | None, rank_state: dict, meta: dict,
                          rank: int, world_size: int, keep: int) -> Path:
    """`save_checkpoint` with the writing in a background thread (collective, like it; not for a
    sharded model). Here, synchronously: the previous background save is waited for, the finite
    check agreed, the state copied to the CPU and the temp directory made. In the background every
    rank writes its files and then a marker with their checksums (or one with its error); rank 0
    waits for every rank's marker, writes meta.json last with every file's checksum, and renames the
    directory into place, as a synchronous save does. A failed part leaves the temp directory, never
    a step directory (removed at the next start, `clean_partial`). Returns the directory the
    checkpoint will have; `wait_pending` waits for it."""
    wait_pending(ckpt_root, world_size)
    _refuse_nonfinite(step, model_state, rank_state, rank)
    model_state = _snapshot(model_state) if rank == 0 and model_state is not None else None
    rank_state = _snapshot(rank_state)
    final, tmp = _make_temp(ckpt_root, step, rank, world_size)

    def write(job: _Background) -> None:
        files = {}
        try:
            if model_state is not None:
                files[MODEL] = _write(model_state, tmp / MODEL)
            files[rank_file(rank)] = _write(rank_state, tmp / rank_file(rank))
        except Exception as e:
            _publish(_marker(tmp, rank, "failed"), str(e) or type(e).__name__)
            raise
        if rank != 0:
            _publish(_marker(tmp, rank, "done"), json.dumps(files))
            return
        deadline = time.monotonic() + ASYNC_WAIT_S
        for r in range(1, world_size):
            while not _marker(tmp, r, "done").is_file():
                if _marker(tmp, r, "failed").is_file():
                    raise CheckpointError(f"rank {r} could not write its part: "
                                          f"{_marker(tmp, r, 'failed').read_text()[:300]}")
                if time.monotonic() > deadline:
                    raise CheckpointError(f"rank {r} did not write its part within {ASYNC_WAIT_S:.0f} s")
                time.sleep(0.02)
            files.update(json.loads(_marker(tmp, r, "done").read_text()))
            _marker(tmp, r, "done").unlink()
        _finish(ckpt_root, step, tmp, final, {**meta, "files": files, "finite": True}, keep)

    job = _Background(step, write)
    _pending[str(ckpt_root)] = job
    before_shutdown(join_all)  # the end of the run waits for it, also when the run stops after this save
    job.thread.start()
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
    """Keep the newest `keep` step directories, the new one, and the newest known-good one; delete the
    others, but move one holding files no save wrote aside (set_aside_foreign) or leave it in place."""
    dirs = step_dirs(ckpt_root)
    good = [p for p in dirs if _verified_finite(p)]
    protect = {new} | ({good[-1]} if good else set())
    for old in dirs[:-keep]:
        if old in protect:
            continue
        try:
            kept = set_aside_foreign(ckpt_root, old, "rotated out by train.keep_ckpts")
        except OSError as e:  # could not be moved: it stays where it is, the user's file in it
            print(f"{ckpt_root}: {old.name} holds files no save wrote and could not be moved aside ({e}); "
                  f"it is left in place", flush=True)
            continue
        if kept is None:
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


def remeshes(meta: dict, world_size: int, shard_size: int | None = None) -> bool:
    """Whether a resume with `world_size` ranks and `shard_size` (None: the checkpoint's) rebuilds the
    state on another mesh where one side is sharded (trainer/state.py's _load_remeshed): every rank
    then reads every old rank's file."""
    saved, saved_shard = int(meta["world_size"]), int(meta.get("shard_size", 1))
    shard = saved_shard if shard_size is None else int(shard_size)
    return (shard > 1 or saved_shard > 1) and (shard != saved_shard or saved != world_size)


def files_needed(meta: dict, rank: int, world_size: int, shard_size: int | None = None) -> list[str]:
    """The files a rank reads: the model, and its own rank file, or every rank file of the saved
    run when the world size or the mesh changed (their states are combined), so that a damaged
    one is found here and the checkpoint skipped like any other damaged one. Of these the rank
    keeps in memory only `files_kept`; the others it checks one at a time here and reads again,
    one at a time, when their states are combined (trainer/state.py)."""
    saved = int(meta["world_size"])
    shared = [meta[SHARED]] if meta.get(SHARED) else []  # the optimizer state written once, read by all
    every = remeshes(meta, world_size, shard_size) or saved != world_size
    own = [rank_file(r) for r in range(saved)] if every else [rank_file(rank)] if rank < saved else []
    if meta.get("sharded_model"):  # every rank verifies its share of the model's shard files
        shards = sorted(n for n in meta.get("files", {}) if n.startswith(meta["sharded_model"] + "/"))
        return shards[rank::world_size] + sorted(set(own + shared))
    return [MODEL] + sorted(set(own + shared))


def files_kept(meta: dict, rank: int, world_size: int) -> set[str]:
    """Of `files_needed`, those a rank holds after the check: the model's file, the shared optimizer
    state, and one rank file, its own or, where the saved run had fewer ranks, the last one's (the
    data position and step every rank file carries). With every old rank file needed (another
    world size or mesh), holding them all would take one state per saved rank on every rank."""
    saved = int(meta["world_size"])
    return {MODEL, rank_file(min(rank, saved - 1))} | ({meta[SHARED]} if meta.get(SHARED) else set())


def find_resumable(ckpt_root: Path, rank: int, world_size: int, report: Callable[[str], None] = print,
                   shard_size: int | None = None) -> tuple[Path, dict, dict[str, Any]] | None:
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
            names = files_needed(meta, rank, world_size, shard_size)
            shards = [n for n in names if meta.get("sharded_model") and n.startswith(meta["sharded_model"] + "/")]
            if meta.get("sharded_model"):  # every rank reads DCP's .metadata: every rank checks it, safely
                shards = sorted(set(shards) | {f"{meta['sharded_model']}/.metadata"})
            verify(path, shards)  # a sharded model's DCP files: checked here, read by trainer/sharded_checkpoint.py
            if meta.get("sharded_model"):
                check_sharded_metadata(path, meta)
            kept = files_kept(meta, rank, world_size)
            for name in [n for n in names if n not in shards and n not in kept]:  # checked, not held
                load_verified(path, [name])
            files, meta = load_verified(path, [n for n in names if n not in shards and n in kept])
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
