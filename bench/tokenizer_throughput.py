"""Tokenizer throughput on the built-in corpus, and the time to prepare that corpus.

    OMP_NUM_THREADS=1 python -m bench.tokenizer_throughput [--repeats 5]

Prints MB/s of UTF-8 text through `data.tokenizer.get_encoding().encode_ordinary` (one thread,
per document, best of --repeats) and through `encode_ordinary_batch` with N threads, then the
seconds `data.builtin.write_corpus` takes into a fresh temp dir inside the project cache.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
import uuid

from data.builtin import documents, write_corpus
from data.tokenizer import cache_root, get_encoding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()

    t0 = time.perf_counter()
    enc = get_encoding()
    load_s = time.perf_counter() - t0
    texts = [t for _, t in documents()]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    n_tok = sum(len(enc.encode_ordinary(t)) for t in texts)

    def best(fn) -> float:
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    single = best(lambda: [enc.encode_ordinary(t) for t in texts])
    batch = best(lambda: enc.encode_ordinary_batch(texts, num_threads=args.threads))
    out = cache_root() / f"bench-builtin-{uuid.uuid4().hex[:8]}"
    out.mkdir(parents=True)
    try:
        t = time.perf_counter()
        m = write_corpus(out)
        prep = time.perf_counter() - t
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"corpus: {len(texts)} docs, {mb:.3f} MB UTF-8, {n_tok:,} tokens ({mb * 1e6 / n_tok:.2f} bytes/token)")
    print(f"tokenizer load (hash check + BPE ranks): {load_s:.3f} s")
    print(f"encode_ordinary, 1 thread:          {mb / single:6.2f} MB/s  ({n_tok / single / 1e6:.2f} M tok/s)")
    print(f"encode_ordinary_batch, {args.threads} threads:  {mb / batch:6.2f} MB/s  ({n_tok / batch / 1e6:.2f} M tok/s)")
    print(f"prepare builtin (tokenize + write shards + manifest): {prep:.3f} s; "
          f"train {m['splits']['train']['tokens']:,} / val {m['splits']['val']['tokens']:,} tokens")


if __name__ == "__main__":
    main()
