"""The token shard format (llm.c / modded-nanogpt) and its reader/writer, plus `DataError`.

A shard file is a header of 256 int32 — magic, version, token count, the rest 0 — followed by the
tokens. Two formats, as llm.c writes them (dev/data/data_common.py):
- magic 20240520, version 1: uint16 tokens (GPT-2's 50257 ids fit); what we write whenever the
  tokenizer's ids fit in 16 bits, so every shard written before uint32 support still loads;
- magic 20240801, version 7: uint32 tokens (llm.c's "llama-3" format), for larger vocabularies.
Our shards are named `train_XXXXXX.bin` / `val_XXXXXX.bin` next to a `manifest.json`; llm.c's and
modded-nanogpt's `NAME_train_XXXXXX.bin` / `NAME_val_XXXXXX.bin` (e.g. fineweb_train_000001.bin)
are read too.

Token ids are range-checked against the model's vocabulary (and the tokenizer's, when the
manifest knows it) the first time a shard is read: one vectorised max over the memmap.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from util import atomic_write, replaced_from_temp

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# (magic, version) -> token dtype
FORMATS = {(20240520, 1): np.dtype(np.uint16), (20240801, 7): np.dtype(np.uint32)}
MAGIC, VERSION = 20240520, 1  # the uint16 format
MAGIC_U32, VERSION_U32 = 20240801, 7
TOKEN_DTYPE = np.uint16
SPLITS = ("train", "val")
MANIFEST = "manifest.json"
REPREPARE = "re-create it with `python -m data.prepare ...` (or delete it so `builtin` is rebuilt)"
_OURS = re.compile(r"(train|val)_(\d{6})\.bin")
_LLMC = re.compile(r"(.+)_(train|val)_(\d+)\.bin")


class DataError(ValueError):
    """A problem with a dataset (missing, malformed, or not matching the model): one line that
    names the file, the value seen and the fix, for the trainer to print without a traceback."""


class PrepareError(DataError):
    """A user-facing problem with data.prepare's inputs or environment (printed without a traceback)."""


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def dtype_for_vocab(n_vocab: int) -> np.dtype:
    """uint16 when every id (0 .. n_vocab-1) fits in 16 bits, else uint32."""
    return np.dtype(np.uint16) if n_vocab <= 1 << 16 else np.dtype(np.uint32)


def _header_for(dtype: np.dtype) -> tuple[int, int]:
    for key, dt in FORMATS.items():
        if dt == np.dtype(dtype):
            return key
    raise ValueError(f"shard token dtype must be uint16 or uint32, got {np.dtype(dtype)}")


def write_shard(path: str | os.PathLike, tokens: np.ndarray, dtype: np.dtype | type = TOKEN_DTYPE) -> None:
    """Write one shard atomically (temp file + rename) so a crash never leaves a torn shard."""
    dtype = np.dtype(dtype)
    magic, version = _header_for(dtype)
    tokens = np.asarray(tokens)
    if tokens.size and (int(tokens.max()) > np.iinfo(dtype).max or int(tokens.min()) < 0):
        raise ValueError(f"token ids {int(tokens.min())}..{int(tokens.max())} do not fit the {dtype} shard format")
    if tokens.size > np.iinfo(np.int32).max:
        raise ValueError(f"a shard holds at most {np.iinfo(np.int32).max} tokens, got {tokens.size}")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (magic, version, tokens.size)
    path = Path(path)
    with replaced_from_temp(path) as tmp, open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype, copy=False).tobytes())


def read_header_info(path: str | os.PathLike) -> tuple[int, np.dtype]:
    """Validate a shard's header and size; return (token count, token dtype). DataError naming
    the file and the values otherwise."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"shard {path} is {size} bytes, shorter than the {HEADER_BYTES}-byte header "
                        f"(256 int32); the file is truncated or not a token shard — {REPREPARE}")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    magic, version = int(header[0]), int(header[1])
    if magic not in {m for m, _ in FORMATS}:
        raise DataError(f"shard {path} has magic {magic}, expected {MAGIC} (uint16 tokens) or {MAGIC_U32} "
                        f"(uint32); not a token shard of this format — {REPREPARE}")
    if (magic, version) not in FORMATS:
        expected = VERSION if magic == MAGIC else VERSION_U32
        raise DataError(f"shard {path} has format version {version}, expected {expected} — {REPREPARE}")
    dtype = FORMATS[(magic, version)]
    ntok = int(header[2])
    expected = HEADER_BYTES + ntok * dtype.itemsize
    if ntok < 0 or size != expected:
        raise DataError(f"shard {path} is {size} bytes but its header announces {ntok} tokens "
                        f"({expected} bytes expected); the file is truncated or corrupt — {REPREPARE}")
    return ntok, dtype


def read_header(path: str | os.PathLike) -> int:
    """Validate a shard's header and size; return its token count."""
    return read_header_info(path)[0]


_checked: set[tuple] = set()  # (path, size, mtime_ns, vocab, tokenizer vocab) already range-checked


def check_token_range(path: str | os.PathLike, tokens: np.ndarray, vocab_size: int | None,
                      tokenizer_vocab: int | None = None, tokenizer: str | None = None) -> None:
    """DataError if a token id is >= the model's vocabulary, or (when the tokenizer's vocabulary is
    known) >= the tokenizer's: ids in the model's padded tail are never produced by a tokenizer, so
    a shard holding one was written with another tokenizer or is corrupt. One max over the shard;
    done once per file version per process."""
    if tokens.size == 0 or (vocab_size is None and tokenizer_vocab is None):
        return
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns, vocab_size, tokenizer_vocab)
    if key in _checked:
        return
    top = int(tokens.max())
    if vocab_size is not None and top >= vocab_size:
        pos = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"shard {path}: token id {int(tokens[pos])} at position {pos} is >= the model's vocabulary "
                        f"size {vocab_size}; the data was tokenized with a larger vocabulary than the model has — "
                        f"size the model from the dataset (data.dataset_vocab_size) or re-prepare the data with "
                        f"the model's tokenizer")
    if tokenizer_vocab is not None and top >= tokenizer_vocab:
        pos = int(np.argmax(tokens >= tokenizer_vocab))
        name = f"{tokenizer}, " if tokenizer else ""
        fits = " although it fits the model's padded vocabulary" if vocab_size is not None else ""
        raise DataError(f"shard {path}: token id {int(tokens[pos])} at position {pos} is not a token of the "
                        f"dataset's tokenizer ({name}ids 0..{tokenizer_vocab - 1} per manifest.json){fits}; the "
                        f"shard is corrupt or was written with another tokenizer — {REPREPARE}")
    _checked.add(key)


def open_shard(path: str | os.PathLike) -> np.memmap | np.ndarray:
    """Memory-map a validated shard's tokens (uint16 or uint32, read-only)."""
    ntok, dtype = read_header_info(path)
    if ntok == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(ntok,))


def list_shards(data_dir: str | os.PathLike, split: str) -> list[Path]:
    """The `split` shards of a prepared dir in index order (not validated): ours, `split_XXXXXX.bin`,
    or else llm.c's `NAME_split_XXXXXX.bin`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    d = Path(data_dir)
    ours = sorted(d.glob(f"{split}_[0-9][0-9][0-9][0-9][0-9][0-9].bin"))
    if ours:
        return ours
    found = []
    for p in d.glob(f"*_{split}_*.bin"):
        m = _LLMC.fullmatch(p.name)
        if m and m.group(2) == split:
            found.append((m.group(1), int(m.group(3)), p))
    return [p for _, _, p in sorted(found)]


def is_shard_name(name: str) -> bool:
    """A file name data.prepare writes (a shard, or the temp file of one being written)."""
    return bool(_OURS.fullmatch(name.removesuffix(".partial")))


class ShardWriter:
    """Accumulates token arrays and writes `split` shards of exactly `shard_tokens` (last one
    shorter). `persist()` appends the tokens of the unfinished shard to a side file
    (`split_XXXXXX.bin.tokens`), and `resume()` restarts from what a progress record says was
    persisted, so an interrupted data.prepare continues where it stopped."""

    def __init__(self, out_dir: str | os.PathLike, split: str, shard_tokens: int,
                 dtype: np.dtype | type = TOKEN_DTYPE):
        if shard_tokens < 1 or shard_tokens > np.iinfo(np.int32).max:
            raise ValueError(f"shard_tokens must be in [1, {np.iinfo(np.int32).max}], got {shard_tokens}")
        self.out_dir, self.split, self.shard_tokens = Path(out_dir), split, int(shard_tokens)
        self.dtype = np.dtype(dtype)
        _header_for(self.dtype)
        self._buf = np.empty(self.shard_tokens, dtype=self.dtype)
        self._fill = 0
        self._persisted = 0
        self.shards: list[dict] = []  # [{"file", "tokens"}] in write order
        self.tokens = 0

    @property
    def room(self) -> int:
        """Tokens the current shard still takes."""
        return self.shard_tokens - self._fill

    @property
    def pending(self) -> int:
        """Tokens of the unfinished shard."""
        return self._fill

    def _side_file(self) -> Path:
        return self.out_dir / (shard_name(self.split, len(self.shards)) + ".tokens")

    def add(self, tokens: np.ndarray) -> int:
        """Append tokens, writing every shard that fills; returns how many shards were completed."""
        tokens = np.asarray(tokens)
        done = 0
        while tokens.size:
            take = min(tokens.size, self.shard_tokens - self._fill)
            self._buf[self._fill:self._fill + take] = tokens[:take]
            self._fill += take
            tokens = tokens[take:]
            if self._fill == self.shard_tokens:
                self._flush()
                done += 1
        return done

    def _flush(self) -> None:
        name = shard_name(self.split, len(self.shards))
        write_shard(self.out_dir / name, self._buf[:self._fill], self.dtype)
        self.shards.append({"file": name, "tokens": int(self._fill)})
        self.tokens += self._fill
        self._fill = 0
        self._persisted = 0

    def persist(self) -> dict:
        """Make the unfinished shard's tokens durable (append to its side file, fsync) and return
        this writer's progress record: {"shards": [...], "pending": n}."""
        side = self._side_file()
        if self._fill > self._persisted:
            with open(side, "ab") as f:
                f.write(self._buf[self._persisted:self._fill].tobytes())
                f.flush()
                os.fsync(f.fileno())
            self._persisted = self._fill
        return {"shards": [dict(s) for s in self.shards], "pending": int(self._fill)}

    def resume(self, record: dict) -> None:
        """Restore the state `persist()` recorded: completed shards must be on disk; the side file
        is cut back to the recorded count (later appends were never recorded)."""
        for s in record["shards"]:
            path = self.out_dir / s["file"]
            if not path.is_file() or read_header(path) != s["tokens"]:
                raise DataError(f"resuming data.prepare: shard {path} is missing or does not hold the "
                                f"{s['tokens']} tokens its progress record says; start over with --restart")
        self.shards = [dict(s) for s in record["shards"]]
        self.tokens = sum(s["tokens"] for s in self.shards)
        n = int(record["pending"])
        side = self._side_file()
        have = side.stat().st_size // self.dtype.itemsize if side.is_file() else 0
        if have < n:
            raise DataError(f"resuming data.prepare: {side} holds {have} tokens, its progress record says "
                            f"{n}; start over with --restart")
        if n:
            self._buf[:n] = np.fromfile(side, dtype=self.dtype, count=n)
            with open(side, "r+b") as f:
                f.truncate(n * self.dtype.itemsize)
        elif side.is_file():
            side.unlink()
        self._fill = self._persisted = n
        # a shard written after the last record (the crash came before the record) is rewritten
        nxt = self.out_dir / shard_name(self.split, len(self.shards))
        if nxt.is_file():
            nxt.unlink()

    def discard_side_files(self) -> None:
        """Remove side files of shards that are complete (called after a progress record)."""
        for i in range(len(self.shards)):
            side = self.out_dir / (shard_name(self.split, i) + ".tokens")
            if side.is_file():
                side.unlink()

    def close(self) -> list[dict]:
        if self._fill:
            self._flush()
        self.discard_side_files()
        return self.shards


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> None:
    atomic_write(Path(out_dir) / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def read_manifest(data_dir: str | os.PathLike) -> dict | None:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); {REPREPARE}") from None


def format_info(dtype: np.dtype | type = TOKEN_DTYPE) -> dict:
    magic, version = _header_for(np.dtype(dtype))
    return {"magic": magic, "version": version, "header_int32": HEADER_INTS, "dtype": np.dtype(dtype).name}
