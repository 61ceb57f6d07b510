"""data.prepare's resumable writer and output directory: documents routed into train/val shards
within a token budget, a progress record after every shard (so a rerun continues byte for
byte), the `.<out>.partial/` work directory with its lock, and the overwrite rule (only a
directory data.prepare made)."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np

from data.shards import (MANIFEST, SPLITS, DataError, PrepareError, ShardWriter, is_shard_name, read_header_info)
from data.sources import Batch
from data.tokenizer import FILE_TOKENIZER
from util import atomic_write, pid_alive

PROGRESS = "progress.json"
LOCK = "prepare.lock"


# ----------------------------------------------------------------------------- writing, resumable

class PrepareStopped(PrepareError):
    """Raised by the `stop_after_shards` test hook, as if the run had been interrupted."""


class Writer:
    """Routes a source's documents into train/val ShardWriters, within the token budget, and
    records progress after every completed shard. Progress = the stream position (document,
    offset), the source's restart state, counts, and each writer's completed shards + how many
    tokens of its unfinished shard are in its side file; everything before the position is on
    disk, nothing after it. Resuming from a record therefore writes the same bytes as a run that
    never stopped."""

    def __init__(self, work: Path, plan: dict, source: Any, dtype: np.dtype, shard_tokens: int,
                 val_tokens: int, max_tokens: int | None, stop_after_shards: int | None):
        self.work, self.plan, self.source = work, plan, source
        self.writers = {s: ShardWriter(work, s, shard_tokens, dtype) for s in SPLITS}
        self.val_tokens = val_tokens  # > 0: the first val_tokens of the stream are val (--val-shards)
        self.max_tokens, self.stop_after = max_tokens, stop_after_shards
        self.cursor: dict | None = None
        self.written = 0
        self.val_taken = 0
        self.docs = [0, 0]  # documents started, by label
        self.empty = 0  # empty documents read
        self.shards_this_run = 0

    def resume(self, record: dict) -> None:
        for s, w in self.writers.items():
            w.resume(record["writers"][s])
        self.cursor = record["cursor"]
        self.written, self.val_taken = record["written"], record["val_taken"]
        self.docs, self.empty = list(record["docs"]), record["empty"]

    def _record(self, cursor: dict, empty: int) -> dict:
        return {"plan": self.plan, "cursor": cursor, "written": self.written, "val_taken": self.val_taken,
                "docs": list(self.docs), "empty": empty,
                "writers": {s: w.persist() for s, w in self.writers.items()}}

    def _checkpoint(self, batch: Batch, pos: int) -> None:
        local, offset = _locate(batch.offsets, pos)
        cursor = {**self.source.position(batch, local), "offset": offset}
        empty = self.empty + _count_empty(batch.offsets[:local + 1])
        atomic_write(self.work / PROGRESS, json.dumps(self._record(cursor, empty)), fsync=True)
        for w in self.writers.values():
            w.discard_side_files()
        self.shards_this_run += 1
        if self.stop_after and self.shards_this_run >= self.stop_after:
            raise PrepareStopped(f"stopped after {self.shards_this_run} shard(s) (stop_after_shards test hook)")

    def run(self, bar: Any) -> int:
        """Write until the source ends or the budget is spent; return the documents read."""
        budget = self.max_tokens if self.max_tokens is not None else float("inf")
        resume_offset = self.cursor["offset"] if self.cursor else 0
        for batch in self.source.batches(self.cursor):
            o, flat, labels = batch.offsets, batch.flat, batch.labels
            starts = o[:-1][o[1:] > o[:-1]]  # first token of each non-empty document
            pos, resume_offset = int(o[0]) + resume_offset, 0
            cuts = np.flatnonzero(np.diff(labels)) + 1  # runs of documents with one label
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(labels)]):
                label, pos, end = int(labels[a]), max(pos, int(o[a])), int(o[b])
                while pos < end:
                    if self.written >= budget:
                        return self._stop(batch, pos)
                    divert = label == 0 and self.val_taken < self.val_tokens
                    w = self.writers["val" if label or divert else "train"]
                    n = int(min(end - pos, w.room, budget - self.written,
                                self.val_tokens - self.val_taken if divert else end))
                    done = w.add(flat[pos:pos + n])
                    self.docs[label] += int(np.searchsorted(starts, pos + n) - np.searchsorted(starts, pos))
                    pos += n
                    self.written += n
                    self.val_taken += n if divert else 0
                    bar.update(n)
                    if done:
                        self._checkpoint(batch, pos)
            if self.written >= budget:
                return self._stop(batch, int(o[-1]))
            self.empty += _count_empty(o)
            self.cursor = {**self.source.position(batch, len(o) - 1), "offset": 0}
        return self.cursor["doc"] if self.cursor else 0

    def _stop(self, batch: Batch, pos: int) -> int:
        local, offset = _locate(batch.offsets, pos)
        self.empty += _count_empty(batch.offsets[:local + 1])
        self.cursor = {**self.source.position(batch, local), "offset": offset}
        return batch.first + local + (1 if offset else 0)

    def finish(self) -> dict:
        """Write the last, shorter shards and a final record; return {split: [shards]}."""
        shards = {s: w.close() for s, w in self.writers.items()}
        atomic_write(self.work / PROGRESS, json.dumps(self._record(self.cursor or {"doc": 0, "offset": 0},
                                                                   self.empty)), fsync=True)
        for w in self.writers.values():
            w.discard_side_files()
        return shards


def _locate(offsets: np.ndarray, pos: int) -> tuple[int, int]:
    """(local document index, offset in it) of stream position `pos` within a batch."""
    local = int(np.searchsorted(offsets, pos, side="right")) - 1
    local = min(local, len(offsets) - 1)
    return local, int(pos - offsets[local]) if local < len(offsets) - 1 else 0


def _count_empty(offsets: np.ndarray) -> int:
    return int(np.count_nonzero(offsets[1:] == offsets[:-1]))


# ----------------------------------------------------------------------------- output directory

def _foreign_entries(d: Path) -> list[str]:
    """Entries of `d` that data.prepare does not write."""
    own = {MANIFEST, MANIFEST + ".partial", PROGRESS, PROGRESS + ".partial", LOCK, FILE_TOKENIZER}
    out = []
    for e in sorted(d.iterdir()):
        name = e.name.removesuffix(".tokens")
        if e.is_dir() or e.is_symlink() or not (is_shard_name(name) or e.name in own):
            out.append(e.name + ("/" if e.is_dir() else ""))
        elif is_shard_name(e.name):  # named like a shard: only a valid header makes it one of ours
            try:
                read_header_info(e)
            except DataError:
                out.append(f"{e.name} (named like a shard, but its header is not one)")
    return out


def check_out(out: str | os.PathLike, overwrite: bool) -> None:
    """Refuse an existing non-empty --out unless --overwrite, and refuse --overwrite of anything
    data.prepare did not make (no manifest.json, or files it never writes): nothing is deleted."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise PrepareError(f"--out {out} exists and is not a directory; pick another --out")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise PrepareError(f"--out {out} exists and is not empty; pass --overwrite to replace it or pick "
                           f"another directory")
    if not (out / MANIFEST).is_file():
        raise PrepareError(f"--overwrite refuses to replace {out}: it holds no {MANIFEST}, so data.prepare did "
                           f"not make it; nothing was deleted — remove it yourself or pick another --out")
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or not {"format", "splits", "tokenizer"} <= set(manifest):
        raise PrepareError(f"--overwrite refuses to replace {out}: its {MANIFEST} is not one data.prepare wrote "
                           f"(no format / splits / tokenizer); nothing was deleted — remove it yourself or pick "
                           f"another --out")
    foreign = _foreign_entries(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise PrepareError(f"--overwrite refuses to replace {out}: besides shards and {MANIFEST} it holds "
                           f"{shown}, which data.prepare never writes; nothing was deleted — move them away "
                           f"or pick another --out")


def _work_dir(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial")


def _take_lock(work: Path) -> None:
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    path = work / LOCK
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
            except (OSError, ValueError):
                holder = {}
            if holder.get("host") == me["host"] and pid_alive(int(holder.get("pid", -1))):
                raise PrepareError(f"another data.prepare (pid {holder['pid']} on {holder['host']}) is writing "
                                   f"{work}; wait for it or stop it") from None
            if holder.get("host") not in (None, me["host"]):
                raise PrepareError(f"{work} is locked by a data.prepare on host {holder['host']} (pid "
                                   f"{holder.get('pid')}); if that run is gone, delete {path}") from None
            path.unlink(missing_ok=True)  # its holder is dead: take over
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return


def open_work(out: Path, plan: dict, restart: bool) -> tuple[Path, dict | None]:
    """The partial-output dir for `out`, locked, and its progress record to resume from (None: a
    fresh start). A partial prepare with other settings is an error unless `restart`."""
    work = _work_dir(out)
    record = None
    if work.exists():
        foreign = _foreign_entries(work) if work.is_dir() else [work.name]
        if foreign:
            raise PrepareError(f"{work} (data.prepare's partial output for --out {out}) holds files it never "
                               f"writes ({', '.join(foreign[:5])}); move it away")
        _take_lock(work)
        path = work / PROGRESS
        if path.is_file() and not restart:
            try:
                record = json.loads(path.read_text())
            except ValueError:
                record = None
            if record is not None and record.get("plan") != plan:
                old = record.get("plan") or {}
                diff = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
                (work / LOCK).unlink(missing_ok=True)
                raise PrepareError(f"{work} holds an interrupted data.prepare with other settings (differs in: "
                                   f"{', '.join(diff)}); rerun with the same options to continue it, or add "
                                   f"--restart to discard it")
        if record is None:  # nothing resumable: start over in a clean dir
            for e in work.iterdir():
                if e.name != LOCK:
                    e.unlink()
    else:
        work.mkdir(parents=True)
        _take_lock(work)
    return work, record
