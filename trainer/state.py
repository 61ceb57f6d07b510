"""Opening a run in its run directory (a resume from its last checkpoint, config.yaml, the logger)
and its normal end (final evaluation, parameter check, last checkpoint); saving and restoring a
Trainer's state through verified checkpoints (trainer/checkpoint.py),
including a resume on another world size: the model and the replicated optimizer state load as
they are, per-rank optimizer state (update-sync momenta) is averaged once over the saved ranks,
which is exactly one momentum synchronisation, and the data loader's global position carries over,
so no token is trained twice or skipped; and the policy for a non-finite step (train.on_nonfinite).
Under gradient sync the optimizer state every rank shares is written once, in rank 0's file
(trainer/checkpoint.py: shares_optimizer_state); train.async_ckpt saves in the background."""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from model.checkpoint_files import load_verified

from . import automode, parallel, sharded_checkpoint
from .checkpoint import (MODEL, SHARED, CheckpointError, _gather, find_resumable, optimizer_state, rank_file,
                         read_meta, remeshes, rng_state, save_checkpoint, save_checkpoint_async, set_rng_state,
                         shares_optimizer_state, split_optimizer_state, verify, wait_pending)
from .config import ConfigError
from .logger import RunLogger, arm_label, finish_record
from .rundir import REPLACED, drop_replaced, run_id
from .schedule import schedule_note

MAX_ROLLBACKS = 5


# the event of the metrics record a run writes last when train.on_nonfinite stops it (DivergenceError)
DIVERGED_EVENT = "diverged"


class DivergenceError(RuntimeError):
    """The loss or a gradient turned non-finite and the policy says stop (or rollback is exhausted)."""


def open_run(trainer) -> RunLogger:
    """The start of a run in its (locked) run directory: resume from its last checkpoint under
    train.resume=auto, write config.yaml (and comm.mode=auto's decision), and return the run's
    logger, whose first records are that decision and the resume. A failure before the logger
    exists releases the directory's lock."""
    cfg, info = trainer.cfg, trainer.info
    try:
        found = find_resumable(trainer.ckpt_root, info.rank, info.world_size, trainer._say,
                               trainer.parallel.shard_size) if cfg.train.resume == "auto" else None
        if found is not None:
            trainer._say(load(trainer, *found))
            if trainer.schedule_steps != cfg.train.max_steps:
                trainer._say(schedule_note(trainer.schedule_steps, cfg.train.max_steps))
        if info.is_main:  # only now: a config that fails while building leaves no run directory behind
            (trainer.out_dir / "config.yaml").write_text(cfg.dump())
            if trainer.auto_decision is not None:
                automode.write_decision(trainer.out_dir, trainer.auto_decision)
        logger = RunLogger(trainer.out_dir, info.is_main, cfg.log.wandb, cfg.log.project,
                           cfg.log.run_name or trainer.out_dir.name, cfg.log.group,
                           {**cfg.to_dict(), "arm": arm_label(cfg.to_dict(), info.world_size)},
                           run_id=run_id(trainer.out_dir))
    except BaseException:
        trainer.release()
        raise
    if trainer.auto_decision is not None:
        automode.log_decision(logger, trainer.step, trainer.auto_decision)
    if found is not None:
        logger.log({"step": trainer.step, "event": "resume", "checkpoint": str(found[0]),
                    "world_size": info.world_size})
    return logger


def save(trainer) -> Path:
    rank, world = trainer.info.rank, trainer.info.world_size
    # state every rank shares (gradient sync) is written once, by rank 0; a sharded run's state is
    # its shards' (different on every shard rank), kept per rank
    shared = not trainer.parallel.sharded and shares_optimizer_state(trainer.optimizer, world)
    opt = split_optimizer_state(trainer.optimizer.state_dict(), rank, shared)
    rank_state = {"optimizer": opt, "loader": trainer.loader.state_dict(),
                  "rng": rng_state(), "step": trainer.step, "train_time": trainer.train_time,
                  "skip_batches": sorted(trainer.skip_batches), "schedule_steps": trainer.schedule_steps,
                  "tokens_seen": trainer.tokens_seen}
    meta = {"step": trainer.step, "world_size": trainer.info.world_size, "config": trainer.cfg.to_dict(),
            "tokens_seen": trainer.tokens_seen,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "shard_size": trainer.parallel.shard_size}
    if shared:
        meta[SHARED] = rank_file(0)
    # a background save (train.async_ckpt) where the save is not the run's last and no replaced run waits
    # for a verified checkpoint; a sharded model's DCP save stays in the foreground (its own collectives)
    background = (trainer.cfg.train.async_ckpt and not trainer.parallel.sharded
                  and trainer.step < trainer.cfg.train.max_steps
                  and not any(p.name.startswith(REPLACED) for p in trainer.out_dir.iterdir()))
    if background:
        return save_checkpoint_async(trainer.ckpt_root, trainer.step, trainer.model.state_dict(), rank_state, meta,
                                     rank, world, trainer.cfg.train.keep_ckpts)
    wait_pending(trainer.ckpt_root, world)
    if trainer.parallel.sharded:  # every rank writes its model shards (DCP); its file holds its shards'
        # optimizer state (per-replica state is per rank, never merged)
        sharded_checkpoint.check_finite(trainer.model, trainer.step)
        meta["sharded_model"] = sharded_checkpoint.MODEL_DIR
        path = save_checkpoint(trainer.ckpt_root, trainer.step, None, rank_state, meta, trainer.info.rank,
                               trainer.info.world_size, trainer.cfg.train.keep_ckpts,
                               write_sharded=sharded_checkpoint.writer(trainer.model, trainer.info.rank))
    else:
        path = save_checkpoint(trainer.ckpt_root, trainer.step, trainer.model.state_dict(), rank_state, meta,
                               trainer.info.rank, trainer.info.world_size, trainer.cfg.train.keep_ckpts)
    if trainer.info.is_main and any(p.name.startswith(REPLACED) for p in trainer.out_dir.iterdir()):
        verify(path, list(read_meta(path)["files"]))  # read back: only a verified checkpoint retires the old run
        for gone in drop_replaced(trainer.out_dir):
            trainer.logger.console(f"removed {gone} (the replaced run): checkpoint {path} is verified")
    return path


def finish(trainer) -> dict:
    """The normal end of a run at train.max_steps: the strategy's end of training, the final
    evaluation, the check that every rank holds the same parameters, and the last checkpoint;
    returns fit()'s result."""
    # a local-update scheme ends its outer loop here (in-flight averages applied, every replica
    # on the global parameters), so the final evaluation, digests and checkpoint see that model;
    # what its end sends belongs to no step: a record of its own books it
    finished = trainer.optimizer.strategy.finish(trainer.optimizer)
    if finished is not None:
        trainer.logger.log(finish_record(trainer, finished))
    last_eval = trainer._eval_and_log()
    digests = parallel.param_digests(trainer.model, trainer.parallel, trainer.info.world_size)
    trainer.logger.log({"step": trainer.step, "param_sha256": digests, "params_identical": len(set(digests)) == 1})
    if len(set(digests)) != 1:
        raise RuntimeError(f"parameters differ across ranks after step {trainer.step}: {digests}")
    path = trainer.save()
    mesh = trainer.parallel.describe()
    trainer.logger.console(f"done: {trainer.step} steps, val loss {last_eval:.4f}, parameters bit-identical on "
                           f"{trainer.info.world_size} rank(s)" + (f" (mesh {mesh}: whole tensors compared, every "
                                                                  f"replica's the same)" if mesh else "")
                           + f", checkpoint {path}")
    return {"step": trainer.step, "val_loss": last_eval, "stopped": False}


def load(trainer, path: Path, meta: dict, files: dict) -> str:
    """Restore `trainer` from a verified checkpoint (find_resumable's result); returns the line to print.
    Collective: the ranks agree before any trains on, so a rank that cannot restore (a state this run cannot
    take, an old rank's file that changed after the check) stops every rank with its message instead of
    leaving the others waiting in the first collective of training."""
    try:
        line, err = _load_here(trainer, path, meta, files), None
    except (CheckpointError, ConfigError) as e:
        line, err = "", e
    said = _gather((isinstance(err, ConfigError), str(err)) if err is not None else None, trainer.info.world_size)
    failed = [(r, s) for r, s in enumerate(said) if s is not None]
    if not failed:
        return line
    if err is not None:
        raise err
    r, (config, msg) = failed[0]
    raise (ConfigError if config else CheckpointError)(f"rank {r}: {msg}")


def _load_here(trainer, path: Path, meta: dict, files: dict) -> str:
    """This rank's part of `load`."""
    rank, world = trainer.info.rank, trainer.info.world_size
    saved = int(meta["world_size"])
    if remeshes(meta, world, trainer.parallel.shard_size):
        return _load_remeshed(trainer, path, meta, files, int(meta.get("shard_size", 1)))
    try:
        if meta.get("sharded_model"):
            sharded_checkpoint.load_model(trainer.model, path)
        else:
            trainer.model.load_state_dict(files[MODEL])
        if saved == world:
            mine = files[rank_file(rank)]
            trainer.optimizer.load_state_dict(optimizer_state(files, meta, rank_file(rank)))
            note = ""
        else:
            mine = files[rank_file(min(rank, saved - 1))]
            trainer.optimizer.load_resharded(iter(RankStates(path, meta, files)))  # one old rank at a time
            how = ("the optimizer state every rank shared (gradient sync) carried over" if meta.get(SHARED) else
                   "per-rank optimizer state averaged once, i.e. one momentum synchronisation")
            note = (f" (written by {saved} ranks, resumed on {world}: {how}; data continues at the same global "
                    f"token position)")
    except CheckpointError:  # a file read again (RankStates): not a state this run cannot take
        raise
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # a state this run's optimizer cannot take
        raise _cannot_restore(path, e, f"resume on the {saved} rank(s) it was written with" if saved != world else
                              "resume with the optim / comm settings it was written with") from None
    _restore_progress(trainer, mine, saved == world)
    return f"resumed from {path} at step {trainer.step}{note}" + batch_note(trainer, meta)


def _cannot_restore(path: Path, e: Exception, fix: str) -> CheckpointError:
    """One line for a checkpoint this run's model or optimizer cannot take: the error's first line and `fix`."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CheckpointError(f"checkpoint {path} cannot be restored by this run: {first}; {fix}, or start a new run "
                           f"(another train.out_dir, or train.resume=overwrite)")


def _restore_progress(trainer, mine: dict, same_world: bool) -> None:
    """What every resume keeps, on any mesh (one home, so the paths cannot drift apart): the data
    position, step, time, skipped batches, tokens seen, the lr schedule's horizon, and the RNG
    states when the world size is unchanged (rank r then continues rank r's generators)."""
    trainer.loader.load_state_dict(mine["loader"])  # a global position: the same in every rank's file
    if same_world:
        set_rng_state(mine["rng"])
    trainer.step, trainer.train_time = int(mine["step"]), float(mine.get("train_time", 0.0))
    trainer.skip_batches = set(mine.get("skip_batches", []))
    trainer.tokens_seen = int(mine.get("tokens_seen", trainer.step * trainer.tokens_per_step))
    if "schedule_steps" in mine and not trainer.cfg.optim.schedule_steps:  # keep the run's lr schedule
        trainer.schedule_steps = int(mine["schedule_steps"])


class RankStates(Sequence):
    """The whole optimizer state (checkpoint.optimizer_state) of each rank a checkpoint was written
    by, in rank order, read when indexed: from `files` where find_resumable kept the file, else
    loaded from the checkpoint (verified again) and not kept, so combining every old rank's state
    holds one of them at a time (trainer/checkpoint.py files_kept)."""

    def __init__(self, path: Path, meta: dict, files: dict) -> None:
        self.path, self.meta, self.files = path, meta, files

    def __len__(self) -> int:
        return int(self.meta["world_size"])

    def __getitem__(self, q: int) -> dict:
        if not 0 <= q < len(self):
            raise IndexError(q)
        name, shared = rank_file(q), self.meta.get(SHARED)
        missing = [n for n in (name, shared) if n and n not in self.files]
        try:
            files = {**self.files, **load_verified(self.path, missing)[0]} if missing else self.files
        except CheckpointError as e:
            raise CheckpointError(f"{e} (it was intact when the resume checked it: it changed since; resume "
                                  f"again)") from None
        return optimizer_state(files, self.meta, name)

    def __iter__(self) -> Iterator[dict]:
        # not Sequence's: that keeps the last state it yielded while it reads the next
        return (self[q] for q in range(len(self)))


def _load_remeshed(trainer, path: Path, meta: dict, files: dict, saved_shard: int) -> str:
    """Resume on another mesh (shard size or world size) where one side is sharded: the model from
    its DCP shards or model.pt, the optimizer state joined per old replica and cut for this rank
    (sharded_checkpoint.remesh_optimizer_state); a config error naming the saved mesh when the
    optimizer's state cannot be mapped."""
    rank, world, par = trainer.info.rank, trainer.info.world_size, trainer.parallel
    saved = int(meta["world_size"])
    try:
        opt = sharded_checkpoint.remesh_optimizer_state(
            RankStates(path, meta, files), saved_shard, par.shard_size, par.replicas,
            rank // par.shard_size, rank % par.shard_size, rank // par.shard_size if par.sharded else rank,
            # how this run's optimizer splits its state (Muon, Dion); the others: dim 0 like their parameters
            getattr(trainer.optimizer, "state_shard_dims", dict)(), getattr(trainer.optimizer, "exchange", None))
    except CheckpointError:  # a file read again (RankStates): not a mesh this run cannot take
        raise
    except ValueError as e:
        raise ConfigError(f"checkpoint {path} (parallel.shard_size={saved_shard} on {saved} ranks) cannot resume on "
                          f"parallel.shard_size={par.shard_size} on {world} ranks: {e}; resume with "
                          f"parallel.shard_size={saved_shard} on {saved} ranks") from None
    try:
        if meta.get("sharded_model"):
            sharded_checkpoint.load_model(trainer.model, path)
        else:
            model_state = files[MODEL] if MODEL in files else load_verified(path, [MODEL])[0][MODEL]
            sharded_checkpoint.load_full_model(trainer.model, model_state)
        trainer.optimizer.load_state_dict(opt)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, RuntimeError) as e:  # a state this run's optimizer cannot take
        raise _cannot_restore(path, e, f"resume with the optim / comm settings it was written with, on its mesh "
                                       f"(parallel.shard_size={saved_shard} on {saved} ranks)") from None
    mine = files[rank_file(min(rank, saved - 1))]
    _restore_progress(trainer, mine, saved == world)  # lr horizon, tokens seen, data position, RNG: as same-mesh
    old_r, new_r = saved // saved_shard, par.replicas
    how = ("each replica's state as saved" if old_r == new_r else
           "the one saved replica's optimizer state, copied to every replica" if old_r == 1 else
           "the replicas' optimizer state, identical under gradient sync, carried over"
           if shares_optimizer_state(trainer.optimizer, max(old_r, new_r)) else
           "per-replica optimizer state averaged once over the saved replicas (one momentum synchronisation)")
    return (f"resumed from {path} at step {trainer.step} (written as {old_r} x {saved_shard} (replicas x shard size), "
            f"resumed as {new_r} x {par.shard_size}: {how})" + batch_note(trainer, meta))


def batch_note(trainer, meta: dict) -> str:
    """A resume whose global batch differs from the checkpoint's (another world size, batch size, sequence
    length or accumulation): what it was and is (a resume may not change data.grad_accum: the checkpoint's
    world size keeps the batch)."""
    d = (meta.get("config") or {}).get("data") or {}
    try:
        saved = int(d["batch_size"]) * int(d["seq_len"]) * int(d.get("grad_accum", 1)) * int(meta["world_size"])
    except (KeyError, TypeError, ValueError):
        return ""
    now = trainer.tokens_per_step
    if saved == now:
        return ""
    return (f"\nwarning: the global batch is now {now:,} tokens a step, the checkpoint's run used {saved:,}: the steps "
            f"from here are not like the steps before (loss per step, lr schedule per token); resume on the checkpoint's "
            f"{int(meta['world_size'])} rank(s) to keep it")


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
    wait_pending(trainer.ckpt_root, trainer.info.world_size)  # a background save in flight is a candidate
    rolls = policy == "rollback" and trainer.rollbacks < MAX_ROLLBACKS
    found = find_resumable(trainer.ckpt_root, trainer.info.rank, trainer.info.world_size, trainer._say,
                           trainer.parallel.shard_size) if rolls else None
    if found is None:
        why = ("no checkpoint to roll back to" if rolls else
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
