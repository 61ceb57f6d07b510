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
           f"{meta['steps']} steps after {meta['warmup']} warm-up (bench.step_breakdown). Machine: {meta['machine']}; "
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.advise_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1gbit,100mbit")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=0,
                    help="emulated nodes (bench.netsim --nodes): ranks of one node share an unlimited loopback, the "
                         "rate limits only the links between nodes; 0 = one namespace per rank")
    ap.add_argument("--config-dir", default="configs/cpu_30m")
    ap.add_argument("--overrides", default=" ".join(DEFAULT_OVERRIDES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--allow", default=",".join(default_allow()), help="the modes auto may pick")
    ap.add_argument("--out", default="bench/out/advise_check")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    if args.nodes < 0 or (args.nodes and args.nproc % args.nodes):
        ap.error(f"--nodes {args.nodes} must divide --nproc {args.nproc} (0 = one namespace per rank)")
    from bench import netsim

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = [r for r in args.rates.split(",") if r]
    overrides = args.overrides.split()
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT),
           "WANDB_MODE": "disabled", "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"}
    meta = {"nproc": args.nproc, "nodes": args.nodes, "config_dir": args.config_dir, "overrides": args.overrides, "steps": args.steps, "warmup": args.warmup,
            "machine": f"{os.uname().machine}, {os.cpu_count()} CPUs", "load_before": _load()}
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
    print(f"== measuring {args.variants} at {args.rates} (bench.step_breakdown)", flush=True)
    rc = subprocess.run([sys.executable, "-m", "bench.step_breakdown", "--rates", args.rates, "--variants",
                         args.variants, "--nproc", str(args.nproc), "--nodes", str(args.nodes), "--steps", str(args.steps), "--warmup",
                         str(args.warmup), "--config-dir", args.config_dir, "--overrides", args.overrides,
                         "--no-calibrate", "--out", str(out / "measured"), "--timeout", str(args.timeout)],
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
