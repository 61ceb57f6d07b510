"""Lion Cub quality experiment: same model, data, steps and seed for
every variant on P ranks; final validation loss and the Lion Cub diagnostics averaged over the run.

    python -m bench.quality                                   # 6 variants, 4 ranks, tiny untied GPT
    python -m bench.quality --variants lion_fp32 lioncub_8bit_l1 --steps 60 --out bench/out/quality
    python -m bench.quality --variants lion_fp32,lioncub_1bit data.batch_size=2   # key=value: every run

A variant whose run directory under --out/runs holds an earlier run is refused (--overwrite trains it
again, --report-only tabulates it); a config the trainer would refuse is refused before any rank starts.

Columns: final val loss; mean over diagnostic steps of sign match / sign flip against exact Lion
sign(mean_i c_i) (Lion Cub Fig. 4) and of the vote tie rate (Table 3); the momentum spread across
workers (max over elements of the std across ranks, Fig. 6) for embedding and head vs the largest
of the other layers (attn, mlp, norm), averaged over diagnostic steps. Gradient-sync variants
(lion_fp32) have one shared momentum and exact signs: their diagnostic columns are empty.
Writes quality.csv, quality.md and the per-run dirs under --out/runs; plot them with bench.plot.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from bench.variants import ROOT, read_jsonl, train_records, variant_args
from model import IO_ROLES, ROLES
from trainer.config import ConfigError, load_config
from util.cli import path_arg, shown

DEFAULT_VARIANTS = ["lion_fp32", "dlion_mavo", "lioncub_1bit", "lioncub_1bit_plus", "lioncub_4bit", "lioncub_8bit_l1"]
DEFAULT_OVERRIDES = ["model.preset=tiny", "model.tie_embeddings=false", "data.batch_size=4", "data.seq_len=128",
                     "optim.lr=1e-3", "optim.warmup_steps=10"]
OTHER_ROLES = tuple(r for r in ROLES if r not in IO_ROLES)
COLUMNS = ["variant", "final_val_loss", "final_train_loss", "train_time_s", "sign_match", "sign_match_head",
           "sign_match_attn", "sign_match_mlp", "sign_flip", "tie_rate",
           "spread_embedding", "spread_head", "spread_other", "spread_ratio", "n_diag"]


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize_quality(records: list[dict]) -> dict:
    """One row from a run's metrics.jsonl records (pure; tested on synthetic records)."""
    vals = sorted((r for r in records if "val_loss" in r), key=lambda r: r["step"])
    trains = train_records(records)
    diags = [r for r in records if "diag/sign_match" in r]
    out: dict = {"final_val_loss": vals[-1]["val_loss"] if vals else None,
                 "final_train_loss": trains[-1]["train_loss"] if trains else None,
                 "train_time_s": trains[-1].get("train_time_s") if trains else None, "n_diag": len(diags)}
    for key, name in (("diag/sign_match", "sign_match"), ("diag/sign_flip", "sign_flip"),
                      ("diag/tie_rate", "tie_rate")):
        out[name] = _mean([r[key] for r in diags if key in r])
    for role in ("head", "attn", "mlp"):  # per layer type: the embedding's unused rows dominate the overall rate
        out[f"sign_match_{role}"] = _mean([r[f"diag/sign_match/{role}"] for r in diags if f"diag/sign_match/{role}" in r])
    for role in ("embedding", "head"):
        out[f"spread_{role}"] = _mean([r[f"diag/momentum_spread/{role}"] for r in diags
                                       if f"diag/momentum_spread/{role}" in r])
    others = [max(r[f"diag/momentum_spread/{k}"] for k in OTHER_ROLES if f"diag/momentum_spread/{k}" in r)
              for r in diags if any(f"diag/momentum_spread/{k}" in r for k in OTHER_ROLES)]
    out["spread_other"] = _mean(others)
    io = [x for x in (out["spread_embedding"], out["spread_head"]) if x is not None]
    out["spread_ratio"] = max(io) / out["spread_other"] if io and out["spread_other"] else None
    return out


def _f(x: object, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def quality_markdown(rows: list[dict]) -> str:
    lines = ["| variant | final val loss | sign match % | match head / attn / mlp % | sign flip % | tie rate % | "
             "spread emb | spread head | spread other (max) | (emb, head) / other | train time (s) |",
             "|---|" + "---:|" * 10]
    for r in rows:
        if r.get("status", "ok") != "ok":
            lines.append(f"| {r['variant']} | {r['status']} |" + " |" * 9)
            continue
        pct = lambda x: _f(None if x is None else 100 * x, ".1f")  # noqa: E731
        roles = " / ".join(pct(r.get(f"sign_match_{k}")) for k in ("head", "attn", "mlp"))
        lines.append(f"| {r['variant']} | {_f(r['final_val_loss'], '.4f')} | {pct(r['sign_match'])} | {roles} | "
                     f"{pct(r['sign_flip'])} | {pct(r['tie_rate'])} | {_f(r['spread_embedding'], '.2e')} | "
                     f"{_f(r['spread_head'], '.2e')} | {_f(r['spread_other'], '.2e')} | "
                     f"{_f(r['spread_ratio'], '.1f')}x | {_f(r['train_time_s'], '.0f')} |")
    return "\n".join(lines)


def run_variant(args: argparse.Namespace, variant: str) -> int:
    run_dir = Path(args.out) / "runs" / variant
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(ROOT / "train.py"), *map(str, variant_args(variant, args.config_dir)[0]), *train_overrides(args, variant),
           # only a directory this command may replace reaches here (check_run_dir): an earlier run with --overwrite
           f"train.resume={'overwrite' if args.overwrite else 'never'}"]
    print("== " + " ".join(cmd), flush=True)
    log = Path(args.out) / "logs" / f"{variant}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    env.pop("RANK", None)
    with open(log, "w") as f:
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


def train_overrides(args: argparse.Namespace, variant: str) -> list[str]:
    """What every run gets after its config files: --overrides and the section.key=value words, the variant's own
    (name@key=value), then this experiment's steps, evaluation, diagnostics, seed and run directory."""
    return [*args.overrides, *variant_args(variant, args.config_dir)[1], f"train.max_steps={args.steps}",
            f"train.eval_every={args.eval_every}", "train.eval_steps=8", f"train.log_every={args.log_every}",
            f"diag.every={args.diag_every}", f"train.seed={args.seed}", "log.wandb=disabled",
            f"train.out_dir={Path(args.out) / 'runs' / variant}"]


def check_run(args: argparse.Namespace, variant: str) -> str | None:
    """Why `variant` cannot be trained as asked, in one line (None: it can): its config does not load (checked
    here, before any rank starts), or its run directory holds an earlier run and --overwrite was not given."""
    try:
        load_config(variant_args(variant, args.config_dir)[0], train_overrides(args, variant))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        return f"config error: {' '.join(str(e).split())}"
    run_dir = Path(args.out) / "runs" / variant
    if run_dir.exists() and any(run_dir.iterdir()) and not args.overwrite:
        return (f"{run_dir} holds an earlier run: pass --overwrite to train it again, --report-only to tabulate "
                f"it, or another --out")
    return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=[",".join(DEFAULT_VARIANTS)],
                    help="variants, space- or comma-separated (name@section.key=value adds a variant's own override)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--diag-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--config-dir", default="configs/cpu_30m")
    ap.add_argument("--overrides", default=" ".join(DEFAULT_OVERRIDES), help="default: %(default)s")
    ap.add_argument("--out", type=path_arg, default="bench/out/quality")
    ap.add_argument("--overwrite", action="store_true", help="train again a variant whose run directory under "
                                                             "--out/runs holds an earlier run (else refused)")
    ap.add_argument("--report-only", action="store_true", help="tabulate the runs under --out/runs, train nothing")
    # section.key=value words anywhere among the flags, after --overrides' (util/cli.py's rule)
    ap.add_argument("words", nargs="*", metavar="section.key=value", help="overrides for every run, after --overrides")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_intermixed_args(argv)
    items = [v for group in args.variants for v in group.split(",") if v]
    # a key=value word written after --variants is an override (a variant's own is name@key=value); all of them
    # in the order the command line gives them (a later one wins)
    words = sorted([*args.words, *(v for v in items if "=" in v and "@" not in v)],
                   key=lambda w: argv.index(w) if w in argv else len(argv))
    args.variants = [v for v in items if not ("=" in v and "@" not in v)]
    bad = [w for w in words if "=" not in w or w.startswith("-")]
    if bad:
        ap.error(f"{bad[0]!r}: not a flag or a section.key=value override")
    if not args.variants:
        ap.error("--variants: name at least one variant")
    args.overrides = args.overrides.split() + words
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if not args.report_only:  # every variant checked before any is trained; a refusal writes nothing
        problems = [(v, p) for v in args.variants if (p := check_run(args, v))]
        for v, p in problems:
            print(f"error: {v}: {p}", file=sys.stderr)
        if problems:
            return 2
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for v in args.variants:
        metrics = out / "runs" / v / "metrics.jsonl"
        if args.report_only:
            if not metrics.exists():
                rows.append({"variant": v, "status": f"no run: {shown(metrics)} does not exist (train it without "
                                                     f"--report-only)"})
                continue
        else:
            rc = run_variant(args, v)
            if rc != 0 or not metrics.exists():
                rows.append({"variant": v, "status": f"failed rc={rc} (see {shown(out / 'logs' / f'{v}.log')})"})
                continue
        rows.append({"variant": v, "status": "ok", **summarize_quality(read_jsonl(metrics))})
    with open(out / "quality.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["status", *COLUMNS], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    md = quality_markdown(rows)
    (out / "quality.md").write_text(md + "\n")
    print(md)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
