"""Where data.prepare's documents come from: local files (.txt, .jsonl/.json, .parquet), tokenizing
in memory with datasets.map, and the document sources the resumable writer reads (an indexed
dataset, or a stream with a restart state and a held-out rule)."""
from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.shards import (PrepareError, dtype_for_vocab)
from data.tokenizer import DEFAULT as DEFAULT_TOKENIZER
from data.tokenizer import eot_id, get_encoding

LOCAL_EXTS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


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
    empty = [f for f in files if f.stat().st_size == 0]  # datasets' builders fail on them (StopIteration)
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise PrepareError(f"{empty[0]}{' ...' if len(empty) > 1 else ''}: every input file is empty (0 bytes); "
                           f"give files that hold documents")
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
        try:
            ds = datasets.load_dataset(kind, data_files=paths, split="train", cache_dir=cache_dir,
                                       num_proc=num_proc if num_proc and num_proc > 1 else None, **extra)
        except Exception as e:  # datasets' own errors (a parquet file of no rows: DatasetGenerationError) name no file
            cause = e.__cause__ or e
            raise PrepareError(f"{paths[0]}{' ...' if len(paths) > 1 else ''}: could not be read as {kind} "
                               f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else 'no detail'}); "
                               f"check the file holds {kind} rows with a {field!r} field") from None
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


def count_tokens(tok: Any) -> int:
    import pyarrow.compute as pc

    return sum(int(pc.sum(t.column("n")).as_py() or 0) for t in tok.with_format("arrow").iter(batch_size=65536))


# ----------------------------------------------------------------------------- document sources
#
# Both sources yield Batch objects: consecutive documents' tokens, flat, with their offsets and
# split labels (0 train, 1 val). A position in the token stream is (document index, offset in
# it); `position` adds what the source needs to restart there (progress.json keeps it).

@dataclass
class Batch:
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


class IndexedSource:
    """Tokenized in-memory/arrow datasets, one per split label, read one after the other."""

    streaming = False

    def __init__(self, segments: list[tuple[int, Any]], batch_docs: int = 4096):
        self.segments, self.batch_docs = segments, batch_docs
        self.n_docs = sum(len(ds) for _, ds in segments)

    def batches(self, cursor: dict | None) -> Iterator[Batch]:
        start = cursor["doc"] if cursor else 0
        base = 0
        for label, ds in self.segments:
            table_ds = ds.with_format("arrow")
            for a in range(max(start - base, 0), len(ds), self.batch_docs):
                col = table_ds[a:a + self.batch_docs].column("ids").combine_chunks()
                offsets = col.offsets.to_numpy().astype(np.int64)
                flat = col.flatten().to_numpy(zero_copy_only=False)
                n = len(offsets) - 1
                yield Batch(base + a, flat, offsets - offsets[0], np.full(n, label, dtype=np.uint8))
            base += len(ds)

    def position(self, batch: Batch, local: int) -> dict:
        return {"doc": batch.first + local}


def held_out(doc: int, seed: int, fraction: float) -> int:
    """1 if streamed document `doc` is held out for val: streaming cannot shuffle the whole dataset
    (train_test_split), so a seeded hash of the index picks them, the same documents every run."""
    h = hashlib.blake2b(f"{seed}:{doc}".encode(), digest_size=8).digest()
    return int(int.from_bytes(h, "little") / 2.0 ** 64 < fraction)


class StreamSource:
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

    def batches(self, cursor: dict | None) -> Iterator[Batch]:
        first, skip = 0, 0
        if cursor:
            self.ds.load_state_dict(cursor["state"])
            first, skip = cursor["doc"] - cursor["skip"], cursor["skip"]
        it = iter(self.ds)
        if skip:
            for _ in itertools.islice(it, skip):
                pass
            first += skip
        # until the iterator yields its first row, state_dict() is the initial state, not the
        # loaded one: a stop inside the first batch after a resume must save the loaded state
        loaded = cursor["state"] if cursor and not skip else None
        while True:
            state, loaded = loaded or self.ds.state_dict(), None
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
            yield Batch(first, flat, offsets, labels, state, after)
            first += len(docs)

    def position(self, batch: Batch, local: int) -> dict:
        n = len(batch.offsets) - 1
        if local >= n:
            return {"doc": batch.first + n, "state": batch.state_after, "skip": 0}
        return {"doc": batch.first + local, "state": batch.state, "skip": local}
