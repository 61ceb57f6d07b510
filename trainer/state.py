"""Saving and restoring a Trainer's state through verified checkpoints (trainer/checkpoint.py),
including a resume on another world size: the model and the replicated optimizer state load as
they are, per-rank optimizer state (update-sync momenta) is averaged once over the saved ranks,
which is exactly one momentum synchronisation, and the data loader's global position carries over,
so no token is trained twice or skipped; and the policy for a non-finite step (train.on_nonfinite)."""
from __future__ import annotations

import time
from pathlib import Path

from .checkpoint import (MODEL, CheckpointError, find_resumable, rank_file, read_meta, rng_state, save_checkpoint,
                         set_rng_state, verify)
from .rundir import REPLACED, drop_replaced

MAX_ROLLBACKS = 5


class DivergenceError(RuntimeError):
    """The loss or a gradient turned non-finite and the policy says stop (or rollback is exhausted)."""


def save(trainer) -> Path:
    rank_state = {"optimizer": trainer.optimizer.state_dict(), "loader": trainer.loader.state_dict(),
                  "rng": rng_state(), "step": trainer.step, "train_time": trainer.train_time,
                  "skip_batches": sorted(trainer.skip_batches), "schedule_steps": trainer.schedule_steps,
                  "tokens_seen": trainer.tokens_seen}
    meta = {"step": trainer.step, "world_size": trainer.info.world_size, "config": trainer.cfg.to_dict(),
            "tokens_seen": trainer.tokens_seen,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = save_checkpoint(trainer.ckpt_root, trainer.step, trainer.model.state_dict(), rank_state, meta,
                           trainer.info.rank, trainer.info.world_size, trainer.cfg.train.keep_ckpts)
    if trainer.info.is_main and any(p.name.startswith(REPLACED) for p in trainer.out_dir.iterdir()):
        verify(path, list(read_meta(path)["files"]))  # read back: only a verified checkpoint retires the old run
        for gone in drop_replaced(trainer.out_dir):
            trainer.logger.console(f"removed {gone} (the replaced run): checkpoint {path} is verified")
    return path


def load(trainer, path: Path, meta: dict, files: dict) -> str:
    """Restore `trainer` from a verified checkpoint (find_resumable's result); returns the line to print."""
    rank, world = trainer.info.rank, trainer.info.world_size
    saved = int(meta["world_size"])
    try:
        trainer.model.load_state_dict(files[MODEL])
        if saved == world:
            mine = files[rank_file(rank)]
            trainer.optimizer.load_state_dict(mine["optimizer"])
            note = ""
        else:
            states = [files[rank_file(r)] for r in range(saved)]
            mine = states[min(rank, saved - 1)]
            trainer.optimizer.load_resharded([s["optimizer"] for s in states])
            note = (f" (written by {saved} ranks, resumed on {world}: per-rank optimizer state averaged once, i.e. "
                    f"one momentum synchronisation; data continues at the same global token position)")
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # a state this run's optimizer cannot take
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        how = (f"resume on the {saved} rank(s) it was written with" if saved != world else
               "resume with the optim / comm settings it was written with")
        raise CheckpointError(f"checkpoint {path} cannot be restored by this run: {first}; {how}, or start a "
                              f"new run (another train.out_dir, or train.resume=overwrite)") from None
    trainer.loader.load_state_dict(mine["loader"])  # a global position: the same in every rank's file
    if saved == world:
        set_rng_state(mine["rng"])
    trainer.step, trainer.train_time = int(mine["step"]), float(mine.get("train_time", 0.0))
    trainer.skip_batches = set(mine.get("skip_batches", []))
    trainer.tokens_seen = int(mine.get("tokens_seen", trainer.step * trainer.tokens_per_step))
    if "schedule_steps" in mine and not trainer.cfg.optim.schedule_steps:  # keep the run's lr schedule
        trainer.schedule_steps = int(mine["schedule_steps"])
    return f"resumed from {path} at step {trainer.step}{note}"


def on_nonfinite(trainer, r: dict) -> None:
    """train.on_nonfinite: stop (DivergenceError), skip_step (no update, go on), or rollback (reload
    the last good checkpoint and skip the offending step's batches)."""
    policy, bad = trainer.cfg.train.on_nonfinite, trainer.step
    trainer.logger.log({"step": bad, "event": "nonfinite", "policy": policy, "train_loss": r["loss"]})
    if policy == "skip_step":
        trainer.skipped_in_row = trainer.skipped_in_row + 1 if trainer.last_skipped == bad - 1 else 1
        trainer.last_skipped = bad
        cap = trainer.cfg.train.max_skipped_steps
        if trainer.skipped_in_row >= cap:
            raise DivergenceError(f"non-finite loss or gradient at {cap} consecutive steps (the last: step {bad}, "
                                  f"loss here: {r['loss']}); train.on_nonfinite=skip_step gives up after "
                                  f"train.max_skipped_steps={cap}: the run is diverging. No update was applied and "
                                  f"the last good checkpoint is kept. Lower optim.lr or raise optim.warmup_steps")
        trainer.logger.console(f"step {bad}: non-finite loss or gradient on some rank; no update applied "
                               f"(train.on_nonfinite=skip_step, {trainer.skipped_in_row} in a row)")
        return
    if policy == "rollback" and bad in trainer.skip_batches:
        raise DivergenceError(f"non-finite loss or gradient at step {bad} again after a rollback that skipped its "
                              f"batches (loss here: {r['loss']}): the data is not the cause, the run is diverging. "
                              f"The last good checkpoint is kept. Lower optim.lr or raise optim.warmup_steps")
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
