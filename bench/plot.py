"""Plots from several runs' metrics.jsonl: validation loss against step, against wall-clock
(Lion Cub Fig. 8) and against training tokens, and the Lion Cub diagnostics over training (sign match / flip, Fig. 4; vote tie
rate, Table 3; per-layer momentum spread across workers, Fig. 6 / Fig. 17).

    python -m bench.plot bench/out/quality/runs/* --out bench/out/plots
    python -m bench.plot runs/a runs/b --labels "Lion,Lion Cub 4-bit" --out bench/out/plots

Each positional argument is a run directory (holding metrics.jsonl) or a metrics.jsonl file; the
label defaults to the directory name (with its parents' names where two runs share it). Wall-clock is the trainer's train_time_s (seconds inside
timed train steps: evaluation, checkpoints and diagnostics excluded). Writes val_loss.png,
diagnostics.png and momentum_spread.png (the last two only when a run has diag/* records).
Each plotting function returns the series it drew, {panel: {label: (xs, ys)}}, so tests can check
the content and not just that a file appeared.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Sequence

from bench.variants import read_jsonl
from model import ROLES

Series = dict[str, dict[str, tuple[list[float], list[float]]]]


def _default_labels(dirs: Sequence[Path]) -> list[str]:
    """Each run's directory name, or as many of its last path parts as tell it from the others (seedA/run and
    seedB/run where both are named run)."""
    parts = [d.resolve().parts for d in dirs]
    labels = []
    for i, ps in enumerate(parts):
        for k in range(1, len(ps) + 1):
            tail = ps[-k:]
            if all(tail != q[-k:] for j, q in enumerate(parts) if j != i) or k == len(ps):
                labels.append("/".join(tail))
                break
    return labels


def load_runs(paths: Sequence[str | Path], labels: Sequence[str] | None = None) -> dict[str, list[dict]]:
    """{label: records} for run directories or metrics.jsonl files (clear error if one is missing). The label
    defaults to the run's directory name, with as many parent names as tell two runs of one name apart; two
    runs never share a label (one would hide the other's curve)."""
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"got {len(labels)} labels for {len(paths)} runs; give one label per run")
    files, dirs = [], []
    for p in map(Path, paths):
        f = p / "metrics.jsonl" if p.is_dir() else p
        if not f.is_file():
            raise FileNotFoundError(f"{f} does not exist: pass run directories holding metrics.jsonl")
        files.append(f)
        dirs.append(f.parent)
    if len({f.resolve() for f in files}) < len(files):
        dup = next(p for p, f in zip(paths, files) if [g.resolve() for g in files].count(f.resolve()) > 1)
        raise ValueError(f"{dup}: given twice; give each run once")
    names = list(labels) if labels is not None else _default_labels(dirs)
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"--labels: {dup!r} given to two runs; give each run its own label")
    return {name: read_jsonl(f) for name, f in zip(names, files)}


def _xy(records: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    pts = {r[x]: r[y] for r in records if x in r and y in r}  # a repeated x (re-logged eval) keeps the last
    xs = sorted(pts)
    return xs, [pts[a] for a in xs]


def _plt():
    from bench import require

    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(path: Path, panels: Series, titles: dict[str, str], ylog: set[str] = frozenset(),
          xlabels: dict[str, str] | None = None, ncols: int = 2) -> None:
    plt = _plt()
    names = list(panels)
    nrows = (len(names) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for label, (xs, ys) in panels[name].items():
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
        ax.set_title(titles.get(name, name), fontsize=10)
        ax.set_xlabel((xlabels or {}).get(name, "step"))
        if name in ylog:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _tokens_at(recs: list[dict], steps: Sequence[float]) -> list[float | None]:
    """Training tokens seen at each step, linear between the train records' cumulative `tokens` (None outside
    them: a run that does not log tokens, or a step before its first record)."""
    xs, ys = _xy([r for r in recs if "train_loss" in r], "step", "tokens")
    pts = list(zip([0.0, *xs], [0.0, *ys])) if xs else []
    out = []
    for s in steps:
        out.append(next((y0 + (y1 - y0) * (s - x0) / (x1 - x0) for (x0, y0), (x1, y1) in zip(pts, pts[1:])
                         if x0 <= s <= x1 and x1 > x0), None))
    return out


def plot_loss(runs: dict[str, list[dict]], path: str | Path) -> Series:
    """Val loss vs step, vs wall-clock (train_time_s of the eval record) and vs training tokens (runs whose
    global batch differs are compared at equal data only there), one line per run."""
    panels: Series = {"val_vs_step": {}, "val_vs_time": {}, "val_vs_tokens": {}}
    for label, recs in runs.items():
        vals = [r for r in recs if "val_loss" in r]
        panels["val_vs_step"][label] = _xy(vals, "step", "val_loss")
        panels["val_vs_time"][label] = _xy(vals, "train_time_s", "val_loss")
        xs, ys = panels["val_vs_step"][label]
        toks = [(t, y) for t, y in zip(_tokens_at(recs, xs), ys) if t is not None]
        if toks:
            panels["val_vs_tokens"][label] = ([t for t, _ in toks], [y for _, y in toks])
    if not panels["val_vs_tokens"]:   # no run logs tokens: no empty panel
        del panels["val_vs_tokens"]
    _draw(Path(path), panels, {"val_vs_step": "validation loss vs step",
                               "val_vs_time": "validation loss vs wall-clock (Fig. 8)",
                               "val_vs_tokens": "validation loss vs training tokens"},
          xlabels={"val_vs_time": "train time (s)", "val_vs_tokens": "tokens"})
    return panels


def plot_diagnostics(runs: dict[str, list[dict]], path: str | Path) -> Series:
    """Sign match, sign flip and tie rate (overall) over steps, one line per run with diagnostics."""
    keys = {"sign_match": "sign match vs exact Lion", "sign_flip": "sign flip vs exact Lion",
            "tie_rate": "vote tie rate"}
    panels: Series = {k: {} for k in keys}
    for label, recs in runs.items():
        for k in keys:
            xs, ys = _xy(recs, "step", f"diag/{k}")
            if xs:
                panels[k][label] = (xs, ys)
    _draw(Path(path), panels, keys)
    return panels


def plot_momentum_spread(runs: dict[str, list[dict]], path: str | Path) -> Series:
    """Per-layer momentum spread across workers over steps (Fig. 6): one panel per run, one line per role."""
    panels: Series = {}
    for label, recs in runs.items():
        lines = {}
        for role in ROLES:
            xs, ys = _xy(recs, "step", f"diag/momentum_spread/{role}")
            if xs:
                lines[role] = (xs, ys)
        if lines:
            panels[label] = lines
    _draw(Path(path), panels, {k: f"{k}: momentum spread (max std over ranks)" for k in panels}, ylog=set(panels))
    return panels


def plot_time_to_loss(panels: Series, path: str | Path, target: float, metric: str = "val_loss") -> Series:
    """Loss against wall time (bench.time_to_loss): one panel per setting (simulated link, cluster),
    one line per variant, the target as a dashed line."""
    plt = _plt()
    names = list(panels) or ["(no step times)"]
    fig, axes = plt.subplots(1, len(names), figsize=(5.6 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        for label, (xs, ys) in panels.get(name, {}).items():
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
        ax.axhline(target, color="k", linestyle="--", linewidth=0.8, label=f"target {target:.3f}")
        ax.set_title("\n".join(textwrap.wrap(name, 60)), fontsize=9)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return panels


def has_diagnostics(runs: dict[str, list[dict]]) -> bool:
    return any("diag/sign_match" in r for recs in runs.values() for r in recs)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories (with metrics.jsonl) or metrics.jsonl files")
    ap.add_argument("--labels", default=None, help="comma-separated labels, one per run")
    ap.add_argument("--out", default="bench/out/plots", help="where the PNGs go (default: %(default)s); the same "
                                                            "names there are replaced")
    ap.add_argument("--prefix", default="", help="prefix for the PNG names")
    args = ap.parse_args(argv)
    try:
        runs = load_runs(args.runs, args.labels.split(",") if args.labels else None)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{args.prefix}val_loss.png"]
    plot_loss(runs, written[0])
    if has_diagnostics(runs):
        written += [out / f"{args.prefix}diagnostics.png", out / f"{args.prefix}momentum_spread.png"]
        plot_diagnostics(runs, written[1])
        plot_momentum_spread(runs, written[2])
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
