"""The numbers of a gpu-check report folder (launch/gpu_check.sh), as a few lines for summary.txt.

    python -m launch.gpu_check_summary OUT_DIR

Reads OUT_DIR/ranks.json (launch/one_device.py runs) and OUT_DIR/train_results.csv (bench.step_breakdown of
gpt2-124m at P = 1) where present and prints: the multi-rank runs (variants, replicas bit-identical, overlap
== no overlap, the sharded DCP resume); per training variant the step, forward + backward and the rest of the
step (optimizer, clipping, logging) in ms, tokens/s, the step's MFU and forward + backward's own MFU; and the
issue's two targets (lion_fp32 MFU >= 40 %, Lion's optimizer time <= AdamW's)."""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

MFU_TARGET = 0.40


def ranks_lines(data: dict) -> list[str]:
    out = []
    for part, res in data.items():
        v = res.get("variants", {})
        ok = {k: r for k, r in v.items() if "error" not in r}
        if ok:
            devices = sorted({r["device"] for r in ok.values()})
            out.append(f"{part}: {len(ok)} runs at {res.get('world_size')} ranks on {'/'.join(devices)}, replicas "
                       f"bit-identical in each (the trainer raises otherwise): {', '.join(ok)}")
        for k, r in v.items():
            if "error" in r:
                out.append(f"{part}: {k} FAILED: {r['error']}")
        plain, over = ok.get("lion_fp32@comm.bucket_mb=0.01"), ok.get("lion_fp32@comm.bucket_mb=0.01@comm.overlap=true")
        if plain and over:
            out.append(f"{part}: fp32 with buckets, overlap on == off bit for bit: {plain['sha256'] == over['sha256']}")
        if "shard" in res:
            s = res["shard"]
            out.append(f"{part}: parallel.shard_size=2 on {s['device']}: resumed from DCP == straight run: "
                       f"{s['resumed_equals_straight']} ({s['seconds']} s)")
    return out


def train_lines(rows: list[dict]) -> list[str]:
    out, by = [], {}
    for r in rows:
        if r.get("status") != "ok":
            out.append(f"train {r.get('variant')}: {r.get('status')}")
            continue
        step, comp, rest = (float(r[k]) for k in ("step_ms", "compute_ms", "other_ms"))
        mfu = float(r["mfu"])
        by[r["variant"]] = dict(step=step, comp=comp, rest=rest, mfu=mfu)
        out.append(f"train {r['variant']}: step {step:.1f} ms, forward+backward {comp:.1f} ms, rest (optimizer, clip, "
                   f"comm {float(r['comm_ms']):.1f}) {rest:.1f} ms, {float(r['tokens_per_s']):,.0f} tokens/s, MFU "
                   f"{100 * mfu:.1f} % (forward+backward alone {100 * mfu * step / comp:.1f} %), peak device memory "
                   f"{float(r['peak_mem_gib']) * 1024:,.0f} MiB")
    lion, adamw = by.get("lion_fp32"), by.get("adamw_fp32")
    if lion:
        out.append(f"target lion_fp32 MFU >= {100 * MFU_TARGET:.0f} %: {'met' if lion['mfu'] >= MFU_TARGET else 'NOT met'} "
                   f"({100 * lion['mfu']:.1f} %)")
    if lion and adamw:
        out.append(f"target Lion's step outside forward+backward <= AdamW's: "
                   f"{'met' if lion['rest'] <= adamw['rest'] else 'NOT met'} ({lion['rest']:.2f} vs {adamw['rest']:.2f} ms)")
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.gpu_check_summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="a gpu-check report folder")
    d = Path(ap.parse_args(argv).out_dir)
    if not d.is_dir():
        print(f"gpu_check_summary: {d} is not a folder; give the report folder launch/gpu_check.sh wrote", file=sys.stderr)
        return 2
    lines = []
    if (d / "ranks.json").is_file():
        try:
            lines += ranks_lines(json.loads((d / "ranks.json").read_text()))
        except (ValueError, KeyError) as e:
            lines.append(f"ranks.json unreadable: {e}")
    if (d / "train_results.csv").is_file():
        with open(d / "train_results.csv") as f:
            lines += train_lines(list(csv.DictReader(f)))
    print("\n".join(lines) if lines else "no ranks.json or train_results.csv in " + str(d))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
