"""Reading checkpoint files safely: the one home of the rule, used by the trainer's resume and
rollback (trainer/checkpoint.py) and by every reader of a trained model (model/load.py: export,
sample, eval), so that a file is never trusted by one reader and checked by another.

A checkpoint is a directory step_NNNNNN/ holding model.pt, one rank_NNNNN.pt per rank and
meta.json, written last, with every file's sha256 (and, where the optimizer state is shared by
every rank, `optimizer_shared`: the listed file holding it once). A reader
- verifies meta.json and the sha256 of each file it reads (`verify`): this proves the bytes are
  the ones written, not who wrote them, since whoever can write a file can write meta.json too;
  and that meta.json lists every file in the directory: a file the save did not record is refused
  by name, so no library reads a file nobody checked (DCP would read an added `.metadata`);
- therefore loads every file with torch.load(weights_only=True) (`safe_load`): tensors, numbers,
  strings, None and lists / tuples / dicts of them. A pickle naming any other Python object
  (a function to call, a class to build) is refused before anything of it runs;
  a sharded run's DCP `.metadata` (a pickle too) is read by model/dcp_metadata.py's allow-list of
  the types DCP writes, never by the unrestricted unpickling DCP does itself;
- checks that no floating tensor holds NaN or inf (`nonfinite_keys`);
- falls back to the newest intact checkpoint of a run (`newest_intact_model`), saying which
  ones it skipped and why.
Every failure (missing, truncated, garbled, foreign pickle, non-finite) is a CheckpointError
whose message is one line naming the file.

Checkpoints written before RNG state was stored as tensors hold numpy's generator state as an
ndarray; `LEGACY_GLOBALS` admits numpy's array reconstruction and its dtypes, nothing else.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from util.files import FileShapeError, read_json_object

META = "meta.json"
MODEL = "model.pt"

# numpy's array reconstruction and dtypes (an ndarray of numbers; object arrays would need more
# globals, which stay refused): what the numpy RNG state of older checkpoints needs
LEGACY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


class CheckpointError(ValueError):
    """A checkpoint cannot be written or no intact one can be read; the message says which and why."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def safe_load(path: Path) -> Any:
    """torch.load(weights_only=True) of a checkpoint file on the CPU; CheckpointError (one line,
    naming the file) for a file that is unreadable, truncated or holds anything but plain data."""
    try:
        with torch.serialization.safe_globals(LEGACY_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # noqa: BLE001 - every failure of an untrusted file becomes one line
        text = str(e)
        if "Weights only load failed" in text or "weights_only" in text:
            named = re.search(r"GLOBAL ([\w.]+)", text)
            what = f"names the Python object {named.group(1)}" if named else "names Python objects"
            raise CheckpointError(f"{path}: refused to load: a checkpoint may hold only tensors and plain data, and "
                                  f"this file {what}; nothing of it was run. It was not written by this tool, or "
                                  f"was altered after") from None
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        raise CheckpointError(f"{path} is unreadable, truncated or corrupt ({type(e).__name__}: {first[:200]})") \
            from None


def nonfinite_keys(obj: Any, prefix: str = "") -> list[str]:
    """Paths of floating tensors in a nested state holding NaN or inf (empty when all finite)."""
    bad = []
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() and not bool(torch.isfinite(obj).all()):
            bad.append(prefix or "<tensor>")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            bad += nonfinite_keys(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            bad += nonfinite_keys(v, f"{prefix}[{i}]")
    return bad


def step_dirs(ckpt_root: Path) -> list[Path]:
    """step_* directories in step order (numeric: names past 999,999 steps still sort right)."""
    if not ckpt_root.is_dir():
        return []
    dirs = [p for p in ckpt_root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def candidates(ckpt_root: Path) -> list[Path]:
    """Checkpoint directories to try, newest first (`latest`'s target first)."""
    dirs = list(reversed(step_dirs(ckpt_root)))
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        named = ckpt_root / pointer.read_text().strip()
        if named in dirs:
            dirs.remove(named)
            dirs.insert(0, named)
    return dirs


def read_meta(path: Path) -> dict:
    """meta.json of a checkpoint, or CheckpointError naming what is wrong with it."""
    f = path / META
    if not f.is_file():
        raise CheckpointError(f"{f} is missing (the save did not complete)")
    try:  # every key a reader uses, of the type it uses it as: a wrong shape is one line, not a TypeError
        meta = read_json_object(f, {"step": int, "world_size": int},
                                optional={"files": dict, "config": dict, "sharded_model": str, "shard_size": int,
                                          "tokens_seen": int, "finite": bool, "optimizer_shared": str})
    except FileShapeError as e:
        raise CheckpointError(str(e)) from None
    bad = [k for k, v in (meta.get("files") or {}).items() if not (isinstance(k, str) and isinstance(v, str))]
    shared = meta.get("optimizer_shared")
    if shared is not None and shared not in (meta.get("files") or {}):  # a file every rank reads: one it verifies
        raise CheckpointError(f"{f}: optimizer_shared names {shared!r}, which its files do not list")
    if bad or meta["world_size"] < 1:
        raise CheckpointError(f"{f}: {'files maps ' + repr(bad[0]) + ' to no sha256' if bad else 'world_size < 1'}")
    return meta


def files_in(path: Path) -> list[str]:
    """Every file under checkpoint directory `path`, as a path relative to it (hidden ones included)."""
    return sorted(f.relative_to(path).as_posix() for f in path.rglob("*") if not f.is_dir())


def verify(path: Path, names: Iterable[str]) -> dict:
    """meta.json, and the checksums of `names` against it; CheckpointError naming the first bad
    file, or naming a file in the directory that meta.json does not list."""
    meta = read_meta(path)
    sums = meta.get("files")
    if not isinstance(sums, dict):
        raise CheckpointError(f"{path / META} has no file checksums (written by an older version); "
                              f"it cannot be verified")
    unlisted = sorted(set(files_in(path)) - set(sums) - {META})
    if unlisted:  # nothing in a checkpoint is read, by us or by a library, unless its save recorded it
        raise CheckpointError(f"{path / unlisted[0]} is not listed in {path / META}: a checkpoint may hold only "
                              f"the files its save recorded (with their sha256); remove the file, or restore the "
                              f"checkpoint")
    for name in names:
        f = path / name
        if name not in sums:
            raise CheckpointError(f"{f} is not listed in {path / META}")
        if not f.is_file():
            raise CheckpointError(f"{f} is missing")
        got = sha256_file(f)
        if got != sums[name]:
            raise CheckpointError(f"{f} is corrupt: sha256 {got[:12]}... differs from the {sums[name][:12]}... "
                                  f"recorded when it was written")
    return meta


def load_verified(path: Path, names: Iterable[str]) -> tuple[dict[str, Any], dict]:
    """({name: contents}, meta) of checkpoint `path` after `verify`, each file loaded by
    `safe_load` and checked finite; CheckpointError naming the first bad file."""
    names = list(names)
    meta = verify(path, names)
    files = {}
    for n in names:
        files[n] = safe_load(path / n)
        bad = nonfinite_keys(files[n])
        if bad:
            raise CheckpointError(f"{path / n} holds non-finite values in {', '.join(bad[:3])}"
                                  + (" ..." if len(bad) > 3 else ""))
    return files, meta


def sharded_files(path: Path, meta: dict) -> list[str]:
    """The DCP files (relative to checkpoint `path`) that meta.json lists for a sharded model."""
    sub = meta.get("sharded_model")
    if not isinstance(sub, str) or not sub or "/" in sub or sub.startswith("."):
        raise CheckpointError(f"{path / META}: sharded_model {sub!r} is not a directory name of the checkpoint")
    return sorted(n for n in meta.get("files", {}) if n.startswith(sub + "/"))


def check_sharded_metadata(path: Path, meta: dict) -> None:
    """Read a sharded checkpoint's DCP `.metadata` safely (model/dcp_metadata.py) and check it;
    CheckpointError naming the file. (Its checksum is checked by `verify`.)"""
    from .dcp_metadata import METADATA, MetadataError, read_metadata

    sub = meta["sharded_model"]
    listed = sharded_files(path, meta)
    if f"{sub}/{METADATA}" not in listed:
        raise CheckpointError(f"{path / sub / METADATA} is not listed in {path / META}")
    try:
        read_metadata(path / sub, [n[len(sub) + 1:] for n in listed])
    except MetadataError as e:
        raise CheckpointError(str(e)) from None


def load_model_state(path: Path) -> tuple[dict, dict]:
    """(model state dict, meta) of checkpoint `path`: model.pt through `load_verified`, or, from a
    sharded run (meta["sharded_model"] names the directory), its torch.distributed.checkpoint
    shard files, each verified against its checksum, gathered into whole tensors (no process
    group needed; a weight tied to the embedding is stored once) and checked finite."""
    meta = read_meta(path)
    sub = meta.get("sharded_model")
    if not sub:
        files, meta = load_verified(path, [MODEL])
        return files[MODEL], meta
    listed = sharded_files(path, meta)
    verify(path, listed)
    from .dcp_metadata import MetadataError, load_state

    try:
        state = load_state(path / sub, [n[len(sub) + 1:] for n in listed])
    except MetadataError as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - DCP failing on verified files: one line naming the directory
        raise CheckpointError(f"{path / sub} could not be read ({type(e).__name__}: {str(e).strip()[:200]})") \
            from None
    state = state.get("model", state)
    bad = nonfinite_keys(state)
    if bad:
        raise CheckpointError(f"{path / sub} holds non-finite values in {', '.join(bad[:3])}")
    return state, meta


def newest_intact_model(ckpt_root: Path, report: Callable[[str], None]) -> tuple[Path, dict, dict]:
    """(checkpoint dir, model state dict, meta) of the newest checkpoint under `ckpt_root` whose
    model.pt verifies; each newer damaged one is reported (`report`) with its problem.
    CheckpointError when none is intact."""
    tried = []
    for path in candidates(ckpt_root):
        try:
            state, meta = load_model_state(path)
        except CheckpointError as e:
            tried.append(f"{path.name}: {e}")
            continue
        for t in tried:
            report(f"skipped checkpoint {t}")
        if tried:
            report(f"using checkpoint {path} (the newest intact one)")
        return path, state, meta
    if tried:
        raise CheckpointError(f"no intact checkpoint in {ckpt_root}: " + "; ".join(tried))
    raise CheckpointError(f"{ckpt_root} holds no checkpoint (no step_* directory); train with "
                          f"train.ckpt_every > 0 or until the end")
