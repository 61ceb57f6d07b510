"""The built-in pydoc corpus: documents, deterministic split, shards that decode back, and a
race of two processes preparing it into the same cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from data import resolve_dataset
from data.builtin import builtin_dir, documents, prepare_builtin
from data.loader import ShardLoader, val_batches
from data.shards import list_shards, open_shard
from data.tokenizer import get_encoding

ROOT = Path(__file__).resolve().parents[2]
EOT = "<|endoftext|>"


def test_documents_are_real_english_sections() -> None:
    from pydoc_data.topics import topics

    docs = documents()
    assert len(docs) > len(topics)  # topics are cut at their section headings
    assert len({d for d, _ in docs}) == len(docs)
    joined = "".join(t for _, t in docs)
    assert len(joined) > 0.95 * sum(len(t) for t in topics.values())  # nothing but blank lines lost
    assert any('The "assert" statement' in t for _, t in docs)
    words = joined.split()
    assert sum(w.lower() in {"the", "a", "is", "of"} for w in words) > 0.05 * len(words)


def test_prepared_shards_decode_to_the_documents(tmp_path: Path) -> None:
    out = resolve_dataset("builtin", cache_dir=str(tmp_path))
    assert out == builtin_dir(tmp_path) and out.parent == tmp_path / "datasets"
    m = json.loads((out / "manifest.json").read_text())
    docs = [t for _, t in documents()]
    enc = get_encoding()
    for split, want in (("train", [t for i, t in enumerate(docs) if i % 10 != 9]),
                        ("val", docs[9::10])):
        tokens = np.concatenate([np.asarray(open_shard(p)) for p in list_shards(out, split)]).astype(np.int64)
        assert enc.decode(tokens.tolist()).split(EOT)[:-1] == want
        assert m["splits"][split]["documents"] == len(want) and m["splits"][split]["tokens"] == len(tokens)
    assert 0.08 < m["splits"]["val"]["tokens"] / m["splits"]["train"]["tokens"] < 0.15
    assert m["source"]["license"] == "PSF License Agreement"
    # second call: reuse, no rebuild
    mtime = (out / "manifest.json").stat().st_mtime_ns
    assert prepare_builtin(tmp_path) == out and (out / "manifest.json").stat().st_mtime_ns == mtime
    # the default geometry trains and evaluates on it
    x, y = ShardLoader(out, "train", 8, 256, 1, 2, seed=0).next_batch()
    assert x.shape == (8, 256) and bool((x[:, 1:] == y[:, :-1]).all())
    assert len(list(val_batches(out, 8, 256, 0, 2, None))) >= 3


def test_two_processes_racing_share_one_complete_copy(tmp_path: Path) -> None:
    code = ("import sys; from data.builtin import prepare_builtin; "
            "print(prepare_builtin(sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    dirs = {o[0].strip() for o in outs}
    assert dirs == {str(builtin_dir(tmp_path))}
    assert sorted(p.name for p in (tmp_path / "datasets").iterdir()) == [builtin_dir(tmp_path).name]  # no temp dirs
    assert sorted(p.name for p in builtin_dir(tmp_path).iterdir()) == ["manifest.json", "train_000000.bin",
                                                                       "val_000000.bin"]


def test_losing_the_rename_race_returns_the_winners_copy(tmp_path: Path, monkeypatch) -> None:
    import data.builtin as b

    winner = prepare_builtin(tmp_path)
    calls = []
    real = b.read_manifest

    def stale_first_look(d):  # the first existence check ran before the other rank's rename
        calls.append(d)
        return None if len(calls) == 1 else real(d)

    monkeypatch.setattr(b, "read_manifest", stale_first_look)
    assert prepare_builtin(tmp_path) == winner and len(calls) == 2
    assert sorted(p.name for p in (tmp_path / "datasets").iterdir()) == [winner.name]
