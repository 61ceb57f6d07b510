"""The run directory policy: refuse, replace or resume `train.out_dir`, and the run's identity.

- train.resume=never: an existing non-empty directory is refused (nothing is touched);
- overwrite: only a directory the trainer made (its marker `.lioncub_run`, or the `run_id` file of
  older versions) holding nothing but the trainer's own entries (RUN_ENTRIES; in a checkpoint's
  step directory, the files its meta.json lists; in tensorboard/, profile/, memory/ and at wandb/'s
  top level, the names their writers give: WRITER_FILES), and that no live
  run holds, is started afresh; any other entry is named and the directory refused. The replaced
  run's entries are moved aside into `.replaced-<time>/` inside it, not deleted, and removed only
  once the new run's first checkpoint is written and verified (`drop_replaced`);
- auto on a non-empty directory the trainer did not make is refused as well (it would write its
  config.yaml and metrics.jsonl over someone else's files);
- auto: continue from the newest intact checkpoint (trainer/checkpoint.py verifies checksums and
  falls back to older ones); a checkpoint whose config differs in keys a resumed run may not
  change is refused, listing them. The world size may change (the trainer remaps the state).
Rank 0 decides and holds the directory's lock (trainer/runlock.py: one live run per directory)
for the run's life; every rank learns the outcome through one tiny collective. Temp directories
of checkpoint saves that were killed are removed.

A run's id (in the marker, and in `run_id`) is made when the directory is (re)created: a hash of
the resolved path and the creation time, so wandb runs are unique per directory and a replaced
directory gets a new one; a resumed run reads it back.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from model.checkpoint_files import candidates, files_in

from .checkpoint import CheckpointError, clean_partial, foreign_in_step, read_meta, step_dirs
from .dist import DistInfo, all_agree
from .profiling import MEMORY_DIR, PROFILE_DIR
from .automode import DECISION
from .runlock import LOCK, LockError, RunLock

# keys a resumed run may change; anything else must match the checkpoint's config
RESUMABLE_KEYS = ("train.max_steps", "train.stop_after", "train.profile", "train.memory_snapshot", "train.resume", "train.eval_every",
                  "train.eval_steps", "train.ckpt_every", "train.keep_ckpts", "train.async_ckpt", "train.log_every",
                  "train.out_dir", "train.device", "train.mc_eval", "train.on_nonfinite", "train.max_skipped_steps",
                  "data.cache_dir", "comm.timeout_s", "comm.init_timeout_s", "comm.kernels", "comm.fine_timing",
                  "comm.auto_", "log.", "diag.", "optim.schedule_steps", "model.init_from",
                  "model.activation_checkpointing",
                  "parallel.")  # the mesh: trainer/state.py load decides what it can resume
MARKER = ".lioncub_run"  # written by the trainer when it creates a run directory: {"run_id", "created"}
LEGACY_MARKER = "run_id"  # what older versions wrote at creation
REPLACED = ".replaced-"  # prefix of a replaced run's entries, kept until the new run's first verified checkpoint
# every entry the trainer (and its logger, wandb, the memory profiler) writes in a run directory
RUN_ENTRIES = (MARKER, LEGACY_MARKER, LOCK, "config.yaml", "metrics.jsonl", "ckpt", "wandb", "memory_snapshot.pickle",
               DECISION, DECISION + ".tmp", "provenance.json", "provenance.json.tmp", "tensorboard", PROFILE_DIR, MEMORY_DIR)
CKPT_ENTRIES = ("latest", "latest.tmp")  # besides step_NNNNNN/ and the temp dirs of killed saves
# what the trainer's writers put in their directories of a run: a user's file in one of them is named by
# overwrite, never moved aside and deleted with the writer's own. (pattern, every file below or only the
# top-level names): wandb's run directories are wandb's store, their contents are not checked.
WRITER_FILES = {
    "tensorboard": (re.compile(r"events\.out\.tfevents\.[^/]+"), True),           # SummaryWriter (log.tensorboard)
    PROFILE_DIR: (re.compile(r"rank\d+\.steps_\d+-\d+\.pt\.trace\.json"), True),  # StepHooks._write_trace
    MEMORY_DIR: (re.compile(r"rank\d+\.pickle"), True),                           # StepHooks._write_snapshot
    # wandb: run-<date>_<time>-<run id>; the trainer's ids hold the run directory's name (new_run_id)
    "wandb": (re.compile(r"latest-run|debug(-internal|-cli\.[^/]+)?\.log|(offline-)?run-\d{8}_\d{6}-[^/]+"), False),
}


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
    """Why a checkpoint train.resume=auto may load cannot be resumed with this config ("" if none exists or
    each can). Every checkpoint whose meta.json reads is checked, newest first: the newest may be damaged,
    and the fallback then loads an older one (whether its files are intact is checked when loading)."""
    from .config import Config

    defaults = flatten(Config().to_dict())  # a key added since the checkpoint was written, at its default, is no change
    new = flatten(config)
    for path in candidates(ckpt_root):
        try:
            old = flatten(read_meta(path).get("config", {}))
        except CheckpointError:
            continue  # reported, with the fallback, when loading
        changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                   if old.get(k) != new.get(k) and not k.startswith(RESUMABLE_KEYS)
                   and not (k not in old and k in defaults and new.get(k) == defaults[k])]
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


def is_ours(out_dir: Path) -> bool:
    """The trainer made this directory (its marker, or an older version's run_id file)."""
    return (out_dir / MARKER).is_file() or (out_dir / LEGACY_MARKER).is_file()


def foreign_entries(out_dir: Path) -> list[str]:
    """Entries of `out_dir`, of its ckpt/ and of its step directories the trainer did not write, as
    paths relative to it (train.resume=overwrite moves them aside and later deletes them)."""
    out = [p.name for p in out_dir.iterdir()
           if p.name not in RUN_ENTRIES and not p.name.startswith((REPLACED, LOCK + "."))]  # .lock.PID.tmp: a takeover
    for name, (pattern, below) in WRITER_FILES.items():
        d = out_dir / name
        if d.is_symlink() or (d.exists() and not d.is_dir()):  # its target is not checked: named instead
            out.append(f"{name} ({'a symlink' if d.is_symlink() else 'not a directory'})")
        elif d.is_dir():
            inside = files_in(d) if below else [p.name for p in d.iterdir()]
            out += [f"{name}/{f}" for f in inside if not pattern.fullmatch(f)]
    ckpt = out_dir / "ckpt"
    if ckpt.is_dir() and not ckpt.is_symlink():
        saved = {p.name for p in step_dirs(ckpt) if not p.is_symlink()}  # step_<digits>: step_000004_keep is not
        for p in sorted(ckpt.iterdir()):
            if p.name in CKPT_ENTRIES:
                continue
            if p.name in saved:  # a saved step: the files its meta.json does not list
                out += [f"ckpt/{p.name}/{name}" for name in foreign_in_step(p)]
            elif not (p.name.startswith((".tmp_step_", ".old_step_")) and p.is_dir() and not p.is_symlink()):
                # (a killed save's temp directory, any writer's temp files inside, is the trainer's own and
                # removed at every start: clean_partial)
                out.append(f"ckpt/{p.name}")
    elif ckpt.exists():
        out.append("ckpt (not a directory)")
    return sorted(out)


def check_run_dir(out_dir: Path, resume: str, info: DistInfo) -> None:
    """The refusals of `prepare_run_dir` that the directory alone decides (it exists under resume=never,
    it is not the trainer's, overwrite would move a user's file), without touching it: run before a long
    start-up (comm.mode=auto's measurements) so a refusal comes at once. Collective; RunDirError on every
    rank. prepare_run_dir decides again, with the config, when the run opens the directory."""
    problem = _refusal(out_dir, resume) if info.is_main else ""
    if all_agree(bool(problem), info.device):
        raise RunDirError(problem or f"rank 0 refused the run directory {out_dir}")


def _refusal(out_dir: Path, resume: str) -> str:
    exists = out_dir.exists() and any(p.name != LOCK for p in out_dir.iterdir())
    if exists and resume == "never":
        return (f"run directory {out_dir} already exists and is not empty; pass train.resume=auto to continue it, "
                f"train.resume=overwrite to replace it, or choose another train.out_dir")
    if exists and not is_ours(out_dir):
        names = sorted(p.name for p in out_dir.iterdir())
        return (f"train.resume={resume} refuses {out_dir}: it is not empty and holds no {MARKER} marker, so the "
                f"trainer did not make it ({', '.join(names[:8])}{' ...' if len(names) > 8 else ''}); nothing was "
                f"touched. Choose another train.out_dir")
    if exists and resume == "overwrite":
        foreign = foreign_entries(out_dir)
        if foreign:
            # a run of a variant composed over this run's config lives inside it (config_load: <out_dir>/<variant>)
            nested = [f for f in foreign if "/" not in f and is_ours(out_dir / f)]
            why = (f" ({', '.join(nested)}: another run's directory; a variant file composed over this config "
                   f"trains in <out_dir>/<variant>)" if nested else "")
            return (f"train.resume=overwrite refuses to replace {out_dir}: it holds entries the trainer did not write: "
                    f"{', '.join(foreign[:8])}{' ...' if len(foreign) > 8 else ''}{why}; nothing was touched. Move "
                    f"them out, or choose another train.out_dir")
    return ""


def _decide(out_dir: Path, resume: str, config: dict) -> tuple[str, RunLock | None]:
    refused = _refusal(out_dir, resume)
    if refused:
        return refused, None
    exists = out_dir.exists() and any(p.name != LOCK for p in out_dir.iterdir())
    if resume == "auto":
        problem = resume_problem(out_dir / "ckpt", config)
        if problem:
            return problem, None
    try:
        lock = RunLock(out_dir)
        note = lock.acquire()  # LockError when a live run holds it: nothing below runs
    except OSError as e:
        return _unwritable(out_dir, e), None
    if note:
        print(f"{out_dir}: {note}", flush=True)
    try:
        if exists and resume == "overwrite":  # only now: a live run's directory is never touched
            aside = out_dir / f"{REPLACED}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            aside.mkdir()
            moved = [p for p in out_dir.iterdir() if p.name != LOCK and p != aside and not p.name.startswith(REPLACED)]
            for p in moved:
                os.replace(p, aside / p.name)
            print(f"{out_dir}: the replaced run's {len(moved)} entries were moved to {aside.name}/; they are "
                  f"removed once this run's first checkpoint is verified", flush=True)
        removed = clean_partial(out_dir / "ckpt")
        if removed:
            print(f"{out_dir}: removed {len(removed)} leftover temp file(s) of killed checkpoint saves: "
                  f"{', '.join(p.name for p in removed)}", flush=True)
        if not is_ours(out_dir):
            rid = new_run_id(out_dir)
            (out_dir / LEGACY_MARKER).write_text(rid + "\n")
            (out_dir / MARKER).write_text(json.dumps({"run_id": rid, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                      "by": "lioncub train.py"}) + "\n")
    except OSError as e:
        lock.release()
        return _unwritable(out_dir, e), None
    return "", lock


def _unwritable(out_dir: Path, e: OSError) -> str:
    return (f"cannot write the run directory {out_dir}: {e.strerror or e} ({e.filename or out_dir}); point "
            f"train.out_dir at a writable directory")


def drop_replaced(out_dir: Path) -> list[Path]:
    """Remove the entries of runs this directory's run replaced (call once its first checkpoint is
    verified); returns what was removed."""
    gone = [p for p in out_dir.iterdir() if p.name.startswith(REPLACED) and p.is_dir() and not p.is_symlink()]
    for p in gone:
        shutil.rmtree(p)
    return gone


def run_id(out_dir: Path) -> str:
    try:
        return str(json.loads((out_dir / MARKER).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        path = out_dir / LEGACY_MARKER
        return path.read_text().strip() if path.is_file() else new_run_id(out_dir)
