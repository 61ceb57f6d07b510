"""data.prepare at scale: streaming gives the shards of the in-memory path, a token budget, and
interrupted runs (at a shard boundary, mid-shard, between a shard and its progress record) that
continue and end byte-identical to an uninterrupted run."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data.prepare as dp
import data.writer as dw
from data.prepare import PrepareError, PrepareStopped, prepare_fineweb, prepare_openwebtext
from data.shards import list_shards, open_shard

# uneven documents, some empty (dropped), some long enough to span shards
DOCS = [("" if i % 13 == 7 else f"Doc {i}: " + " ".join(f"w{(i * j) % 97}" for j in range(3 + (i * 7) % 40)))
        for i in range(160)]


@pytest.fixture()
def source(tmp_path: Path):
    """A local parquet with the hub schema, loadable in memory or streamed (datasets streaming=True)."""
    import datasets

    path = tmp_path / "hub.parquet"
    pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), path, row_group_size=23)

    def load(streaming: bool):
        return datasets.load_dataset("parquet", data_files=str(path), split="train", streaming=streaming,
                                     cache_dir=str(tmp_path / "hf"))
    return load


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix == ".bin"}


def stable(manifest: dict) -> dict:
    """The manifest without the fields that differ between runs of the same data (time, mode)."""
    src = {k: v for k, v in manifest["source"].items() if k != "streaming"}
    return {**{k: v for k, v in manifest.items() if k not in ("created_utc", "prepare_seconds", "source")},
            "source": src}


def run_to_completion(fn, max_runs: int = 100, **kw) -> tuple[dict, int]:
    """Call fn(**kw) until it finishes; return (manifest, interrupted runs)."""
    for stops in range(max_runs):
        try:
            return fn(**kw), stops
        except PrepareStopped:
            continue
    raise AssertionError("never finished")


def test_streaming_writes_the_shards_of_the_in_memory_path(source, tmp_path: Path) -> None:
    a = prepare_fineweb(tmp_path / "mem", dataset=source(False), shard_tokens=211, num_proc=1)
    b = prepare_fineweb(tmp_path / "stream", dataset=source(True), shard_tokens=211, num_proc=2)
    assert a["source"]["streaming"] is False and b["source"]["streaming"] is True
    assert files(tmp_path / "mem") == files(tmp_path / "stream") and stable(a) == stable(b)
    assert len(a["splits"]["train"]["shards"]) > 10
    n_empty = sum(1 for d in DOCS if not d)
    assert b["source"]["documents"] == len(DOCS) and b["source"]["empty_documents_dropped"] == n_empty
    assert b["splits"]["train"]["documents"] == len(DOCS) - n_empty and b["splits"]["val"]["tokens"] == 211


def test_token_budget(source, tmp_path: Path) -> None:
    a = prepare_fineweb(tmp_path / "mem", dataset=source(False), shard_tokens=100, num_proc=1, max_tokens=777)
    b = prepare_fineweb(tmp_path / "stream", dataset=source(True), shard_tokens=100, num_proc=1, max_tokens=777)
    assert files(tmp_path / "mem") == files(tmp_path / "stream") and stable(a) == stable(b)
    assert a["splits"]["train"]["tokens"] + a["splits"]["val"]["tokens"] == 777
    # the budget stops inside a document: it was read, the ones after it were not
    full = prepare_fineweb(tmp_path / "full", dataset=source(False), shard_tokens=100, num_proc=1)
    stream = b"".join(files(tmp_path / "full")[p.name][1024:] for p in
                      list_shards(tmp_path / "full", "val") + list_shards(tmp_path / "full", "train"))
    budget = b"".join(files(tmp_path / "stream")[p.name][1024:] for p in
                      list_shards(tmp_path / "stream", "val") + list_shards(tmp_path / "stream", "train"))
    assert stream[:2 * 777] == budget and full["source"]["documents"] == len(DOCS)
    assert 0 < b["source"]["documents"] < len(DOCS)


@pytest.mark.parametrize("streaming", [True, False])
def test_interrupted_prepare_continues_and_ends_identical(source, tmp_path: Path, streaming: bool) -> None:
    ref = prepare_fineweb(tmp_path / "ref", dataset=source(streaming), shard_tokens=150, num_proc=1)
    got, stops = run_to_completion(lambda: prepare_fineweb(tmp_path / "out", dataset=source(streaming),
                                                           shard_tokens=150, num_proc=1, stop_after_shards=3))
    assert stops == (len(ref["splits"]["train"]["shards"]) + 1) // 3  # every run wrote 3 shards, then stopped
    assert files(tmp_path / "ref") == files(tmp_path / "out") and stable(ref) == stable(got)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no partial dir left


def test_crashes_mid_shard_and_before_the_progress_record(source, tmp_path: Path, monkeypatch) -> None:
    ref = prepare_openwebtext(tmp_path / "ref", dataset=source(True), shard_tokens=120, num_proc=1,
                              val_fraction=0.1)
    assert ref["splits"]["val"]["documents"] > 3 and "seeded hash" in ref["source"]["val"]

    def crash_on_call(obj, name: str, n: int) -> None:
        original, calls = getattr(obj, name), [0]

        def f(*args, **kw):
            calls[0] += 1
            if calls[0] == n:
                raise OSError(f"injected failure in {name}")
            return original(*args, **kw)
        monkeypatch.setattr(obj, name, f)

    # ShardWriter._flush: a shard's write fails; its tokens since the last record were only in memory.
    # atomic_write: the shard is on disk, but the progress record listing it is never written.
    for obj, name, n in [(dw.ShardWriter, "_flush", 4), (dw, "atomic_write", 6), (dw.ShardWriter, "_flush", 2),
                         (dw, "atomic_write", 3)]:
        crash_on_call(obj, name, n)
        with pytest.raises(OSError, match=f"injected failure in {name}"):
            prepare_openwebtext(tmp_path / "out", dataset=source(True), shard_tokens=120, num_proc=1, val_fraction=0.1)
        monkeypatch.undo()
        assert (tmp_path / ".out.partial" / "progress.json").is_file()
    done_before = json.loads((tmp_path / ".out.partial" / "progress.json").read_text())["written"]
    assert done_before > 10 * 120  # the failed runs made progress that the next one keeps
    got = prepare_openwebtext(tmp_path / "out", dataset=source(True), shard_tokens=120, num_proc=1, val_fraction=0.1)
    assert files(tmp_path / "ref") == files(tmp_path / "out") and stable(ref) == stable(got)


def test_other_settings_are_refused_and_restart_discards(source, tmp_path: Path) -> None:
    with pytest.raises(PrepareStopped):
        prepare_fineweb(tmp_path / "out", dataset=source(True), shard_tokens=150, num_proc=1, stop_after_shards=2)
    with pytest.raises(PrepareError, match=r"interrupted data.prepare with other settings \(differs in: shard_tokens\)"
                                           r".*--restart"):
        prepare_fineweb(tmp_path / "out", dataset=source(True), shard_tokens=160, num_proc=1)
    m = prepare_fineweb(tmp_path / "out", dataset=source(True), shard_tokens=160, num_proc=1, restart=True)
    assert m["shard_tokens"] == 160 and all(json.loads(json.dumps(s))["tokens"] <= 160
                                            for s in m["splits"]["train"]["shards"])
    assert sum(len(open_shard(p)) for p in list_shards(tmp_path / "out", "train")) == m["splits"]["train"]["tokens"]


def test_cli_takes_the_new_options(tmp_path: Path) -> None:
    args = dp.build_parser().parse_args(["fineweb", "--out", "x", "--stream", "--max-tokens", "2e9",
                                         "--tokenizer", "cl100k_base", "--restart"])
    assert (args.stream, args.max_tokens, args.tokenizer, args.restart) == (True, 2_000_000_000, "cl100k_base", True)
    with pytest.raises(SystemExit):
        dp.build_parser().parse_args(["fineweb", "--out", "x", "--max-tokens", "1.5"])
