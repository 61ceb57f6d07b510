"""data.prepare on local files: shard headers and counts, decode back to the documents, the
openwebtext/fineweb code paths on local data of the hub schema, and fast offline failures."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.prepare import PrepareError, main, prepare_fineweb, prepare_openwebtext, prepare_text
from data.shards import list_shards, open_shard, read_header
from data.tokenizer import get_encoding

ROOT = Path(__file__).resolve().parents[2]
EOT = "<|endoftext|>"
DOCS = [f"Document {i}: the {'quick ' * (i % 4)}brown fox #{i * 37} jumps; naïve café №{i}." for i in range(24)]


def decode_split(out: Path, split: str) -> tuple[str, list[int]]:
    tokens = np.concatenate([np.asarray(open_shard(p)) for p in list_shards(out, split)] or [np.zeros(0)])
    return get_encoding().decode(tokens.astype(np.int64).tolist()), tokens.tolist()


def docs_of(text: str) -> list[str]:
    assert text == "" or text.endswith(EOT)
    return text.split(EOT)[:-1]


def check_shards(out: Path, shard_tokens: int) -> dict:
    """Header counts match file sizes and the manifest; all shards but the last are full."""
    manifest = json.loads((out / "manifest.json").read_text())
    for split in ("train", "val"):
        paths = list_shards(out, split)
        counts = [read_header(p) for p in paths]
        assert all(c == shard_tokens for c in counts[:-1]) and (not counts or 0 < counts[-1] <= shard_tokens)
        assert [p.stat().st_size for p in paths] == [1024 + 2 * c for c in counts]
        assert manifest["splits"][split]["tokens"] == sum(counts)
        assert [s["file"] for s in manifest["splits"][split]["shards"]] == [p.name for p in paths]
    assert manifest["tokenizer"]["encoder_json_sha256"].startswith("196139668be6")
    assert manifest["format"]["magic"] == 20240520
    return manifest


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    """DOCS spread over .txt files, a .jsonl and a .parquet, in a folder tree (sorted order)."""
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "a_0.txt").write_text(DOCS[0])
    (src / "a_1.txt").write_text(DOCS[1] + "\n\nsecond paragraph\n")
    with open(src / "b" / "c.jsonl", "w") as f:
        for d in DOCS[2:12]:
            f.write(json.dumps({"id": 1, "body": d}) + "\n")
        f.write(json.dumps({"id": 2, "body": ""}) + "\n")  # empty docs are dropped
    pq.write_table(pa.table({"body": DOCS[12:], "n": list(range(12))}), src / "b" / "d.parquet")
    (src / "b" / "ignored.csv").write_text("not,read\n")
    return src


def test_text_files_decode_back_with_eot(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    m = prepare_text(out, [corpus], field="body", val_fraction=0, shard_tokens=37, num_proc=1,
                     cache_dir=str(tmp_path / "hf"))
    expected = [DOCS[0], DOCS[1] + "\n\nsecond paragraph\n"] + DOCS[2:]
    text, tokens = decode_split(out, "train")
    assert docs_of(text) == expected
    assert tokens.count(50256) == len(expected) and tokens[-1] == 50256
    assert len(tokens) == sum(len(get_encoding().encode_ordinary(d)) + 1 for d in expected)
    manifest = check_shards(out, 37)
    assert m == manifest and manifest["splits"]["val"]["tokens"] == 0
    assert manifest["source"]["documents"] == 25 and manifest["source"]["empty_documents_dropped"] == 1
    assert len(manifest["splits"]["train"]["shards"]) == -(-len(tokens) // 37)


def test_val_fraction_cli_and_overwrite(corpus: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    args = ["text", "--input", str(corpus / "b"), "--field", "body", "--out", str(out), "--val-fraction", "0.25",
            "--shard-tokens", "50", "--num-proc", "2", "--cache-dir", str(tmp_path / "hf")]
    assert main(args) == 0
    train, val = docs_of(decode_split(out, "train")[0]), docs_of(decode_split(out, "val")[0])
    assert len(val) == 6 and len(train) == 16  # ceil(0.25 * 22) held out
    assert sorted(train + val) == sorted(DOCS[2:])
    manifest = check_shards(out, 50)
    assert manifest["splits"]["val"]["documents"] == 6
    assert main(args) == 2
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite", "--seed", "1"]) == 0
    val_seed1 = docs_of(decode_split(out, "val")[0])
    assert len(val_seed1) == 6 and sorted(val_seed1) != sorted(val)  # the seed picks the held-out docs
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_txt_split_paragraph_and_bad_inputs(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    prepare_text(out, [corpus / "a_1.txt"], txt_split="paragraph", val_fraction=0, shard_tokens=1000,
                 num_proc=1, cache_dir=str(tmp_path / "hf"))
    assert [d.strip() for d in docs_of(decode_split(out, "train")[0])] == [DOCS[1], "second paragraph"]
    with pytest.raises(PrepareError, match=r"has no field 'text' \(columns: \['id', 'body'\]\)"):
        prepare_text(tmp_path / "x", [corpus / "b" / "c.jsonl"], num_proc=1, cache_dir=str(tmp_path / "hf"))
    with pytest.raises(PrepareError, match="unsupported file type '.csv'"):
        prepare_text(tmp_path / "x", [corpus / "b" / "ignored.csv"])
    with pytest.raises(PrepareError, match="does not exist"):
        prepare_text(tmp_path / "x", [tmp_path / "missing.txt"])
    with pytest.raises(PrepareError, match="cannot hold out a val fraction of 1 document"):
        prepare_text(tmp_path / "x", [corpus / "a_0.txt"], num_proc=1, cache_dir=str(tmp_path / "hf"))
    # an empty file, or a parquet file of no rows: one error naming the file (they were tracebacks)
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(PrepareError, match=r"e\.jsonl: every input file is empty \(0 bytes\)"):
        prepare_text(tmp_path / "x", [tmp_path / "e.jsonl"], num_proc=1, cache_dir=str(tmp_path / "hf"))
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "z.parquet")
    with pytest.raises(PrepareError, match=r"z\.parquet: could not be read as parquet \("):
        prepare_text(tmp_path / "x", [tmp_path / "z.parquet"], num_proc=1, cache_dir=str(tmp_path / "hf"))


def hub_like(tmp_path: Path, docs: list[str]):
    """A local parquet with the hub schema ('text' + an extra column), loaded like the hub copy."""
    import datasets

    path = tmp_path / "hub.parquet"
    pq.write_table(pa.table({"text": docs, "id": [f"<urn:{i}>" for i in range(len(docs))]}), path)
    return datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))


def test_openwebtext_path_holds_out_nanogpt_fraction(tmp_path: Path) -> None:
    docs = DOCS * 3  # 72 docs: ceil(0.0005 * 72) = 1 held out
    ds = hub_like(tmp_path, docs)
    m = prepare_openwebtext(tmp_path / "owt", dataset=ds, shard_tokens=300, num_proc=1)
    check_shards(tmp_path / "owt", 300)
    train, val = docs_of(decode_split(tmp_path / "owt", "train")[0]), docs_of(decode_split(tmp_path / "owt", "val")[0])
    assert len(val) == 1 and len(train) == 71 and sorted(train + val) == sorted(docs)
    nanogpt = ds.train_test_split(test_size=0.0005, seed=2357, shuffle=True)  # nanoGPT's recipe
    assert val == nanogpt["test"]["text"] and train == nanogpt["train"]["text"]
    assert m["source"]["hub_id"] == "Skylion007/openwebtext" and "seed 2357" in m["source"]["val"]


def test_fineweb_path_first_shard_is_val(tmp_path: Path) -> None:
    ds = hub_like(tmp_path, DOCS)
    m = prepare_fineweb(tmp_path / "fw", dataset=ds, shard_tokens=64, num_proc=1)
    check_shards(tmp_path / "fw", 64)
    val_text, val_tokens = decode_split(tmp_path / "fw", "val")
    train_text, train_tokens = decode_split(tmp_path / "fw", "train")
    assert len(val_tokens) == 64 and m["splits"]["val"]["tokens"] == 64
    assert docs_of(val_text + train_text) == DOCS  # the cut is inside the token stream, order kept
    assert m["source"]["config"] == "sample-10BT" and m["source"]["val"] == "first 1 shard(s) of the token stream"


def run_cli(args: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "data.prepare", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    return proc, time.perf_counter() - t0


def test_hub_without_network_fails_fast_with_instructions(tmp_path: Path) -> None:
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "ds"), "HF_HUB_OFFLINE": "1"}
    proc, secs = run_cli(["openwebtext", "--out", str(tmp_path / "owt")], env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Skylion007/openwebtext is not in the local HF cache" in proc.stderr and "data.prepare text --input" in proc.stderr
    assert secs < 15 and "Retrying" not in proc.stderr
    # --online with an unreachable endpoint: the probe fails at once instead of datasets' retries
    env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    proc, secs = run_cli(["fineweb", "--sample", "sample-100BT", "--online", "--out", str(tmp_path / "fw")], env)
    assert proc.returncode == 2 and "127.0.0.1:9 is unreachable" in proc.stderr, proc.stderr[-2000:]
    assert secs < 15 and not (tmp_path / "fw").exists()



def test_prepare_takes_flags_only_and_says_so_in_one_line(capsys) -> None:
    """util/cli.py's convention for a command with no config: a config file or key=value is refused by name,
    every error is one line with exit code 2 (argparse printed its usage block first)."""
    for argv, want in ((['text', '--out', 'o', 'data.tokenizer=gpt2', '--input', 'a.txt'], "'data.tokenizer=gpt2': this command takes no config"), (['text', '--input', 'a.txt'], 'required: --out')):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and want in err and err.count("\n") == 1, err


def test_fineweb_from_a_local_folder_says_what_is_wrong_not_the_cache(tmp_path: Path) -> None:
    """`fineweb --hub-id DIR` on a local copy of FineWeb-schema parquet files: the config name the default
    --sample asks for is not there, and the error says so (it blamed the offline HF cache); --sample default
    reads it."""
    from data.hub import load_hub

    local = tmp_path / "fw"
    local.mkdir()
    pq.write_table(pa.table({"text": DOCS, "id": [f"<urn:{i}>" for i in range(len(DOCS))]}), local / "part.parquet")
    with pytest.raises(PrepareError) as e:
        load_hub(str(local), "sample-10BT", offline=True, num_proc=1, cache_dir=str(tmp_path / "hf"),
                 subcommand="fineweb")
    msg = str(e.value)
    assert f"the local folder {local} could not be read as the fineweb dataset" in msg and "--sample default" in msg
    assert "not in the local HF cache" not in msg
    ds = load_hub(str(local), "default", offline=True, num_proc=1, cache_dir=str(tmp_path / "hf"), subcommand="fineweb")
    assert list(ds["text"]) == DOCS
