"""The token shard format (modded-nanogpt style) and its reader/writer.

A shard file is a header of 256 int32 — magic 20240520, version 1, token count, the rest 0 —
followed by the tokens as uint16 (GPT-2's 50257 ids fit). Train and val shards are named
`train_XXXXXX.bin` / `val_XXXXXX.bin` and sit next to a `manifest.json`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.uint16
SPLITS = ("train", "val")
MANIFEST = "manifest.json"
REPREPARE = "re-create it with `python -m data.prepare ...` (or delete it so `builtin` is rebuilt)"


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write one shard atomically (temp file + rename) so a crash never leaves a torn shard."""
    tokens = np.asarray(tokens)
    if tokens.size and int(tokens.max()) > np.iinfo(TOKEN_DTYPE).max:
        raise ValueError(f"token id {int(tokens.max())} does not fit the uint16 shard format")
    if tokens.size > np.iinfo(np.int32).max:
        raise ValueError(f"a shard holds at most {np.iinfo(np.int32).max} tokens, got {tokens.size}")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, VERSION, tokens.size)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(TOKEN_DTYPE, copy=False).tobytes())
    os.replace(tmp, path)


def read_header(path: str | os.PathLike) -> int:
    """Validate a shard's header and size; return its token count. Errors name file and values."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ValueError(f"shard {path} is {size} bytes, shorter than the {HEADER_BYTES}-byte header "
                         f"(256 int32); the file is truncated or not a token shard — {REPREPARE}")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ValueError(f"shard {path} has magic {int(header[0])}, expected {MAGIC}; not a token shard "
                         f"of this format — {REPREPARE}")
    if header[1] != VERSION:
        raise ValueError(f"shard {path} has format version {int(header[1])}, expected {VERSION} — {REPREPARE}")
    ntok = int(header[2])
    expected = HEADER_BYTES + ntok * TOKEN_DTYPE().itemsize
    if ntok < 0 or size != expected:
        raise ValueError(f"shard {path} is {size} bytes but its header announces {ntok} tokens "
                         f"({expected} bytes expected); the file is truncated or corrupt — {REPREPARE}")
    return ntok


def open_shard(path: str | os.PathLike) -> np.memmap | np.ndarray:
    """Memory-map a validated shard's tokens (uint16, read-only)."""
    ntok = read_header(path)
    if ntok == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(ntok,))


def list_shards(data_dir: str | os.PathLike, split: str) -> list[Path]:
    """The `split` shards of a prepared dir, in index order (does not validate them)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    return sorted(Path(data_dir).glob(f"{split}_[0-9][0-9][0-9][0-9][0-9][0-9].bin"))


class ShardWriter:
    """Accumulates token arrays and writes `split` shards of exactly `shard_tokens` (last one shorter)."""

    def __init__(self, out_dir: str | os.PathLike, split: str, shard_tokens: int):
        if shard_tokens < 1 or shard_tokens > np.iinfo(np.int32).max:
            raise ValueError(f"shard_tokens must be in [1, {np.iinfo(np.int32).max}], got {shard_tokens}")
        self.out_dir, self.split, self.shard_tokens = Path(out_dir), split, int(shard_tokens)
        self._buf = np.empty(self.shard_tokens, dtype=TOKEN_DTYPE)
        self._fill = 0
        self.shards: list[dict] = []  # [{"file", "tokens"}] in write order
        self.tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        while tokens.size:
            take = min(tokens.size, self.shard_tokens - self._fill)
            self._buf[self._fill:self._fill + take] = tokens[:take]
            self._fill += take
            tokens = tokens[take:]
            if self._fill == self.shard_tokens:
                self._flush()

    def _flush(self) -> None:
        name = shard_name(self.split, len(self.shards))
        write_shard(self.out_dir / name, self._buf[:self._fill])
        self.shards.append({"file": name, "tokens": int(self._fill)})
        self.tokens += self._fill
        self._fill = 0

    def close(self) -> list[dict]:
        if self._fill:
            self._flush()
        return self.shards


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> None:
    path = Path(out_dir) / MANIFEST
    tmp = path.with_name(MANIFEST + ".partial")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)


def read_manifest(data_dir: str | os.PathLike) -> dict | None:
    path = Path(data_dir) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def format_info() -> dict:
    return {"magic": MAGIC, "version": VERSION, "header_int32": HEADER_INTS, "dtype": "uint16"}
