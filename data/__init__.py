"""Data: offline tokenizers, shard preparation (`python -m data.prepare`), the built-in corpus,
and the distributed shard loader. `resolve_dataset` turns a config's `data.dataset` into a
directory of shards; `dataset_vocab_size` says which vocabulary the model needs for it; every data
problem is a `DataError` (one line: the file, the value seen, the fix)."""
from __future__ import annotations

import os
from pathlib import Path

from data.shards import DataError

__all__ = ["DataError", "dataset_tokenizer", "dataset_vocab_size", "resolve_dataset"]


def resolve_dataset(name_or_dir: str, cache_dir: str | None = None) -> Path:
    """`"builtin"` -> the built-in corpus dir (prepared under the project cache on first use;
    `cache_dir` overrides the cache root); anything else -> that directory, which must hold
    train shards (DataError saying what to run otherwise)."""
    from data.builtin import NAME, prepare_builtin
    from data.loader import split_shards

    if name_or_dir == NAME:
        return prepare_builtin(cache_dir)
    path = Path(os.path.expanduser(name_or_dir))
    split_shards(path, "train")  # raises the clear missing/empty errors
    return path


def dataset_vocab_size(name_or_dir: str | os.PathLike) -> int | None:
    """The vocabulary size of the tokenizer a dataset was prepared with (manifest.json), for sizing
    the model (model.resolve_config pads it to a multiple of 64). None for the built-in corpus and
    for a directory without a manifest (e.g. llm.c shards): GPT-2, the presets' vocabulary."""
    from data.builtin import NAME
    from data.loader import tokenizer_vocab

    if str(name_or_dir) == NAME:
        return None
    return tokenizer_vocab(Path(os.path.expanduser(str(name_or_dir))))[0]


def dataset_tokenizer(name_or_dir: str | os.PathLike) -> str:
    """The tokenizer name a dataset was prepared with ("gpt2" for the built-in corpus and for
    directories without a manifest); a dataset's own tokenizer.json as its path."""
    from data.builtin import NAME
    from data.loader import tokenizer_vocab
    from data.tokenizer import resolve_tokenizer

    if str(name_or_dir) == NAME:
        return "gpt2"
    path = Path(os.path.expanduser(str(name_or_dir)))
    return resolve_tokenizer(tokenizer_vocab(path)[1], path) or "gpt2"
