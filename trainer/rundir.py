"""The run directory policy: refuse, replace or resume `train.out_dir`, and the run's identity.

- train.resume=never: an existing non-empty directory is refused (nothing is touched);
- overwrite: only a directory that looks like a run (config.yaml, metrics.jsonl or ckpt/) and that
  no live run holds is emptied and started afresh;
- auto: continue from the newest intact checkpoint (trainer/checkpoint.py verifies checksums and
  falls back to older ones); a checkpoint whose config differs in keys a resumed run may not
  change is refused, listing them. The world size may change (the trainer remaps the state).
Rank 0 decides and holds the directory's lock (trainer/runlock.py: one live run per directory)
for the run's life; every rank learns the outcome through one tiny collective. Temp directories
of checkpoint saves that were killed are removed.

A run's id (`run_id` in the directory) is made when the directory is (re)created: a hash of the
resolved path and the creation time, so wandb runs are unique per directory and a replaced
directory gets a new one; a resumed run reads it back.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

from .checkpoint import CheckpointError, clean_partial, latest_checkpoint, read_meta
from .dist import DistInfo, all_agree
from .runlock import LOCK, LockError, RunLock

# keys a resumed run may change; anything else must match the checkpoint's config
RESUMABLE_KEYS = ("train.max_steps", "train.stop_after", "train.resume", "train.eval_every",
                  "train.eval_steps", "train.ckpt_every", "train.keep_ckpts", "train.log_every",
                  "train.out_dir", "train.device", "train.mc_eval", "train.on_nonfinite", "data.cache_dir",
                  "comm.timeout_s", "comm.init_timeout_s", "comm.kernels", "comm.fine_timing", "comm.auto_",
                  "log.", "diag.",
                  "parallel.")  # the mesh: trainer/state.py load decides what it can resume
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "ckpt")


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (exists, or nothing to resume)."""


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_problem(ckpt_root: Path, config: dict) -> str:
    """Why the latest checkpoint cannot be resumed with this config ("" if it can or none exists;
    whether its files are intact is checked when loading, with fallback to older ones)."""
    path = latest_checkpoint(ckpt_root)
    if path is None:
        return ""
    try:
        meta = read_meta(path)
    except CheckpointError:
        return ""  # reported, with the fallback, when loading
    old, new = flatten(meta.get("config", {})), flatten(config)
    changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k) and not k.startswith(RESUMABLE_KEYS)]
    if changed:
        return (f"train.resume=auto: this config differs from checkpoint {path} in keys a resumed run cannot "
                f"change: {'; '.join(changed)}. Restore them, or start a new run (another train.out_dir)")
    return ""


def new_run_id(out_dir: Path) -> str:
    """A fresh id for a run directory: its name plus a hash of its resolved path and this moment."""
    h = hashlib.sha256(f"{out_dir.resolve()}|{time.time_ns()}|{os.getpid()}".encode()).hexdigest()[:12]
    return f"{out_dir.name}-{h}".replace("/", "_")


def prepare_run_dir(out_dir: Path, resume: str, config: dict, info: DistInfo) -> RunLock | None:
    """Refuse, replace or open `out_dir` for this run; rank 0 returns the lock it now holds.
    Raises RunDirError on every rank when rank 0 refuses."""
    problem, lock = "", None
    if info.is_main:
        try:
            problem, lock = _decide(out_dir, resume, config)
        except LockError as e:
            problem = str(e)
    if all_agree(bool(problem), info.device):
        if lock is not None:
            lock.release()
        raise RunDirError(problem or f"rank 0 refused the run directory {out_dir}")
    return lock


def _decide(out_dir: Path, resume: str, config: dict) -> tuple[str, RunLock | None]:
    exists = out_dir.exists() and any(p.name != LOCK for p in out_dir.iterdir())
    looks_like_run = any((out_dir / n).exists() for n in RUN_MARKERS)
    if exists and resume == "never":
        return (f"run directory {out_dir} already exists and is not empty; pass train.resume=auto to continue it, "
                f"train.resume=overwrite to replace it, or choose another train.out_dir"), None
    if exists and resume == "overwrite" and not looks_like_run:
        return (f"train.resume=overwrite refuses to delete {out_dir}: it holds no config.yaml, metrics.jsonl or ckpt/, "
                f"so it does not look like a run directory"), None
    if resume == "auto":
        problem = resume_problem(out_dir / "ckpt", config)
        if problem:
            return problem, None
    lock = RunLock(out_dir)
    note = lock.acquire()  # LockError when a live run holds it: nothing below runs
    if note:
        print(f"{out_dir}: {note}", flush=True)
    if exists and resume == "overwrite":  # only now: a live run's directory is never deleted
        for p in out_dir.iterdir():
            if p.name != LOCK:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    removed = clean_partial(out_dir / "ckpt")
    if removed:
        print(f"{out_dir}: removed {len(removed)} leftover temp file(s) of killed checkpoint saves: "
              f"{', '.join(p.name for p in removed)}", flush=True)
    if not (out_dir / "run_id").is_file():
        (out_dir / "run_id").write_text(new_run_id(out_dir) + "\n")
    return "", lock


def run_id(out_dir: Path) -> str:
    path = out_dir / "run_id"
    return path.read_text().strip() if path.is_file() else new_run_id(out_dir)
