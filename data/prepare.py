"""Tokenize a corpus with the offline GPT-2 BPE into train/val token shards plus manifest.json.

Usage:
    python -m data.prepare text --input notes/ more.jsonl --field text --out data/mytext
    python -m data.prepare openwebtext --out data/openwebtext --num-proc 16   # where the hub is reachable
    python -m data.prepare fineweb --sample sample-10BT --out data/fineweb10B --num-proc 16

Sources:
- openwebtext: HF `Skylion007/openwebtext` (formerly `openwebtext`), 'text' field, train split; val = a held-out fraction of the
  documents (nanoGPT: 0.0005 with seed 2357).
- fineweb: HF `HuggingFaceFW/fineweb` config `--sample` (sample-10BT, sample-100BT, ...), 'text'
  field; val = the first shard of the token stream (modded-nanogpt's fineweb_val_000000.bin).
- text: local .txt (one document per file, paragraph or line: --txt-split), .jsonl/.json and
  .parquet (text in --field) files or folders of them, in the order given.

Every document is tokenized (datasets.map, --num-proc processes) and followed by <|endoftext|>;
shards are written by data/shards.py (256-int32 header, uint16 tokens, --shard-tokens per shard)
into a temp dir next to --out that is renamed into place when complete.

Hub access: `datasets` is imported only after HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are settled.
If either is set in the environment it is obeyed (unless --online); otherwise a 3-second TCP
probe of the hub (or HTTPS proxy) decides, and an unreachable hub means offline mode: a copy in
the local HF cache still works, anything else fails at once with a message saying what to run,
instead of sitting in datasets' download retries. --online fails at once if the probe fails.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from data.shards import SPLITS, ShardWriter, format_info, write_manifest
from data.tokenizer import EOT_ID, get_encoding, tokenizer_info

OWT_VAL_FRACTION = 0.0005  # nanoGPT data/openwebtext/prepare.py
OWT_SEED = 2357
OWT_HUB_ID = "Skylion007/openwebtext"  # the hub's canonical id of the old `openwebtext` alias
FINEWEB_HUB_ID = "HuggingFaceFW/fineweb"
DEFAULT_SHARD_TOKENS = 100_000_000  # modded-nanogpt: 10**8 tokens (200 MB) per shard
FINEWEB_SAMPLES = ("sample-10BT", "sample-100BT", "sample-350BT")
LOCAL_EXTS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


class PrepareError(RuntimeError):
    """A user-facing problem with the inputs or the environment (printed without a traceback)."""


# ----------------------------------------------------------------------------- hub access

def _env_offline() -> bool | None:
    """True/False if the environment decides offline mode, None if it says nothing."""
    vals = [os.environ[v] for v in OFFLINE_VARS if v in os.environ]
    if not vals:
        return None
    return any(v.strip().upper() in {"1", "ON", "YES", "TRUE"} for v in vals)


def _probe_target() -> tuple[str, int]:
    """The hub endpoint's host:port, or the HTTPS proxy's when one is configured."""
    proxy = next((os.environ[v] for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(v)), None)
    url = urlparse(proxy if proxy and "://" in proxy else f"http://{proxy}" if proxy
                   else os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connect to the hub (or proxy), bounded by `timeout` including DNS (in a thread)."""
    host, port = _probe_target()
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(ok)


def configure_hub_access(mode: str) -> bool:
    """Settle offline mode before `datasets` is imported; return True if offline.
    auto: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE if set, else online iff the probe reaches the hub;
    online: the probe must reach the hub (else PrepareError at once, not datasets' ~25 s of
    retries); offline: local HF cache only."""
    if mode not in ("auto", "online", "offline"):
        raise ValueError(f"hub mode must be auto, online or offline, got {mode!r}")
    env = _env_offline()
    if mode == "offline" or (mode == "auto" and env):
        offline = True
    elif hub_reachable():
        offline = False
    elif mode == "online":
        host, port = _probe_target()
        raise PrepareError(f"--online, but {host}:{port} is unreachable from this machine (3 s probe). Run this "
                           f"command where the hub is reachable (set HF_ENDPOINT for a mirror, HTTPS_PROXY for "
                           f"a proxy), or prepare local files with `python -m data.prepare text --input PATH "
                           f"... --out DIR`")
    else:
        offline = True
    if "datasets" in sys.modules:
        import datasets.config
        if bool(datasets.config.HF_HUB_OFFLINE) != offline:
            raise PrepareError("`datasets` was imported before the hub mode was set; run data.prepare "
                               "as its own process (python -m data.prepare ...)")
        return offline
    for var in OFFLINE_VARS:
        os.environ[var] = "1" if offline else "0"
    return offline


def load_hub(path: str, name: str | None, *, offline: bool, num_proc: int | None,
             cache_dir: str | None, subcommand: str, revision: str | None = None) -> Any:
    """`datasets.load_dataset(path, name, split="train")`; offline misses become one clear error."""
    import datasets

    try:
        return datasets.load_dataset(path, name=name, split="train", revision=revision,
                                     num_proc=num_proc if num_proc and num_proc > 1 else None, cache_dir=cache_dir)
    except Exception as e:  # what a miss raises differs between datasets versions
        if "scripts are no longer supported" in str(e):
            raise PrepareError(f"{path} is a script-based hub dataset, which datasets {datasets.__version__} "
                               f"no longer runs; read the hub's parquet conversion instead: add "
                               f"`--revision refs/convert/parquet`") from e
        if not offline:
            raise
        target = f"{path}" + (f" ({name})" if name else "")
        raise PrepareError(
            f"the hub dataset {target} is not in the local HF cache and the hub is offline "
            f"(unreachable, or HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set). Run `python -m data.prepare "
            f"{subcommand} --online ...` on a machine that reaches huggingface.co (or copy its HF cache "
            f"here), or prepare local files with `python -m data.prepare text --input PATH ... --out DIR`. "
            f"[{type(e).__name__}: {str(e)[:300]}]") from None


# ----------------------------------------------------------------------------- local files

def collect_files(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Expand files and folders (recursively, sorted) to the supported files, in the given order."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in LOCAL_EXTS)
            if not found:
                raise PrepareError(f"folder {p} holds no {'/'.join(LOCAL_EXTS)} files")
            files += found
        elif p.is_file():
            if p.suffix.lower() not in LOCAL_EXTS:
                raise PrepareError(f"{p}: unsupported file type {p.suffix!r}; use {', '.join(LOCAL_EXTS)}")
            files.append(p)
        else:
            raise PrepareError(f"input {p} does not exist")
    return files


def load_local(inputs: Sequence[str | os.PathLike], field: str = "text", txt_split: str = "document",
               cache_dir: str | None = None, num_proc: int | None = None) -> Any:
    """Local files -> one `datasets.Dataset` with a 'text' column, documents in input order."""
    import datasets

    files = collect_files(inputs)
    # consecutive files of one builder type load together; order across runs is kept
    runs: list[tuple[str, list[str]]] = []
    for f in files:
        kind = LOCAL_EXTS[f.suffix.lower()]
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(str(f))
        else:
            runs.append((kind, [str(f)]))
    parts = []
    for kind, paths in runs:
        extra = {"sample_by": txt_split, "keep_linebreaks": True} if kind == "text" else {}
        ds = datasets.load_dataset(kind, data_files=paths, split="train", cache_dir=cache_dir,
                                   num_proc=num_proc if num_proc and num_proc > 1 else None, **extra)
        col = "text" if kind == "text" else field
        if col not in ds.column_names:
            raise PrepareError(f"{paths[0]}{' ...' if len(paths) > 1 else ''} has no field {col!r} "
                               f"(columns: {ds.column_names}); pick the text column with --field")
        ds = ds.select_columns([col])
        if col != "text":
            ds = ds.rename_column(col, "text")
        parts.append(ds)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


# ----------------------------------------------------------------------------- tokenize + write

def _tokenize_batch(batch: dict[str, list], field: str) -> dict[str, list]:
    enc = get_encoding()  # cached per worker process
    ids, lens = [], []
    for text in batch[field]:
        toks = enc.encode_ordinary(text) + [EOT_ID] if text else []  # empty docs add nothing
        ids.append(toks)
        lens.append(len(toks))
    return {"ids": ids, "n": lens}


def tokenize(ds: Any, field: str = "text", num_proc: int | None = None) -> Any:
    """Dataset with a `field` string column -> Dataset with 'ids' (uint16 list, EOT appended) and 'n'."""
    import datasets

    if field not in ds.column_names:
        raise PrepareError(f"dataset has no field {field!r} (columns: {ds.column_names})")
    features = datasets.Features({"ids": datasets.Sequence(datasets.Value("uint16")),
                                  "n": datasets.Value("int64")})
    return ds.map(_tokenize_batch, fn_kwargs={"field": field}, batched=True, batch_size=256,
                  remove_columns=ds.column_names, features=features,
                  num_proc=num_proc if num_proc and num_proc > 1 else None, desc="tokenizing")


def _token_chunks(tok: Any, batch_docs: int = 4096):
    """Yield flat uint16 arrays of the documents' tokens in dataset order."""
    for table in tok.with_format("arrow").iter(batch_size=batch_docs):
        col = table.column("ids").combine_chunks()
        yield col.flatten().to_numpy(zero_copy_only=False)


def _count_tokens(tok: Any) -> int:
    import pyarrow.compute as pc

    return sum(int(pc.sum(t.column("n")).as_py() or 0) for t in tok.with_format("arrow").iter(batch_size=65536))


def write_shards(out_dir: Path, splits: dict[str, Any], shard_tokens: int, val_shards: int = 0) -> dict:
    """Write tokenized datasets as shards. splits: {"train": ds, "val": ds} (val may be absent);
    with val_shards > 0 a single "train" stream is given and its first val_shards * shard_tokens
    tokens become the val split instead. Returns {split: {"documents", "tokens", "shards"}}."""
    from tqdm.auto import tqdm

    writers = {s: ShardWriter(out_dir, s, shard_tokens) for s in SPLITS}
    docs = dict.fromkeys(SPLITS, 0)
    val_budget = val_shards * shard_tokens
    for split, tok in splits.items():
        total = _count_tokens(tok)
        docs[split] = len(tok)
        # disable=None: a bar on terminals only, no carriage-return spam in batch logs
        with tqdm(total=total, unit="tok", unit_scale=True, desc=f"writing {split}", disable=None) as bar:
            for chunk in _token_chunks(tok):
                bar.update(chunk.size)
                if val_budget:
                    head = chunk[:val_budget]
                    writers["val"].add(head)
                    val_budget -= head.size
                    chunk = chunk[head.size:]
                writers[split].add(chunk)
    out = {}
    for s, w in writers.items():
        shards = w.close()
        out[s] = {"documents": docs[s], "tokens": sum(x["tokens"] for x in shards), "shards": shards}
    if val_shards:
        out["val"]["documents"] = None  # the cut falls inside a document; counted only for train+val
    return out


def check_out(out: str | os.PathLike, overwrite: bool) -> None:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise PrepareError(f"--out {out} exists and is not empty; pass --overwrite to replace it or pick "
                           f"another directory")


def prepare(ds: Any, out: str | os.PathLike, *, source: dict, field: str = "text",
            val_fraction: float | None = None, val_shards: int = 0, seed: int = OWT_SEED,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, num_proc: int | None = None,
            max_docs: int | None = None, overwrite: bool = False) -> dict:
    """Tokenize `ds` (a datasets.Dataset with a `field` text column), split it into train/val
    (a held-out document fraction via train_test_split(seed), or the first `val_shards` shards
    of the token stream; neither: no val) and write shards + manifest.json into `out`. Returns the manifest."""
    t0 = time.perf_counter()
    out = Path(out)
    if val_fraction and val_shards:
        raise PrepareError(f"give --val-fraction ({val_fraction}) or --val-shards ({val_shards}), not both")
    if val_fraction is not None and not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if val_shards < 0:
        raise PrepareError(f"--val-shards must be >= 0, got {val_shards}")
    check_out(out, overwrite)
    if max_docs is not None:
        ds = ds.select(range(min(max_docs, len(ds))))
    if len(ds) == 0:
        raise PrepareError("the input holds no documents")
    tok = tokenize(ds, field, num_proc)
    n_empty = len(tok)
    # drop empty documents so a held-out val doc always has tokens
    tok = tok.filter(lambda ns: [n > 0 for n in ns], input_columns="n", batched=True, batch_size=65536)
    n_empty -= len(tok)
    if len(tok) == 0:
        raise PrepareError(f"all {len(ds)} input documents are empty")
    if val_fraction:
        if len(tok) < 2:
            raise PrepareError(f"cannot hold out a val fraction of {len(tok)} document; use --val-fraction 0, "
                               f"--val-shards 1, or more documents (--txt-split paragraph cuts .txt files)")
        parts = tok.train_test_split(test_size=val_fraction, seed=seed, shuffle=True)
        splits = {"train": parts["train"], "val": parts["test"]}
    else:
        splits = {"train": tok}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        counts = write_shards(tmp, splits, shard_tokens, val_shards)
        if counts["train"]["tokens"] == 0:
            raise PrepareError("no train tokens were produced (empty documents, or everything went to val); "
                               "lower --val-shards / --val-fraction or add data")
        val_rule = (f"held-out document fraction {val_fraction} (train_test_split seed {seed})" if val_fraction
                    else f"first {val_shards} shard(s) of the token stream" if val_shards else "none")
        manifest = {
            "format": format_info(),
            "source": {**source, "field": field, "documents": len(ds), "empty_documents_dropped": n_empty,
                       "val": val_rule},
            "tokenizer": tokenizer_info(),
            "shard_tokens": shard_tokens,
            "splits": counts,
            "command": " ".join(sys.argv) if sys.argv and sys.argv[0].endswith("prepare.py") else None,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "prepare_seconds": round(time.perf_counter() - t0, 3),
        }
        write_manifest(tmp, manifest)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


# ----------------------------------------------------------------------------- sources

def prepare_openwebtext(out: str | os.PathLike, *, dataset: Any = None, val_fraction: float = OWT_VAL_FRACTION,
                        seed: int = OWT_SEED, hub: str = "auto", cache_dir: str | None = None,
                        hub_id: str = OWT_HUB_ID, revision: str | None = None, **kw: Any) -> dict:
    """OpenWebText as nanoGPT prepared it. `dataset`: an already loaded Dataset of the same schema
    (a 'text' column; tests pass local files), else the hub's OpenWebText train split."""
    source = {"name": "openwebtext", "hub_id": hub_id, "revision": revision, "split": "train"}
    if dataset is None:
        check_out(out, kw.get("overwrite", False))
        offline = configure_hub_access(hub)
        dataset = load_hub(hub_id, None, offline=offline, num_proc=kw.get("num_proc"), revision=revision,
                           cache_dir=cache_dir, subcommand="openwebtext")
    return prepare(dataset, out, source=source, field="text", val_fraction=val_fraction, seed=seed, **kw)


def prepare_fineweb(out: str | os.PathLike, *, sample: str = "sample-10BT", dataset: Any = None,
                    val_shards: int = 1, val_fraction: float | None = None, hub: str = "auto",
                    cache_dir: str | None = None, hub_id: str = FINEWEB_HUB_ID, revision: str | None = None,
                    **kw: Any) -> dict:
    """FineWeb sample `sample`; val = first `val_shards` shards of tokens (modded-nanogpt) unless
    val_fraction is given. `dataset`: an already loaded Dataset with a 'text' column."""
    source = {"name": "fineweb", "hub_id": hub_id, "revision": revision, "config": sample, "split": "train"}
    if dataset is None:
        check_out(out, kw.get("overwrite", False))
        offline = configure_hub_access(hub)
        dataset = load_hub(hub_id, sample, offline=offline, num_proc=kw.get("num_proc"), revision=revision,
                           cache_dir=cache_dir, subcommand=f"fineweb --sample {sample}")
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

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="source", required=True, metavar="{openwebtext,fineweb,text}")

    def common(sp: argparse.ArgumentParser, val_fraction: float | None, val_shards: int) -> None:
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
                        help="tokenizer processes (datasets.map num_proc)")
        sp.add_argument("--max-docs", type=int, default=None, help="use only the first N documents (smoke runs)")
        sp.add_argument("--cache-dir", default=None, help="HF datasets cache (default: HF_DATASETS_CACHE)")
        sp.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")

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

    owt = sub.add_parser("openwebtext", help="HF openwebtext (nanoGPT's split)")
    common(owt, OWT_VAL_FRACTION, 0)
    hub_flags(owt, OWT_HUB_ID)
    fw = sub.add_parser("fineweb", help="HF HuggingFaceFW/fineweb sample")
    fw.add_argument("--sample", default="sample-10BT",
                    help=f"FineWeb config name (default sample-10BT; also {', '.join(FINEWEB_SAMPLES[1:])}, ...)")
    common(fw, None, 1)
    hub_flags(fw, FINEWEB_HUB_ID)
    tx = sub.add_parser("text", help="local .txt/.jsonl/.json/.parquet files or folders")
    tx.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or folders")
    tx.add_argument("--field", default="text", help="text field of .jsonl/.json/.parquet records (default text)")
    tx.add_argument("--txt-split", choices=("document", "paragraph", "line"), default="document",
                    help="a .txt file is one document (default), or one per blank-line paragraph / line")
    common(tx, 0.05, 0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kw = dict(shard_tokens=args.shard_tokens, num_proc=args.num_proc, max_docs=args.max_docs,
              overwrite=args.overwrite, cache_dir=args.cache_dir)
    val = dict(val_fraction=args.val_fraction, val_shards=args.val_shards)
    try:
        if args.source == "text":
            # local builders need no hub; keep `datasets` off the network unless the env says otherwise
            if _env_offline() is None and "datasets" not in sys.modules:
                for var in OFFLINE_VARS:
                    os.environ[var] = "1"
            if args.val_shards:
                val["val_fraction"] = None
            manifest = prepare_text(args.out, args.input, field=args.field, txt_split=args.txt_split,
                                    seed=args.seed, **val, **kw)
        elif args.source == "openwebtext":
            if args.val_shards:
                raise PrepareError("openwebtext holds out --val-fraction documents (nanoGPT); --val-shards "
                                   "is for fineweb/text")
            manifest = prepare_openwebtext(args.out, val_fraction=args.val_fraction, seed=args.seed,
                                           hub=args.hub, hub_id=args.hub_id, revision=args.revision, **kw)
        else:
            manifest = prepare_fineweb(args.out, sample=args.sample, hub=args.hub, seed=args.seed,
                                       hub_id=args.hub_id, revision=args.revision,
                                       val_shards=args.val_shards, val_fraction=args.val_fraction, **kw)
    except PrepareError as e:
        print(f"data.prepare: error: {e}", file=sys.stderr)
        return 2
    s = manifest["splits"]
    print(f"wrote {args.out}: train {s['train']['tokens']:,} tokens in {len(s['train']['shards'])} shard(s), "
          f"val {s['val']['tokens']:,} tokens in {len(s['val']['shards'])} shard(s), "
          f"{manifest['prepare_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
