"""Checkpoints: one directory per step, written atomically.

Layout: ckpt/step_000100/{model.pt, rank_00000.pt, ..., meta.json}. The model is identical on all
ranks and saved once; every rank saves its own optimizer state (update-sync optimizers keep a
different momentum per rank), data-loader state and RNG states. Ranks write into a hidden temp
directory; after a barrier rank 0 renames it into place and rewrites `latest` (temp + rename), so a
save killed half-way never touches the last good checkpoint.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


def _atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_root: Path, step: int, model_state: dict, rank_state: dict, meta: dict,
                    rank: int, keep: int) -> Path:
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    if rank == 0:
        _atomic_torch_save(model_state, tmp / "model.pt")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    _atomic_torch_save(rank_state, tmp / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        aside = None
        if final.exists():  # a re-save of the same step: keep the old copy until the new one is in place
            aside = ckpt_root / f".old_step_{step:06d}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(tmp, final)
        latest_tmp = ckpt_root / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, ckpt_root / "latest")
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        for old in _step_dirs(ckpt_root)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _step_dirs(ckpt_root: Path) -> list[Path]:
    """step_* directories in step order (numeric: names past 999,999 steps still sort right)."""
    dirs = [p for p in ckpt_root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint `latest` names; if that pointer is missing or dangling (a save killed between
    its renames), the newest complete step directory."""
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        path = ckpt_root / pointer.read_text().strip()
        if (path / "meta.json").is_file():
            return path
    complete = [p for p in _step_dirs(ckpt_root) if (p / "meta.json").is_file() and (p / "model.pt").is_file()]
    return complete[-1] if complete else None


def load_checkpoint(path: Path, rank: int, world_size: int) -> tuple[dict, dict, dict]:
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("world_size") != world_size:
        raise RuntimeError(f"checkpoint {path} was written by {meta.get('world_size')} ranks, this run has "
                           f"{world_size}; resume with the same world size (per-rank optimizer state)")
    model_state = torch.load(path / "model.pt", map_location="cpu", weights_only=False)
    rank_state = torch.load(path / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)
    return model_state, rank_state, meta
