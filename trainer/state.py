"""Saving and restoring a Trainer's state through verified checkpoints (trainer/checkpoint.py),
including a resume on another world size: the model and the replicated optimizer state load as
they are, per-rank optimizer state (update-sync momenta) is averaged once over the saved ranks,
which is exactly one momentum synchronisation, and the data loader's global position carries over,
so no token is trained twice or skipped; and the policy for a non-finite step (train.on_nonfinite)."""
from __future__ import annotations

import time
from pathlib import Path

from . import sharded_checkpoint
from .config import ConfigError
from .checkpoint import (MODEL, files_needed, find_resumable, load_files, rank_file, rng_state, save_checkpoint,
                         set_rng_state, verify)

MAX_ROLLBACKS = 5


class DivergenceError(RuntimeError):
    """The loss or a gradient turned non-finite and the policy says stop (or rollback is exhausted)."""


def save(trainer) -> Path:
    rank_state = {"optimizer": trainer.optimizer.state_dict(), "loader": trainer.loader.state_dict(),
                  "rng": rng_state(), "step": trainer.step, "train_time": trainer.train_time,
                  "skip_batches": sorted(trainer.skip_batches)}
    meta = {"step": trainer.step, "world_size": trainer.info.world_size, "config": trainer.cfg.to_dict(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "shard_size": trainer.parallel.shard_size}
    if trainer.parallel.sharded:  # every rank writes its model shards (DCP); its file holds its shards'
        # optimizer state (per-replica state is per rank, never merged)
        sharded_checkpoint.check_finite(trainer.model, trainer.step)
        meta["sharded_model"] = sharded_checkpoint.MODEL_DIR
        return save_checkpoint(trainer.ckpt_root, trainer.step, None, rank_state, meta, trainer.info.rank,
                               trainer.info.world_size, trainer.cfg.train.keep_ckpts,
                               write_sharded=sharded_checkpoint.writer(trainer.model, trainer.info.rank))
    return save_checkpoint(trainer.ckpt_root, trainer.step, trainer.model.state_dict(), rank_state, meta,
                           trainer.info.rank, trainer.info.world_size, trainer.cfg.train.keep_ckpts)


def load(trainer, path: Path, meta: dict) -> str:
    """Restore `trainer` from a verified checkpoint; returns the line to print."""
    rank, world = trainer.info.rank, trainer.info.world_size
    saved = int(meta["world_size"])
    shard, saved_shard = trainer.parallel.shard_size, int(meta.get("shard_size", 1))
    if (shard > 1 or saved_shard > 1) and (shard != saved_shard or saved != world):
        return _load_remeshed(trainer, path, meta, saved_shard)
    if meta.get("sharded_model"):
        files = load_files(path, [rank_file(rank)])
        sharded_checkpoint.load_model(trainer.model, path)
    else:
        files = load_files(path, files_needed(meta, rank, world))
        trainer.model.load_state_dict(files[MODEL])
    if saved == world:
        mine = files[rank_file(rank)]
        trainer.optimizer.load_state_dict(mine["optimizer"])
        note = ""
    else:
        states = [files[rank_file(r)] for r in range(saved)]
        mine = states[min(rank, saved - 1)]
        trainer.optimizer.load_resharded([s["optimizer"] for s in states])
        note = (f" (written by {saved} ranks, resumed on {world}: per-rank optimizer state averaged once, i.e. one "
                f"momentum synchronisation; data continues at the same global token position)")
    trainer.loader.load_state_dict(mine["loader"])  # a global position: the same in every rank's file
    if saved == world:
        set_rng_state(mine["rng"])
    trainer.step, trainer.train_time = int(mine["step"]), float(mine.get("train_time", 0.0))
    trainer.skip_batches = set(mine.get("skip_batches", []))
    return f"resumed from {path} at step {trainer.step}{note}"


def _load_remeshed(trainer, path: Path, meta: dict, saved_shard: int) -> str:
    """Resume on another mesh (shard size or world size) where one side is sharded: the model from
    its DCP shards or model.pt, the optimizer state joined per old replica and cut for this rank
    (sharded_checkpoint.remesh_optimizer_state); a config error naming the saved mesh when the
    optimizer's state cannot be mapped."""
    rank, world, par = trainer.info.rank, trainer.info.world_size, trainer.parallel
    saved = int(meta["world_size"])
    names = [rank_file(r) for r in range(saved)]
    verify(path, names)  # every old rank's file is read here: a damaged one is named
    files = load_files(path, names)
    try:
        opt = sharded_checkpoint.remesh_optimizer_state(
            [files[n]["optimizer"] for n in names], saved_shard, par.shard_size, par.replicas,
            rank // par.shard_size, rank % par.shard_size, rank // par.shard_size if par.sharded else rank)
    except ValueError as e:
        raise ConfigError(f"checkpoint {path} (parallel.shard_size={saved_shard} on {saved} ranks) cannot resume on "
                          f"parallel.shard_size={par.shard_size} on {world} ranks: {e}; resume with "
                          f"parallel.shard_size={saved_shard} on {saved} ranks") from None
    if meta.get("sharded_model"):
        sharded_checkpoint.load_model(trainer.model, path)
    else:
        verify(path, [MODEL])
        sharded_checkpoint.load_full_model(trainer.model, load_files(path, [MODEL])[MODEL])
    trainer.optimizer.load_state_dict(opt)
    mine = files[names[min(rank, saved - 1)]]
    trainer.loader.load_state_dict(mine["loader"])  # a global position: the same in every rank's file
    trainer.step, trainer.train_time = int(mine["step"]), float(mine.get("train_time", 0.0))
    trainer.skip_batches = set(mine.get("skip_batches", []))
    old_r, new_r = saved // saved_shard, par.replicas
    how = "each replica's state as saved" if old_r == new_r else \
        "per-replica optimizer state averaged once over the saved replicas (one momentum synchronisation)"
    return (f"resumed from {path} at step {trainer.step} (written as {old_r} x {saved_shard} (replicas x shard size), "
            f"resumed as {new_r} x {par.shard_size}: {how})")


def on_nonfinite(trainer, r: dict) -> None:
    """train.on_nonfinite: stop (DivergenceError), skip_step (no update, go on), or rollback (reload
    the last good checkpoint and skip the offending step's batches)."""
    policy, bad = trainer.cfg.train.on_nonfinite, trainer.step
    trainer.logger.log({"step": bad, "event": "nonfinite", "policy": policy, "train_loss": r["loss"]})
    if policy == "skip_step":
        trainer.logger.console(f"step {bad}: non-finite loss or gradient on some rank; no update applied "
                               f"(train.on_nonfinite=skip_step)")
        return
    found = find_resumable(trainer.ckpt_root, trainer.info.rank, trainer.info.world_size, trainer._say) \
        if policy == "rollback" and trainer.rollbacks < MAX_ROLLBACKS else None
    if found is None:
        why = ("no checkpoint to roll back to" if policy == "rollback" and trainer.rollbacks < MAX_ROLLBACKS else
               f"{MAX_ROLLBACKS} rollbacks already" if policy == "rollback" else "train.on_nonfinite=stop")
        raise DivergenceError(f"non-finite loss or gradient at step {bad} on some rank (loss here: "
                              f"{r['loss']}); no update was applied and no checkpoint holds non-finite values "
                              f"({why}). Lower optim.lr or raise optim.warmup_steps, or set "
                              f"train.on_nonfinite=skip_step|rollback")
    skip = trainer.skip_batches | {bad}
    msg = load(trainer, *found)
    trainer.skip_batches, trainer.rollbacks = skip, trainer.rollbacks + 1
    trainer.logger.console(f"step {bad}: non-finite loss or gradient; rolled back: {msg}; the batches of step "
                           f"{bad} will be skipped")
