"""The run directory policy: refuse, replace or resume `train.out_dir`, and the run's identity.

- train.resume=never: an existing non-empty directory is refused (nothing is touched);
- overwrite: only a directory that looks like a run (config.yaml, metrics.jsonl or ckpt/) is
  deleted and started afresh;
- auto: continue from the latest checkpoint if any; a checkpoint written with another world size
  or with different values of keys a resumed run may not change is refused, listing them.
Rank 0 decides; every rank learns the outcome through one tiny collective.

A run's id (`run_id` in the directory) is made when the directory is (re)created: a hash of the
resolved path and the creation time, so wandb runs are unique per directory and a replaced
directory gets a new one; a resumed run reads it back.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from .checkpoint import latest_checkpoint
from .dist import DistInfo, all_agree

# keys a resumed run may change; anything else must match the checkpoint's config
RESUMABLE_KEYS = ("train.max_steps", "train.stop_after", "train.resume", "train.eval_every",
                  "train.eval_steps", "train.ckpt_every", "train.keep_ckpts", "train.log_every",
                  "train.out_dir", "train.device", "train.mc_eval", "data.cache_dir", "comm.timeout_s", "log.",
                  "diag.")
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


def resume_problem(ckpt_root: Path, config: dict, world_size: int) -> str:
    """Why the latest checkpoint cannot be resumed with this config ("" if it can or none exists)."""
    steps = list(ckpt_root.glob("step_*")) if ckpt_root.is_dir() else []
    path = latest_checkpoint(ckpt_root)
    if path is None:
        return (f"{ckpt_root} holds step directories but no loadable checkpoint; inspect it, or pass "
                f"train.resume=overwrite to start over") if steps else ""
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("world_size") != world_size:
        return (f"checkpoint {path} was written by {meta.get('world_size')} ranks, this run has "
                f"{world_size}; per-rank optimizer state needs the same world size")
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


def prepare_run_dir(out_dir: Path, resume: str, config: dict, info: DistInfo) -> Path | None:
    """Refuse, replace or resume `out_dir`; returns the checkpoint to resume from (or None).
    Raises RunDirError on every rank when rank 0 refuses."""
    ckpt_root = out_dir / "ckpt"
    problem = ""
    if info.is_main:
        exists = out_dir.exists() and any(out_dir.iterdir())
        looks_like_run = any((out_dir / n).exists() for n in RUN_MARKERS)
        if exists and resume == "never":
            problem = (f"run directory {out_dir} already exists and is not empty; pass "
                       f"train.resume=auto to continue it, train.resume=overwrite to replace it, "
                       f"or choose another train.out_dir")
        elif exists and resume == "overwrite" and not looks_like_run:
            problem = (f"train.resume=overwrite refuses to delete {out_dir}: it holds no config.yaml, "
                       f"metrics.jsonl or ckpt/, so it does not look like a run directory")
        elif exists and resume == "overwrite":
            shutil.rmtree(out_dir)
        elif resume == "auto":
            problem = resume_problem(ckpt_root, config, info.world_size)
        if not problem:
            out_dir.mkdir(parents=True, exist_ok=True)
            if not (out_dir / "run_id").is_file():
                (out_dir / "run_id").write_text(new_run_id(out_dir) + "\n")
    if all_agree(bool(problem), info.device):
        raise RunDirError(problem or f"rank 0 refused the run directory {out_dir}")
    return latest_checkpoint(ckpt_root) if resume == "auto" else None


def run_id(out_dir: Path) -> str:
    path = out_dir / "run_id"
    return path.read_text().strip() if path.is_file() else new_run_id(out_dir)
