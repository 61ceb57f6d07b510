"""Data: offline GPT-2 tokenizer, shard preparation (`python -m data.prepare`), the built-in
corpus, and the distributed shard loader. `resolve_dataset` turns a config's `data.dataset`
into a directory of shards."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["resolve_dataset"]


def resolve_dataset(name_or_dir: str, cache_dir: str | None = None) -> Path:
    """`"builtin"` -> the built-in corpus dir (prepared under the project cache on first use;
    `cache_dir` overrides the cache root); anything else -> that directory, which must hold
    train_XXXXXX.bin shards (FileNotFoundError saying what to run otherwise)."""
    from data.builtin import NAME, prepare_builtin
    from data.loader import split_shards

    if name_or_dir == NAME:
        return prepare_builtin(cache_dir)
    path = Path(os.path.expanduser(name_or_dir))
    split_shards(path, "train")  # raises the clear missing/empty errors
    return path
