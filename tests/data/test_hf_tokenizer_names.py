"""--tokenizer names for Hugging Face tokenizers, offline on local files: a tokenizer directory (what
save_pretrained writes), its tokenizer.json, and a hub id (`org/name`) whose download is replaced by a
local file here; offline, a hub id is one DataError saying what to do."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from data import DataError  # noqa: E402
from data import tokenizer as tk  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["the cat sat on the mat", "a dog and a cat and a bird", "lions and bears share the forest"] * 20


def _tiny_tokenizer(directory: Path) -> Path:
    """A byte-level BPE with <|endoftext|>, saved as DIR/tokenizer.json (as save_pretrained does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=[tk.EOT_TOKEN],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / tk.FILE_TOKENIZER))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


@pytest.fixture()
def fresh_cache():
    tk.get_encoding.cache_clear()
    yield
    tk.get_encoding.cache_clear()


def test_a_tokenizer_directory_is_its_tokenizer_json(tmp_path, fresh_cache):
    d = _tiny_tokenizer(tmp_path / "my-tok")
    by_dir, by_file = tk.get_encoding(str(d)), tk.get_encoding(str(d / "tokenizer.json"))
    text = "the cat and the bird"
    assert by_dir.encode_ordinary(text) == by_file.encode_ordinary(text) != []
    assert by_dir.decode(by_dir.encode_ordinary(text)) == text
    assert tk.eot_id(by_dir) == 0 and by_dir.n_vocab == by_file.n_vocab
    assert tk.is_file_tokenizer(str(d))
    info = tk.tokenizer_info(str(d))
    assert info["name"] == "tokenizer.json" and str(d) in info["source"], info
    out = tmp_path / "data"
    out.mkdir()
    tk.copy_tokenizer(str(d), out)
    assert (out / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()


def test_data_prepare_takes_a_tokenizer_directory(tmp_path, fresh_cache):
    from data.prepare import main

    d = _tiny_tokenizer(tmp_path / "tok")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = tmp_path / "prepared"
    assert main(["text", "--input", str(corpus), "--tokenizer", str(d), "--out", str(out), "--num-proc", "1",
                 "--val-fraction", "0.1"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["name"] == "tokenizer.json" and manifest["tokenizer"]["n_vocab"] == tk.get_encoding(str(d)).n_vocab, manifest
    assert (out / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()


def test_a_directory_without_tokenizer_json_says_how_to_make_one(tmp_path, fresh_cache):
    d = tmp_path / "slow-tok"
    d.mkdir()
    (d / "vocab.json").write_text("{}")
    (d / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(DataError, match=r"slow-tok has no tokenizer\.json \(it has merges\.txt, vocab\.json\); "
                                        r"write one .*save_pretrained"):
        tk.get_encoding(str(d))


def test_a_hub_id_uses_the_hub_file(tmp_path, monkeypatch, fresh_cache):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub

    d = _tiny_tokenizer(tmp_path / "downloaded")
    asked = []

    def fake_download(repo_id, filename, **kw):
        asked.append((repo_id, filename))
        return str(d / filename)

    monkeypatch.chdir(tmp_path)  # no local directory "acme/tiny-tok"
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    assert tk.is_hub_name("acme/tiny-tok") and not tk.is_hub_name("cl100k_base") and not tk.is_hub_name("./a/b")
    enc = tk.get_encoding("acme/tiny-tok")
    assert asked == [("acme/tiny-tok", "tokenizer.json")]
    assert enc.encode_ordinary("the cat") == tk.get_encoding(str(d)).encode_ordinary("the cat")
    assert "from acme/tiny-tok" in tk.tokenizer_info("acme/tiny-tok")["source"]


def test_a_hub_id_offline_is_one_clear_error(tmp_path):
    pytest.importorskip("huggingface_hub")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}
    code = ("from data.tokenizer import get_encoding\nfrom data import DataError\n"
            "try:\n    get_encoding('acme/no-such-tokenizer')\nexcept DataError as e:\n    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    msg = p.stdout.strip()
    assert msg.startswith("tokenizer 'acme/no-such-tokenizer': no local directory of that name, and its "
                          "tokenizer.json could not be fetched from the Hugging Face hub nor found in its cache"), msg
    assert "huggingface-cli download acme/no-such-tokenizer tokenizer.json --local-dir DIR" in msg
    assert len(msg.splitlines()) == 1
