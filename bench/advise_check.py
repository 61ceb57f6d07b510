"""Are bench.advise's predictions right? Predicted vs measured step time per variant and rate.

For each link rate: `bench.advise` under bench.netsim predicts every variant's step time (links,
compute and local work measured, communication from the registry's alpha-beta models); then
`bench.step_breakdown` trains each variant for a few steps under the same netsim links and
measures its median step time. The report puts them side by side (ratio predicted / measured,
target within 25 %) and says whether the fastest predicted variant among those comm.mode=auto may
choose (an allowed mode, and quality evidence that lets it in: bench.advise's evidence column) is
within 10 % of the measured-fastest of them. A check of the ranking: auto's comm.auto_min_gain,
which may keep fp32 over a slightly faster variant, is not applied here.

    python -m bench.advise_check                                   # 1gbit and 100mbit, 4 ranks, tiny
    python -m bench.advise_check --rates 1gbit --variants lion_fp32,lioncub_1bit --steps 3 --warmup 1
    python -m bench.advise_check --nodes 2                         # two nodes of 2 ranks: rate between nodes

Output in --out: advise_<rate>.json, measured/ (step_breakdown's own output), validation.csv and
validation.md. Needs root and iproute2 (network namespaces).

`--measured DIR` checks the predictions against runs bench.step_breakdown already made (DIR holds its
results.csv and meta.json, e.g. a time-to-loss study's breakdown directory) instead of training every
variant again: the layout, config dir and overrides are those runs' (a different one given here is an
error), the variants and rates default to theirs, and a requested one they lack is an error.

    python -m bench.advise_check --measured bench/out/time_to_loss/breakdown --out bench/out/advise_check_ttl
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from bench.step_breakdown import DEFAULT_OVERRIDES
from bench.variants import ROOT
from util.cli import Parser, path_arg, shown

DEFAULT_VARIANTS = ["lion_fp32", "lion_bf16", "adamw_fp32", "lioncub_1bit", "lioncub_4bit", "lioncub_8bit_l1",
                    "dlion_mavo"]
TARGET_RATIO = 0.25   # every prediction within 25 % of the measured step time
TARGET_PICK = 0.10    # auto's pick within 10 % of the measured-fastest allowed variant


def default_allow() -> list[str]:
    from trainer.config import CommConfig

    return CommConfig().auto_allow


def join(advice: dict, measured: list[dict], rate: str, allow: Sequence[str]) -> tuple[list[dict], dict]:
    """Rows (variant, mode, predicted, measured, ratio, the 1-minute loads of both) and the pick
    summary for one rate."""
    meas = {r["variant"]: r for r in measured if r["rate"] == rate and r.get("status") == "ok"}
    rows = []
    for a in advice["rows"]:
        if a["status"] != "ok":
            continue
        m = meas.get(a["variant"])
        pred_ms, meas_ms = 1e3 * a["step_s"], (float(m["step_ms"]) if m else None)
        rows.append({"rate": rate, "variant": a["variant"], "mode": a["mode"], "predicted_ms": pred_ms,
                     "measured_ms": meas_ms, "pred_over_meas": pred_ms / meas_ms if meas_ms else None,
                     "compute_ms": 1e3 * a["compute_s"], "local_ms": 1e3 * a["local_s"],
                     "comm_model_ms": 1e3 * a["comm_s"], "coll_ms": _float(m, "coll_ms"),
                     "advise_load1": advice.get("load1"), "measured_load1": _float(m, "load1"),
                     "auto_may_choose": not str(a.get("evidence", "")).startswith("not for auto")})
    allowed = [r for r in rows if r["mode"] in allow and r["auto_may_choose"] and r["measured_ms"]]
    pick = min(allowed, key=lambda r: r["predicted_ms"]) if allowed else None
    best = min(allowed, key=lambda r: r["measured_ms"]) if allowed else None
    summary = {"rate": rate, "allow": list(allow), "pick": pick and pick["variant"],
               "measured_fastest": best and best["variant"],
               "pick_over_fastest": (pick["measured_ms"] / best["measured_ms"]) if pick and best else None}
    return rows, summary


def _float(row: dict | None, key: str) -> float | None:
    try:
        return float(row[key]) if row and row.get(key) not in (None, "") else None
    except ValueError:
        return None


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(rows: list[dict], summaries: list[dict], meta: dict) -> str:
    out = ["# bench.advise: predicted vs measured step time", "",
           f"{meta['nproc']} ranks under bench.netsim ({_layout(meta)}), config dir `{meta['config_dir']}`, overrides `{meta['overrides']}`; measured: median of "
           f"{meta['steps']} steps after {meta['warmup']} warm-up (bench.step_breakdown, `{meta.get('measured', '?')}`). Machine: {meta['machine']}; "
           f"1-minute load before: {meta['load_before']}, after: {meta['load_after']}.", "",
           "| rate | variant | mode | predicted (ms) | measured (ms) | predicted / measured | within 25 % | "
           "compute (ms) | local (ms) | comm model (ms) | collectives measured (ms) | load: advise / training |",
           "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        q = r["pred_over_meas"]
        out.append(f"| {r['rate']} | {r['variant']} | {r['mode']} | {r['predicted_ms']:.0f} | "
                   f"{r['measured_ms']:.0f} | {q:.2f} | {'yes' if abs(q - 1) <= TARGET_RATIO else 'NO'} | "
                   f"{r['compute_ms']:.0f} | {r['local_ms']:.0f} | {r['comm_model_ms']:.0f} | "
                   f"{_num(r['coll_ms'], '.0f')} | {_num(r['advise_load1'], '.1f')} / {_num(r['measured_load1'], '.1f')} |"
                   if q is not None else f"| {r['rate']} | {r['variant']} | {r['mode']} | {r['predicted_ms']:.0f} | "
                   f"not measured | - | - | | | | | |")
    out += ["", "| rate | allowed modes | auto's pick | measured fastest | pick / fastest (measured) | within 10 % |",
            "|---|---|---|---|---:|---|"]
    for s in summaries:
        q = s["pick_over_fastest"]
        out.append(f"| {s['rate']} | {', '.join(s['allow'])} | {s['pick']} | {s['measured_fastest']} | "
                   f"{q:.2f} | {'yes' if q is not None and q <= 1 + TARGET_PICK else 'NO'} |" if q is not None else
                   f"| {s['rate']} | {', '.join(s['allow'])} | - | - | - | - |")
    return "\n".join(out) + "\n"


def _layout(meta: dict) -> str:
    n = meta.get("nodes") or 0
    return (f"{n} nodes of {meta['nproc'] // n} ranks: unlimited loopback inside a node, the rate on each node's link"
            if n else "one namespace per rank: the rate on every rank's link")


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


LAYOUT_DEFAULTS = {"nproc": 4, "nodes": 0, "config_dir": "configs/cpu_30m", "overrides": " ".join(DEFAULT_OVERRIDES),
                   "steps": 6, "warmup": 2}


def adopt_measured(args: argparse.Namespace, ap: argparse.ArgumentParser) -> list[dict]:
    """--measured DIR: the runs' layout, config and (unless given) variants and rates go into `args`; a
    setting given here that differs from theirs, or a variant / rate they lack, is an error (ap.error).
    Returns their results.csv rows."""
    d = Path(args.measured)
    if not (d / "results.csv").is_file() or not (d / "meta.json").is_file():
        ap.error(f"--measured {d}: no results.csv and meta.json there; give a bench.step_breakdown --out directory")
    meta = json.loads((d / "meta.json").read_text())
    theirs = {"nproc": meta.get("nproc"), "nodes": meta.get("nodes") or 0, "config_dir": meta.get("config_dir"),
              "overrides": " ".join(meta.get("overrides") or []), "warmup": meta.get("warmup")}
    if args.steps is not None:
        ap.error(f"--steps: the measured runs in {d} set their own (results.csv's steps column); drop --steps")
    for key, value in theirs.items():
        given = getattr(args, key)
        if given is not None and value is not None and given != value:
            flag = "--" + key.replace("_", "-")
            ap.error(f"{flag} {given!r} differs from the measured runs' {value!r} ({d / 'meta.json'}); drop {flag} "
                     f"to use theirs, or measure again without --measured")
        if given is None:
            setattr(args, key, value if value is not None else LAYOUT_DEFAULTS[key])
    rows = list(csv.DictReader((d / "results.csv").open()))
    args.variants = args.variants or ",".join(meta.get("variants") or dict.fromkeys(r["variant"] for r in rows))
    args.rates = args.rates or ",".join(meta.get("rates") or dict.fromkeys(r["rate"] for r in rows))
    have = {(r["rate"], r["variant"]) for r in rows}
    wanted = [(r, v) for r in args.rates.split(",") if r for v in args.variants.split(",") if v]
    lack = [f"{v} at {r}" for r, v in wanted if (r, v) not in have]
    if lack:
        ap.error(f"--measured {d}: no run of {', '.join(lack)}; measure it with bench.step_breakdown --out {d} or "
                 f"leave it out of --variants / --rates")
    steps = sorted({int(r["steps"]) for r in rows if (r["rate"], r["variant"]) in wanted and r.get("steps")})
    args.steps = "-".join(str(n) for n in dict.fromkeys([steps[0], steps[-1]])) if steps else "?"
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(prog="python -m bench.advise_check", description=__doc__.split("\n\n")[0])  # one-line errors
    ap.add_argument("--rates", default=None, help="comma list of bench.netsim rates (default: 1gbit,100mbit)")
    ap.add_argument("--variants", default=None, help=f"comma list (default: {','.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--nproc", type=int, default=None, help=f"ranks (default: {LAYOUT_DEFAULTS['nproc']})")
    ap.add_argument("--nodes", type=int, default=None,
                    help="emulated nodes (bench.netsim --nodes): ranks of one node share an unlimited loopback, the "
                         "rate limits only the links between nodes; 0 (default) = one namespace per rank")
    ap.add_argument("--config-dir", default=None, help=f"default: {LAYOUT_DEFAULTS['config_dir']}")
    ap.add_argument("--overrides", default=None, help=f"default: {LAYOUT_DEFAULTS['overrides']}")
    ap.add_argument("--steps", type=int, default=None, help=f"measured steps (default: {LAYOUT_DEFAULTS['steps']})")
    ap.add_argument("--warmup", type=int, default=None, help=f"default: {LAYOUT_DEFAULTS['warmup']}")
    ap.add_argument("--measured", type=path_arg, default="", metavar="DIR",
                    help="check against these bench.step_breakdown runs instead of training the variants again")
    ap.add_argument("--allow", default=",".join(default_allow()), help="the modes auto may pick")
    ap.add_argument("--out", type=path_arg, default="bench/out/advise_check")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    measured = adopt_measured(args, ap) if args.measured else None
    for key, value in LAYOUT_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.rates = args.rates or "1gbit,100mbit"
    args.variants = args.variants or ",".join(DEFAULT_VARIANTS)
    if args.nodes < 0 or (args.nodes and args.nproc % args.nodes):
        ap.error(f"--nodes {args.nodes} must divide --nproc {args.nproc} (0 = one namespace per rank)")
    shard = [w for w in args.overrides.split() if w.startswith("parallel.shard_size=")
             and w.split("=", 1)[1].strip().lstrip("0") != "1"]
    if shard:  # refused before any namespace or rank starts (bench.advise and comm.mode=auto refuse it too; one
        # set in a --config-dir file is refused by bench.advise itself, under the simulator)
        ap.error(f"--overrides {shard[-1]}: bench.advise_check checks comm.mode=auto, which predicts replicated "
                 f"runs only; leave parallel.shard_size at 1")
    from bench import netsim

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = [r for r in args.rates.split(",") if r]
    overrides = args.overrides.split()
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT),
           "WANDB_MODE": "disabled", "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"}
    meta = {"nproc": args.nproc, "nodes": args.nodes, "config_dir": args.config_dir, "overrides": args.overrides,
            "steps": args.steps, "warmup": args.warmup, "machine": f"{os.uname().machine}, {os.cpu_count()} CPUs",
            "load_before": _load(), "measured": shown(args.measured or out / "measured")}
    from bench.variants import config_files

    base_cfg = [str(p) for p in config_files("lion_fp32", args.config_dir)]
    for rate in rates:
        print(f"== {rate}: bench.advise", flush=True)
        js = out / f"advise_{rate}.json"
        codes = netsim.run(args.nproc, [sys.executable, "-m", "bench.advise", *base_cfg, *overrides,
                                        "--variants", args.variants, "--json", str(js)],
                           rate=rate, timeout=args.timeout, cwd=str(ROOT), env=env, tag="advchk",
                           ranks_per_ns=args.nproc // args.nodes if args.nodes else 1,
                           log_dir=str(out / "logs" / rate))
        if js.is_file() and _load() != "?":  # the load while bench.advise measured compute and local work
            js.write_text(json.dumps({**json.loads(js.read_text()), "load1": float(_load())}, indent=1))
        if any(codes):
            print(f"bench.advise failed at {rate}: rc={codes}; logs in {out / 'logs' / rate}", file=sys.stderr)
            return 1
    if measured is None:
        print(f"== measuring {args.variants} at {args.rates} (bench.step_breakdown)", flush=True)
        rc = subprocess.run([sys.executable, "-m", "bench.step_breakdown", "--rates", args.rates, "--variants",
                             args.variants, "--nproc", str(args.nproc), "--nodes", str(args.nodes), "--steps",
                             str(args.steps), "--warmup", str(args.warmup), "--config-dir", args.config_dir,
                             "--overrides", args.overrides, "--no-calibrate", "--out", str(out / "measured"),
                             "--timeout", str(args.timeout)],
                            cwd=ROOT, env={**os.environ, **env}).returncode
        if rc:
            print(f"bench.step_breakdown failed (rc={rc}); see {out / 'measured'}", file=sys.stderr)
            return 1
        measured = list(csv.DictReader((out / "measured" / "results.csv").open()))
    allow = [m for m in args.allow.split(",") if m]
    rows, summaries = [], []
    for rate in rates:
        r, s = join(json.loads((out / f"advise_{rate}.json").read_text()), measured, rate, allow)
        rows += r
        summaries.append(s)
    meta["load_after"] = _load()
    with (out / "validation.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["rate"])
        w.writeheader()
        w.writerows(rows)
    md = markdown(rows, summaries, meta)
    (out / "validation.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
