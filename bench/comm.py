"""Communication microbenchmark: every registered sync scheme, timed and compared with its model.

For each world size P, size N and mode (a `comm.mode` of the optim.sync registry, with options),
the median over repeats of the time per exchange, split into seconds inside collectives and
seconds packing / quantizing (comm.CommStats), the wire bytes per rank (checked against the
scheme's declared byte formula), and the scheme's alpha-beta prediction with alpha/beta
calibrated on the same live group. Writes results.csv, results.md, time_vs_n.png and meta.json.

    python -m bench.comm --nproc 2,4 --sizes 1M,5M,25M              # every scheme, torchrun over loopback
    python -m bench.comm --nproc 4 --rate 1gbit --sizes 25M          # under bench.netsim, 1 Gbit/s links
    python -m bench.comm --nproc 2,3,4 --rate 1gbit --sizes 25M --modes fp32,onebit,pbit:bits=8:quantizer=l1,ps:ps_topology=tree

The driver launches itself (`--worker`) on every rank: with torchrun --standalone when --rate is
not given, else one rank per network namespace through bench.netsim (needs root). Modes default
to every registered scheme with its default options; `name:key=value:...` sets options (an
illegal combination at P, e.g. 4-bit sign lanes at 16 ranks, is reported, not hidden);
hierarchical takes --node-size.

Timing conventions: a call ends when its slowest rank returns, so per repeat the wall, collective
and pack seconds are the maximum over ranks; the table reports the median over repeats. Latency
cannot be emulated by netsim (no netem); with NETSIM_LATENCY_MODEL_S set (netsim --latency-model)
that latency is added to the calibrated alpha in the predictions only, never to measured times.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from util.cli import path_arg

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_SIZES = "1M,5M,10M,25M,50M"


def default_modes() -> list[str]:
    """Every registered sync scheme with its default options (optim.sync registry)."""
    from optim import sync

    return sync.names()


def parse_mode(spec: str) -> tuple[str, dict]:
    """'pbit:bits=8:quantizer=l1' -> ('pbit', {'bits': 8, 'quantizer': 'l1'}) (values parsed as YAML)."""
    import yaml

    name, *opts = spec.split(":")
    options = {}
    for kv in opts:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ValueError(f"mode option {kv!r} in {spec!r}: write key=value (e.g. pbit:bits=8)")
        options[k] = yaml.safe_load(v)
    return name, options


def parse_size(s: str) -> int:
    """'25M' -> 25_000_000, '512K' -> 512_000, '1000' -> 1000 (elements, SI prefixes)."""
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1:], 1)
    try:
        val = float(s[:-1] if mult != 1 else s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot parse size {s!r}: use e.g. 1M, 25M, 512K or 1000") from None
    if val < 0 or val != int(val):
        raise argparse.ArgumentTypeError(f"size must be a whole number of elements >= 0, got {s!r}")
    return int(val)


def fmt_size(n: int) -> str:
    for unit, div in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= div and n % (div // 1000 if div > 1000 else 1) == 0:
            return f"{n / div:g}{unit}"
    return str(n)


# ------------------------------------------------------------------------------------------------
# worker side (one process per rank)
# ------------------------------------------------------------------------------------------------

def _make_call(spec: str, n: int, world: int, rank: int, node_size: int | None) -> tuple[Callable[[int], Any], dict]:
    """Build the scheme's exchange once (optim.sync registry); return call(step), its options and stats."""
    import torch

    import comm
    from optim import sync

    name, given = parse_mode(spec)
    scheme = sync.get(name)
    if "node_size" in scheme.options.field_names() and "node_size" not in given and node_size:
        given["node_size"] = node_size
    opts = scheme.options(**given)
    problems = opts.problems(world)
    if problems:
        raise ValueError("; ".join(problems))
    stats = comm.CommStats()
    exchange = scheme.build(opts, sync.ExchangeContext(world_size=world, rank=rank, stats=stats, seed=1000 + rank))
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, generator=g)
    buf = torch.empty_like(x)

    def call(step: int):
        buf.copy_(x)  # gradient schemes reduce in place: every repeat starts from the same input
        return exchange(buf, step)

    return call, {"scheme": scheme, "options": opts, "stats": stats}


def _bench_one(mode: str, n: int, repeats: int, warmup: int, node_size: int | None) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        call, params = _make_call(mode, n, world, rank, node_size)
        for i in range(warmup):
            call(i + 1)
    except ValueError as e:                       # e.g. an illegal (P, bits) pair: report it, do not hide it
        return {"mode": mode, "n": n, "status": f"refused: {e}"}
    stats = params["stats"]
    per_rep = []
    for i in range(repeats):
        stats.reset()
        dist.barrier()
        t0 = time.perf_counter()
        call(warmup + i + 1)
        wall = time.perf_counter() - t0
        tot = stats.totals()
        per_rep.append([wall, tot["coll_s"], tot["pack_s"], tot["bytes_sent"], tot["bytes_recv"], tot["calls"]])
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, per_rep)
    # gathered[r][i] = rank r, repeat i. A call costs what its slowest rank spends.
    mx = [[max(gathered[r][i][k] for r in range(world)) for k in range(3)] for i in range(repeats)]
    scheme, opts = params["scheme"], params["options"]
    formula = [scheme.bytes_per_call(opts, world, n, rank=r) for r in range(world)]
    row = {"mode": mode, "n": n, "status": "ok", "scheme": scheme.name,
           "wall_s": statistics.median(m[0] for m in mx),
           "coll_s": statistics.median(m[1] for m in mx),
           "pack_s": statistics.median(m[2] for m in mx),
           "wall_min_s": min(m[0] for m in mx),
           "bytes_sent_max": max(gathered[r][0][3] for r in range(world)),
           "bytes_recv_max": max(gathered[r][0][4] for r in range(world)),
           "bytes_sent_rank0": gathered[0][0][3],
           "bytes_sent_rank1": gathered[1][0][3] if world > 1 else gathered[0][0][3],
           "bytes_match_formula": all((gathered[r][0][3], gathered[r][0][4]) == formula[r] for r in range(world)),
           "collective_calls": gathered[0][0][5]}
    return row


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from comm import cost_model as cm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.coll_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    node_size = args.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.alpha is not None and args.beta is not None:
        alpha, beta, calib = args.alpha, args.beta, {"source": "given"}
    else:
        alpha, beta, calib = _calibrate(cm)
    latency_model = float(os.environ.get("NETSIM_LATENCY_MODEL_S", "0") or 0)
    rows = []
    for n in args.sizes:
        for mode in args.modes:
            row = _bench_one(mode, n, args.repeats, args.warmup, node_size)
            row.update(world=world, rate=args.rate_label)
            if row["status"] == "ok":
                scheme, opts = _scheme(mode, node_size)
                row["model_s"] = scheme.predict(opts, world, n, alpha + latency_model, beta)
                row["wall_over_model"] = row["wall_s"] / row["model_s"] if row["model_s"] > 0 else float("nan")
                row["coll_over_model"] = row["coll_s"] / row["model_s"] if row["model_s"] > 0 else float("nan")
            rows.append(row)
            if rank == 0:
                print(f"P={world} N={fmt_size(n)} {mode}: " + (
                    f"wall {row['wall_s'] * 1e3:.1f} ms (coll {row['coll_s'] * 1e3:.1f}, pack {row['pack_s'] * 1e3:.1f}), "
                    f"model {row['model_s'] * 1e3:.1f} ms, sent {row['bytes_sent_max']} B, "
                    f"bytes {'=' if row['bytes_match_formula'] else '!='} formula"
                    if row["status"] == "ok" else row["status"]), flush=True)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rows_P{world}.json").write_text(json.dumps({
            "world": world, "alpha": alpha, "beta": beta, "latency_model_s": latency_model,
            "calibration": calib, "rows": rows}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _scheme(mode: str, node_size: int | None):
    from optim import sync

    name, given = parse_mode(mode)
    scheme = sync.get(name)
    if "node_size" in scheme.options.field_names() and "node_size" not in given and node_size:
        given["node_size"] = node_size
    return scheme, scheme.options(**given)


def _calibrate(cm: Any) -> tuple[float, float, dict]:
    """alpha, beta from comm.cost_model's live calibration (fp32 allreduce size sweep, least squares)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    alpha, beta = cm.calibrate(verbose=dist.get_rank() == 0)
    return float(alpha), float(beta), {"source": "comm.cost_model.calibrate", "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------------
# driver side
# ------------------------------------------------------------------------------------------------

def _worker_argv(args: argparse.Namespace, out: Path, rate_label: str) -> list[str]:
    argv = ["--worker", "--out", str(out), "--sizes", ",".join(map(str, args.sizes)),
            "--modes", ",".join(args.modes), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
            "--rate-label", rate_label, "--coll-timeout", str(args.coll_timeout)]
    if args.node_size:
        argv += ["--node-size", str(args.node_size)]
    if args.alpha is not None and args.beta is not None:
        argv += ["--alpha", repr(args.alpha), "--beta", repr(args.beta)]
    return argv


def launch(args: argparse.Namespace, world: int, out: Path) -> None:
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    if args.rate is None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "bench.comm", *_worker_argv(args, out, "loopback")]
        rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, timeout=args.timeout).returncode
        codes = [rc]
    else:
        from bench import netsim

        cmd = [sys.executable, "-m", "bench.comm", *_worker_argv(args, out, args.rate)]
        codes = netsim.run(world, cmd, args.rate, args.timeout, burst=args.burst, ranks_per_ns=args.ranks_per_ns,
                           env=env, cwd=ROOT, latency_model=args.latency_model, verbose=True)
    if any(codes):
        raise SystemExit(f"bench.comm: P={world} run failed, exit codes {codes}; see the output above")


COLUMNS = ["world", "rate", "n", "mode", "status", "wall_s", "coll_s", "pack_s", "wall_min_s", "model_s",
           "wall_over_model", "coll_over_model", "bytes_sent_max", "bytes_recv_max", "bytes_sent_rank0",
           "bytes_sent_rank1", "bytes_match_formula", "collective_calls", "speedup_vs_fp32"]


def collect(out: Path) -> tuple[list[dict], dict]:
    rows, calib = [], {}
    for f in sorted(out.glob("rows_P*.json")):
        d = json.loads(f.read_text())
        calib[d["world"]] = {k: d[k] for k in ("alpha", "beta", "latency_model_s", "calibration")}
        rows += [{**r, "world": d["world"]} for r in d["rows"]]
    fp32 = {(r["world"], r["n"]): r["wall_s"] for r in rows if r["mode"] == "fp32" and r["status"] == "ok"}
    for r in rows:
        base = fp32.get((r["world"], r["n"]))
        if r["status"] == "ok" and base:
            r["speedup_vs_fp32"] = base / r["wall_s"]
    order = {m: i for i, m in enumerate(dict.fromkeys(r["mode"] for r in rows))}
    rows.sort(key=lambda r: (r["world"], r["n"], order[r["mode"]]))
    return rows, calib


def write_reports(out: Path, rows: list[dict], calib: dict, meta: dict) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
    ms = lambda v: f"{v * 1e3:.1f}" if isinstance(v, (int, float)) else ""          # noqa: E731
    ratio = lambda v: f"{v:.2f}" if isinstance(v, (int, float)) and math.isfinite(v) else ""  # noqa: E731
    lines = [f"# bench.comm — {meta['rate']}", "",
             f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}; load average before/after: "
             f"{meta['load_before']} / {meta.get('load_after')}", ""]
    for p, c in sorted(calib.items()):
        lines.append(f"- P={p}: calibrated alpha = {c['alpha'] * 1e6:.1f} us, beta = {c['beta'] * 1e9:.3f} ns/bit "
                     f"({1 / c['beta'] / 1e6 if c['beta'] > 0 else float('inf'):.0f} Mbit/s)"
                     + (f", + modelled latency {c['latency_model_s'] * 1e6:.0f} us" if c["latency_model_s"] else ""))
    lines += ["", "wall = one exchange end to end (slowest rank; median and min over repeats); coll / pack = its seconds "
              "in collectives / in packing and quantizing (CommStats); model = the scheme's own alpha-beta prediction "
              "(optim.sync registry) with the calibrated alpha, beta; bytes = formula: CommStats' counts equal the "
              "scheme's declared byte formula on every rank.", "",
              "| P | N | mode | wall ms | wall min ms | coll ms | pack ms | model ms | wall/model | coll/model | "
              "sent B (max rank) | recv B (max rank) | bytes = formula | speedup vs fp32 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['world']} | {fmt_size(r['n'])} | {r['mode']} | {r['status']} |" + "|" * 10)
            continue
        lines.append(f"| {r['world']} | {fmt_size(r['n'])} | {r['mode']} | {ms(r['wall_s'])} | {ms(r['wall_min_s'])} | {ms(r['coll_s'])} | "
                     f"{ms(r['pack_s'])} | {ms(r.get('model_s'))} | {ratio(r.get('wall_over_model'))} | "
                     f"{ratio(r.get('coll_over_model'))} | {r['bytes_sent_max']} | {r['bytes_recv_max']} | "
                     f"{'yes' if r.get('bytes_match_formula') else 'NO'} | {ratio(r.get('speedup_vs_fp32'))} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(out / "time_vs_n.png", rows, meta["rate"])


def plot(path: Path, rows: list[dict], rate: str) -> None:
    from bench import require

    require("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False)
    for ax, p in zip(axes[0], worlds):
        for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
            pts = sorted((r["n"], r["wall_s"], r["model_s"]) for r in rows
                         if r["world"] == p and r["mode"] == mode and r["status"] == "ok")
            if not pts:
                continue
            color = f"C{i}"
            ns = [q[0] for q in pts]
            ax.plot(ns, [q[1] for q in pts], "o", color=color, label=f"{mode}")
            # a dash marks the model at each N, so a single-N run still shows it
            ax.plot(ns, [q[2] for q in pts], "-", marker="_", markersize=18, color=color, alpha=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N (elements)")
        ax.set_ylabel("seconds per call (median)")
        ax.set_title(f"P={p}, {rate}: measured (dots) vs cost model (lines)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _machine() -> str:
    return f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}, python {platform.python_version()}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", default="2,4", help="world sizes, comma separated (e.g. 2,3,4)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"elements per rank, e.g. {DEFAULT_SIZES}")
    ap.add_argument("--modes", default=None,
                    help="comma-separated sync schemes, each name[:key=value...] (e.g. pbit:bits=8:quantizer=l1); "
                         "default: every registered scheme with its default options")
    ap.add_argument("--rate", default=None,
                    help="run under bench.netsim with this per-link rate (e.g. 1gbit, 100mbit, unlimited); "
                         "omitted: torchrun over loopback")
    ap.add_argument("--burst", default=None, help="netsim tbf burst (default scales with the rate)")
    ap.add_argument("--latency-model", type=float, default=None, metavar="SECONDS",
                    help="netsim: modelled per-message latency added to alpha in predictions")
    ap.add_argument("--ranks-per-ns", type=int, default=1, help="netsim: ranks per namespace (emulated node)")
    ap.add_argument("--node-size", type=int, default=None,
                    help="hierarchical: ranks per node (default LOCAL_WORLD_SIZE, or 2 when that is 1)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=None, help="skip calibration: latency seconds")
    ap.add_argument("--beta", type=float, default=None, help="skip calibration: seconds per bit")
    ap.add_argument("--out", type=path_arg, default=None, help="output dir (default bench/out/comm_<rate>_<time>)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per world size before ranks are killed")
    ap.add_argument("--coll-timeout", type=float, default=300.0, help="gloo collective timeout, seconds")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate-label", default="loopback", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.sizes = [parse_size(s) for s in str(args.sizes).split(",") if s]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    args.modes = [m.strip() for m in (args.modes or ",".join(default_modes())).split(",") if m.strip()]
    try:
        bad = [m for m in args.modes if parse_mode(m)[0] not in default_modes()]
    except ValueError as e:
        ap.error(str(e))
    if bad:
        ap.error(f"unknown mode(s) {bad}; registered modes: {', '.join(default_modes())}")
    if (args.alpha is None) != (args.beta is None):
        ap.error("give both --alpha and --beta, or neither (then they are calibrated on the live group)")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if not args.worker:
        try:
            args.worlds = [int(p) for p in str(args.nproc).split(",") if p]
        except ValueError:
            ap.error(f"--nproc takes comma-separated integers, got {args.nproc!r}")
        if any(p < 1 for p in args.worlds):
            ap.error(f"world sizes must be >= 1, got {args.worlds}")
        if args.node_size is None and args.ranks_per_ns > 1:
            args.node_size = args.ranks_per_ns
        if args.node_size is None and any(parse_mode(m)[0] == "hierarchical" for m in args.modes):
            args.node_size = 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    label = args.rate or "loopback"
    out = Path(args.out or ROOT / "bench" / "out" / f"comm_{label}_{time.strftime('%Y%m%d_%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python -m bench.comm " + " ".join(argv if argv is not None else sys.argv[1:]),
            "rate": label, "machine": _machine(), "load_before": [round(x, 2) for x in os.getloadavg()],
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for world in args.worlds:
        launch(args, world, out)
    meta["load_after"] = [round(x, 2) for x in os.getloadavg()]
    rows, calib = collect(out)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    write_reports(out, rows, calib, meta)
    print(f"bench.comm: wrote {out}/results.csv, results.md, time_vs_n.png")
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
