"""The built-in corpus: CPython's reference documentation text, shipped with every Python.

`pydoc_data/topics.py` in the standard library holds the text of the Python Language Reference
and Library Reference topics that `help()` shows (about 0.47 MB of English on Python 3.11;
Copyright Python Software Foundation, PSF License Agreement — the license every CPython
distribution ships). Each topic is cut into documents at its section headings (a title line
underlined with ===, ---, ***, ~~~); in sorted-topic order every 10th document goes to val.
It is tokenized with the offline GPT-2 BPE and written in the shard format of data/shards.py
under the project cache on first use, atomically: built in a private temp dir and renamed into
place, so ranks racing to prepare it end up sharing one complete copy.
"""
from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from data.shards import SPLITS, DataError, ShardWriter, format_info, read_manifest, write_manifest
from data.tokenizer import cache_root, get_encoding, tokenizer_info

NAME = "builtin"
VAL_EVERY = 10
SHARD_TOKENS = 1 << 20  # the corpus is ~110k tokens: one train and one val shard
_UNDERLINE = re.compile(r"([=\-*~^\"'])\1{2,}")


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics
    return topics


def _split_sections(text: str) -> list[str]:
    """Cut a topic at every heading (a line followed by an underline as long as the line)."""
    lines = text.split("\n")
    starts = [0]
    for i in range(1, len(lines) - 1):
        under = lines[i + 1]
        if (lines[i].strip() and _UNDERLINE.fullmatch(under) and len(under) >= len(lines[i].rstrip())
                and i > starts[-1]):
            starts.append(i)
    starts.append(len(lines))
    sections = ["\n".join(lines[a:b]).strip("\n") for a, b in zip(starts, starts[1:])]
    return [s for s in sections if s.strip()]


def documents() -> list[tuple[str, str]]:
    """[(doc id, text)], deterministic: topics sorted by name, sections in order."""
    docs = []
    for name in sorted(_topics()):
        for j, section in enumerate(_split_sections(_topics()[name])):
            docs.append((f"{name}#{j}", section))
    return docs


def split_of(index: int) -> str:
    return "val" if index % VAL_EVERY == VAL_EVERY - 1 else "train"


def corpus_sha256() -> str:
    h = hashlib.sha256()
    for name in sorted(_topics()):
        h.update(name.encode() + b"\0" + _topics()[name].encode() + b"\0")
    return h.hexdigest()


def builtin_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the prepared corpus lives; the name carries the Python version and a content hash,
    since pydoc_data differs between Python releases."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    ver = "".join(platform.python_version_tuple()[:2])
    return root / "datasets" / f"builtin-pydoc-py{ver}-{corpus_sha256()[:10]}"


def write_corpus(out_dir: Path) -> dict:
    """Tokenize the corpus into shards + manifest in `out_dir` (which must exist); return the manifest."""
    t0 = time.perf_counter()
    enc = get_encoding()
    writers = {s: ShardWriter(out_dir, s, SHARD_TOKENS) for s in SPLITS}
    n_docs = dict.fromkeys(SPLITS, 0)
    n_bytes = 0
    for i, (_, text) in enumerate(documents()):
        split = split_of(i)
        writers[split].add(np.asarray(enc.encode_ordinary(text) + [enc.eot_token], dtype=np.uint16))
        n_docs[split] += 1
        n_bytes += len(text.encode())
    shards = {s: w.close() for s, w in writers.items()}
    manifest = {
        "format": format_info(),
        "source": {"name": NAME, "origin": "CPython standard library pydoc_data/topics.py",
                   "python": platform.python_version(), "license": "PSF License Agreement",
                   "sha256": corpus_sha256(), "bytes": n_bytes,
                   "split": f"sections in sorted-topic order, every {VAL_EVERY}th to val"},
        "tokenizer": tokenizer_info(),
        "shard_tokens": SHARD_TOKENS,
        "splits": {s: {"documents": n_docs[s], "tokens": sum(x["tokens"] for x in shards[s]),
                       "shards": shards[s]} for s in SPLITS},
        "prepare_seconds": round(time.perf_counter() - t0, 3),
    }
    write_manifest(out_dir, manifest)
    return manifest


def prepare_builtin(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the prepared built-in corpus dir, building it first if needed (race-safe)."""
    target = builtin_dir(cache_dir)
    if read_manifest(target) is not None:  # the manifest is written last, inside the temp dir
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        write_corpus(tmp)
        try:
            os.rename(tmp, target)  # atomic; fails if another process renamed its copy first
        except OSError:
            if read_manifest(target) is None:
                raise DataError(f"{target} exists but holds no manifest.json (an interrupted or foreign "
                                   f"directory); delete it and retry") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
