"""What the reproduction framework (bench.reproduce) shares with the lab tools that read its runs
(bench.time_to_loss): the model / corpus settings (`SETTINGS`), the scales' overrides and their
merge (`merge_overrides`), and the run store's entries (<results>/store/<run name>.json.gz:
`store_file`, `load_stored`, `write_gz_json`). It imports no study, so a tool that reads runs does
not import bench.reproduce, whose package registers every study, and a study may import the tool.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from util import replaced_from_temp

QUICK_OVERRIDES = ("model.preset=debug", "data.batch_size=2", "data.seq_len=32", "optim.lr=1e-3",
                   "optim.warmup_steps=2")
# the README's quality setting (tiny GPT-2++, built-in corpus), a little more data per step
FULL_OVERRIDES = ("model.preset=tiny", "data.batch_size=4", "data.seq_len=128", "optim.lr=1e-3",
                  "optim.warmup_steps=20")


DEFAULT_SETTING = "tiny-builtin"


@dataclass(frozen=True)
class Setting:
    """A model / corpus setting every study can run on: overrides placed after the scale's own (same key:
    the setting's value replaces the scale's). Its name is part of the results and work directories, so the
    runs and tables of two settings never share a store or a table."""
    name: str
    description: str
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    evals: int = 0          # full scale: evaluations per run (0: the scale's, every tenth of the run) ...
    eval_steps: int = 0     # ... of this many global batches (0: the scale's)
    steps: int = 0          # full scale: the steps of every study's runs (0: each study's own)
    lr_from: str = ""       # --lr from-sweep reads this setting's sweep ("": its own); same overrides required
    vocab: int = 0          # its corpus's vocabulary (0: the preset's), for predictions where the corpus is absent


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting(DEFAULT_SETTING, "tiny preset (GPT-2 vocabulary, 94 % embedding and head), built-in corpus (~110K "
                             "tokens: a 300-step run at 4 ranks reads it about five times)"),
    Setting("study-prose", "study preset (8 x 320, 79 % attn / mlp matrices), prose corpus (data/prose: "
                           "`python -m bench.prose --out data/prose`), its 8192-id BPE, read in shuffled "
                           "windows (data.order=shuffled: every rank and row unrelated text, no token twice)",
            full=("model.preset=study", "data.dataset=data/prose", "data.order=shuffled"),
            quick=("data.dataset=data/prose", "data.order=shuffled"),
            # the verdicts are final val losses: 64 global batches (131K tokens at 4 ranks, a quarter of the val
            # split, in windows spread over all of it) instead of 8, three times a run
            evals=3, eval_steps=64, vocab=8192),
    # the first study-prose runs (2026-11-26), superseded: the train stream read in order, so the four ranks of
    # a step read adjacent chunks of one document (correlated workers), and evaluation the val split's first
    # quarter; kept so that its committed lr sweep rebuilds from its store
    Setting("study-prose-sequential", "as study-prose, but the train stream read in order (the four ranks of a "
                                      "step read adjacent chunks of one document; superseded)",
            full=("model.preset=study", "data.dataset=data/prose"), quick=("data.dataset=data/prose",),
            evals=3, eval_steps=64, vocab=8192),
    # the verdicts that are claims about longer training (1-bit Adam's divergence, Fig. 20; Dion's error feedback
    # at low rank, Dion §4.1) at 4x study-prose's 300 steps, each arm at study-prose's swept lr (its best values
    # lay inside their grids at 300 steps; re-sweep only if a best sits at an edge at this length)
    Setting("study-prose-1200", "as study-prose, 1,200 steps per run (4x), evaluated every 200 steps; each arm at "
                                "study-prose's swept lr (--lr from-sweep reads study-prose's sweep)",
            full=("model.preset=study", "data.dataset=data/prose", "data.order=shuffled"),
            quick=("data.dataset=data/prose", "data.order=shuffled"),
            evals=6, eval_steps=64, steps=1200, lr_from="study-prose", vocab=8192),
)}


def merge_overrides(base: Sequence[str], extra: Sequence[str]) -> tuple[str, ...]:
    """`base` with every key that `extra` sets removed, then `extra`: one value per key in the spec."""
    keys = {o.partition("=")[0] for o in extra}
    return (*(o for o in base if o.partition("=")[0] not in keys), *extra)


def store_file(store: Path, name: str) -> Path:
    return store / f"{name}.json.gz"


def write_gz_json(path: Path, obj: dict) -> None:
    """gzip without a timestamp, written atomically: the same entry gives the same bytes (no git churn)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replaced_from_temp(path, ".tmp") as tmp, open(tmp, "wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write((json.dumps(obj, separators=(",", ":")) + "\n").encode())


def load_stored(store: Path | None, name: str) -> dict | None:
    """The store's entry for run `name`, or None (no store, no entry, or an unreadable one)."""
    if store is None or not store_file(store, name).is_file():
        return None
    try:
        with gzip.open(store_file(store, name), "rt") as f:
            return json.load(f)
    except (OSError, EOFError, json.JSONDecodeError):
        return None
