"""Step-time breakdown of every optimizer / comm mode under real bandwidth limits (Lion Cub Fig. 7, Table 4).

For each link rate and variant: run the trainer on `--nproc` ranks, one network namespace each
(bench.netsim: tbf rate limits on both ends of every veth), `--warmup + --steps` steps with one
log record per step; drop the warm-up records and report the median step time, its split into
compute (data + forward/backward), communication (collectives + quantize/pack, as the trainer's
comm.CommStats books it) and other (optimizer arithmetic, clipping), the comm share, the bytes per
step, the peak memory per rank and the speedup over lion_fp32. Each rate is calibrated once
(comm.cost_model.calibrate: fp32 allreduce sweep under the same netsim links) and every variant's
collective time is compared with the alpha-beta prediction of Lion Cub Table 1.

    python -m bench.step_breakdown                                    # 8 variants x 3 rates, 4 ranks
    python -m bench.step_breakdown --rates 1gbit --variants lion_fp32,lioncub_4bit --steps 5
    python -m bench.step_breakdown --report-only --out bench/out/step_breakdown   # re-tabulate

Output in --out: results.csv, results.md (Table 4 style + per-rate detail), breakdown.png (Fig. 7
style stacked bars per rate), calibration.json, meta.json, runs/<rate>/<variant>/ (the trainer's
run dirs) and logs/. Needs root and iproute2 (network namespaces); `--launcher torchrun` runs the
same measurement over loopback without netsim (rate must then be 'unlimited').

Peak memory: on CPU the trainer logs none, so every rank runs under a small wrapper
(`--rank-wrap`) that waits for the rank's process and records its tree's ru_maxrss (max resident set
size); the rank process runs train.py inside this module (`--train-here`), which writes the process's
own peak RSS as it leaves (the trainer knows nothing of it); on
CUDA the trainer's peak_mem_gib (torch.cuda.max_memory_allocated of rank 0) is reported as well,
and the memory target is judged on it (device memory; the host RSS then holds the CUDA context).

One GPU, several ranks: `--shared-gpu` runs every rank on cuda:0 with the
process group on gloo (NCCL refuses two ranks on one device), so collectives of CUDA tensors go
through host memory. It measures device memory per rank and the optimizer's device time; its
collective times are gloo's host path, not NCCL's.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from bench.variants import (BASELINE, DEFAULT_VARIANTS, OVERLAP_BASELINE, ROOT, load_run_config, median, variant_args,
                            predict_step_comm_s, read_jsonl, train_records)
from trainer import rundir
from util.cli import path_arg

PEAK_RSS_ENV = "LIONCUB_PEAK_RSS_FILE"  # where train_here writes its rank process's own peak RSS

DEFAULT_RATES = ["unlimited", "1gbit", "100mbit"]
# A model/batch that 4 ranks run on a 2-core CPU in seconds per step, still dominated (>= 70 %) by
# the fp32 gradient allreduce at the slow rates: the tiny preset with an untied head has 13.6M
# parameters, 94 % of them in the embedding and head (like cpu-30m's 78 %), and 64 tokens per rank.
DEFAULT_OVERRIDES = ["model.preset=tiny", "model.tie_embeddings=false", "data.batch_size=1", "data.seq_len=64"]
CALIB_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)

COLUMNS = ["rate", "variant", "status", "steps", "step_ms", "compute_ms", "comm_ms", "coll_ms", "pack_ms",
           "other_ms", "comm_share", "comm_bytes", "shard_bytes", "tokens_per_s", "mfu", "peak_rss_mib", "peak_tree_rss_mib", "peak_mem_gib", "speedup", "speedup_vs_overlap",
           "comm_reduction",
           "pred_comm_ms", "coll_over_pred", "comm_over_pred", "alpha_us", "beta_ns_per_bit", "n_params", "load1"]


# ------------------------------------------------------------------------------------------------
# per-rank helpers (run inside the namespaces)
# ------------------------------------------------------------------------------------------------

def rank_wrap(rss_path: Path, cmd: Sequence[str]) -> int:
    """Run `cmd`, then write its peak RSS (MiB) and exit code to rss_path; return its exit code.
    max_rss_mib: the rank process's own peak (train_here writes it, $LIONCUB_PEAK_RSS_FILE);
    tree_max_rss_mib: RUSAGE_CHILDREN, the largest process of the rank's tree, which includes the
    children it waited for (comm.kernels=auto's warm-up probe on CPU)."""
    rss_path.parent.mkdir(parents=True, exist_ok=True)
    own = rss_path.with_suffix(".self.json")
    own.unlink(missing_ok=True)
    proc = subprocess.Popen(list(cmd), env={**os.environ, PEAK_RSS_ENV: str(own)})
    try:
        rc = proc.wait()
    except BaseException:
        proc.terminate()
        raise
    tree_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    self_mib = json.loads(own.read_text())["self_max_rss_mib"] if own.exists() else None
    rss_path.write_text(json.dumps({"rank": int(os.environ.get("RANK", "0")), "max_rss_mib": self_mib,
                                    "tree_max_rss_mib": tree_mib, "rc": rc}))
    return rc


def _rss(rss_dir: Path) -> tuple[float | None, float | None]:
    """(max over ranks of each rank process's own peak RSS, max over ranks of its tree's), MiB."""
    recs = [json.loads(p.read_text()) for p in sorted(rss_dir.glob("rank*.json")) if ".self" not in p.name]
    own = [r["max_rss_mib"] for r in recs if r.get("max_rss_mib") is not None]
    tree = [r.get("tree_max_rss_mib", r.get("max_rss_mib")) for r in recs]
    tree = [t for t in tree if t is not None]
    return (max(own) if own else None), (max(tree) if tree else None)


def train_here(cmd: Sequence[str], shared_gpu: bool = False) -> None:
    """Run train.py (cmd: its path and arguments) in this process, with the benchmark's hooks
    attached from outside: with $LIONCUB_PEAK_RSS_FILE set, the process's own peak RSS is written
    there as it leaves (a launcher's RUSAGE_CHILDREN is the largest process of the rank's tree, which
    includes children such as comm.kernels=auto's warm-up probe); with `shared_gpu` the rank runs on
    cuda:0 with a gloo process group (LOCAL_RANK is set to 0, the trainer's NCCL group made gloo);
    with LIONCUB_MEMORY_SNAPSHOT=1 rank 0's CUDA allocations are recorded. Nothing in the trainer
    changes."""
    import runpy

    if shared_gpu:
        _gloo_on_one_gpu()
    if os.environ.get("LIONCUB_MEMORY_SNAPSHOT") == "1" and os.environ.get("RANK", "0") == "0":
        _record_memory_snapshot(cmd)
    own = os.environ.get(PEAK_RSS_ENV)
    if own:
        _write_peak_rss_on_exit(Path(own))
    sys.argv = list(cmd)
    sys.path.insert(0, str(Path(cmd[0]).resolve().parent))
    try:
        runpy.run_path(cmd[0], run_name="__main__")
    finally:  # train.py leaves through os._exit (hooked below); this is for a return or an exception
        if own:
            _write_peak_rss(Path(own))


def _gloo_on_one_gpu() -> None:
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = "0"
    init = dist.init_process_group

    def gloo_init(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
            kwargs.pop("device_id", None)
        return init(*args, **kwargs)

    dist.init_process_group = gloo_init


def _write_peak_rss(path: Path) -> None:
    from trainer.logger import peak_rss_gib

    path.write_text(json.dumps({"self_max_rss_mib": peak_rss_gib() * 1024}))


def _write_peak_rss_on_exit(path: Path) -> None:
    """Write this process's peak RSS to `path` when it leaves through os._exit (train.py does, to
    skip the interpreter's teardown)."""
    exit_ = os._exit

    def write_and_exit(code: int) -> None:
        try:
            _write_peak_rss(path)
        finally:
            exit_(code)

    os._exit = write_and_exit


def _record_memory_snapshot(cmd: Sequence[str]) -> None:
    """Record rank 0's CUDA allocations (torch.cuda.memory history, Python stacks) and write the
    snapshot to <train.out_dir>/memory_snapshot.pickle when train.py exits (it leaves through
    os._exit, so the dump is hooked there). For finding what makes up the peak."""
    import torch

    out_dir = next((a.split("=", 1)[1] for a in cmd if a.startswith("train.out_dir=")), ".")
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    exit_ = os._exit

    def dump_and_exit(code: int) -> None:
        try:
            torch.cuda.memory._dump_snapshot(str(Path(out_dir) / "memory_snapshot.pickle"))
        finally:
            exit_(code)

    os._exit = dump_and_exit


def calibrate_worker(out_path: Path) -> None:
    """Fit alpha/beta on the live group (comm.cost_model.calibrate); rank 0 writes the JSON."""
    import torch.distributed as dist

    from comm import cost_model

    dist.init_process_group("gloo")
    try:
        alpha, beta = cost_model.calibrate(sizes=CALIB_SIZES, repeats=3, verbose=True)
        if dist.get_rank() == 0:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps({"alpha_s": alpha, "beta_s_per_bit": beta,
                                            "world": dist.get_world_size(), "sizes_bytes": list(CALIB_SIZES)}))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# summarising one run (pure: tested on synthetic records)
# ------------------------------------------------------------------------------------------------

def cycle_steps(cfg: dict) -> int:
    """Steps over which a run's step time repeats: its sync scheme's cycle (optim.sync SyncScheme.
    cycle_steps on the scheme's options_from the config's comm section: for a local-update run, e.g.
    comm.mode=diloco, most inner steps send nothing and every fragment's average falls once in any
    comm.diloco.inner_steps consecutive steps), 1 for a scheme that exchanges every step."""
    from optim import sync

    c = cfg.get("comm") or {}
    mode = c.get("mode", "fp32")
    if mode not in sync.names():
        raise ValueError(f"comm.mode={mode!r} is not a registered sync scheme ({', '.join(sync.names())}); read the "
                         f"run at the mode it trained with (a comm.mode=auto run: the one its auto_mode.json names)")
    scheme = sync.get(mode)
    return scheme.cycle_steps(scheme.options_from(c))


def summarize_run(records: list[dict], warmup: int, cycle: int = 1) -> dict:
    """Medians over the train records after the first `warmup` steps; with `cycle` > 1 (cycle_steps)
    means over the last whole cycles of them instead, since a median would drop the steps that sync.

    compute = data + forward/backward, comm = collectives + quantize/pack, other = the optimizer's
    remaining time (the trainer's opt_ms); medians are taken per component, so the three parts sum
    to about (not exactly) the median step time."""
    recs = [r for r in train_records(records) if r["step"] > warmup]
    if not recs:
        steps = [r["step"] for r in train_records(records)]
        raise ValueError(f"no train records after {warmup} warm-up steps (steps logged: {steps}); "
                         f"run more steps or lower --warmup")
    stat = median
    if cycle > 1:
        logged = [r["step"] for r in recs]
        if logged != list(range(logged[0], logged[0] + len(logged))):
            raise ValueError(f"a cycle of {cycle} steps needs one record per step (train.log_every=1); steps "
                             f"logged: {logged[:8]}...")
        if len(recs) < cycle:
            raise ValueError(f"{len(recs)} measured steps after {warmup} warm-up are less than one cycle of "
                             f"{cycle} inner steps (comm.diloco.inner_steps); run at least --steps {cycle}")
        recs = recs[len(recs) % cycle:]
        stat = (lambda xs: statistics.fmean(list(xs)))
    step = stat(r["step_ms"] for r in recs)
    comm = stat(r["comm_ms"] for r in recs)
    out = {"steps": len(recs), "step_ms": step,
           "compute_ms": stat(r.get("data_ms", 0.0) + r["fwdbwd_ms"] for r in recs),
           "comm_ms": comm, "coll_ms": stat(r.get("coll_ms", r["comm_ms"]) for r in recs),
           "pack_ms": stat(r.get("pack_ms", 0.0) for r in recs),
           "other_ms": stat(r.get("opt_ms", 0.0) for r in recs),
           "comm_share": comm / step if step > 0 else float("nan"),
           "comm_bytes": stat(r["comm_bytes"] for r in recs),
           # hybrid sharding: what the matrix optimizers send inside the shard group (FSDP's own not counted)
           "shard_bytes": stat(r["shard_bytes"] for r in recs) if all("shard_bytes" in r for r in recs) else None,
           "cycle": cycle}
    mem = [r["peak_mem_gib"] for r in recs if "peak_mem_gib" in r]
    out["peak_mem_gib"] = max(mem) if mem else None
    out["tokens_per_s"] = stat(r["tokens_per_s"] for r in recs) if all("tokens_per_s" in r for r in recs) else None
    mfu = [r["mfu"] for r in recs if "mfu" in r]  # CUDA with a known peak only (trainer.logger.peak_flops)
    out["mfu"] = median(mfu) if len(mfu) == len(recs) else None
    return out


COMM_RESOLUTION_MS = 0.5   # a comm time under this rounds to 0 in the tables: no ratio is made of it


def add_relative(rows: list[dict], baseline: str = BASELINE, overlapped: str = OVERLAP_BASELINE) -> list[dict]:
    """speedup = baseline step / step and comm_reduction = baseline comm / comm, per rate, against
    the plain fp32 baseline; speedup_vs_overlap against the overlapped (DDP-style) one."""
    base = {r["rate"]: r for r in rows if r["variant"] == baseline and r.get("status") == "ok"}
    over = {r["rate"]: r for r in rows if r["variant"] == overlapped and r.get("status") == "ok"}
    for r in rows:
        b, o = base.get(r["rate"]), over.get(r["rate"])
        ok = r.get("status") == "ok" and r.get("step_ms", 0) > 0
        r["speedup"] = b["step_ms"] / r["step_ms"] if ok and b else None
        # below the table's 1 ms a ratio says nothing (an exchange hidden behind compute, as Streaming
        # DiLoCo's, books only what the step waited for it: 0.0007 ms made "8661907.0x")
        r["comm_reduction"] = b["comm_ms"] / r["comm_ms"] if ok and b and r["comm_ms"] >= COMM_RESOLUTION_MS else None
        r["speedup_vs_overlap"] = o["step_ms"] / r["step_ms"] if ok and o else None
    return rows


# the fast-path targets: speedups at 1 Gbit/s over the non-overlapped fp32 baseline, 1-bit at 100 Mbit/s
FAST_TARGETS = {("1gbit", "lioncub_1bit"): 2.5, ("1gbit", "lioncub_4bit"): 2.0, ("1gbit", "lioncub_8bit_l1"): 1.5,
                ("100mbit", "lioncub_1bit"): 10.0}


def check_fast_path_targets(rows: list[dict], baseline: str = BASELINE, overlapped: str = OVERLAP_BASELINE,
                            other_ratio: float = 1.2, mem_ratio: float = 1.1) -> list[str]:
    """The fast-path targets, one line each, MET or NOT met with the numbers: Lion Cub speedups over
    non-overlapped fp32 (FAST_TARGETS), every Lion Cub variant faster than the overlapped fp32
    baseline, Lion Cub's non-communication optimizer time within `other_ratio` of Lion's, its peak
    memory within `mem_ratio` of lion_fp32's, and overlap saving at least half of the backward time
    (backward taken as 2/3 of forward + backward, the usual FLOP ratio)."""
    ok = {(r["rate"], r["variant"]): r for r in rows if r.get("status") == "ok"}
    out = []
    for (rate, v), target in FAST_TARGETS.items():
        r = ok.get((rate, v))
        if r and r.get("speedup"):
            out.append(f"{rate}: {v} {r['speedup']:.2f}x faster than {baseline} "
                       f"({'MET' if r['speedup'] >= target else 'NOT met'}, target >= {target:g}x)")
    for rate in sorted({k[0] for k in ok}):
        b, o = ok.get((rate, baseline)), ok.get((rate, overlapped))
        for (rt, v), r in sorted(ok.items()):
            if rt != rate or not v.startswith("lioncub"):
                continue
            if o:
                out.append(f"{rate}: {v} vs {overlapped}: {o['step_ms']:.0f} -> {r['step_ms']:.0f} ms = "
                           f"{r['speedup_vs_overlap']:.2f}x ({'MET' if r['speedup_vs_overlap'] > 1 else 'NOT met'}: faster)")
            if b and b.get("other_ms") and not untimed(r):
                q = r["other_ms"] / b["other_ms"]
                out.append(f"{rate}: {v} optimizer time {r['other_ms']:.0f} ms vs {b['other_ms']:.0f} ms = {q:.2f}x "
                           f"({'MET' if q <= other_ratio else 'NOT met'}, target <= {other_ratio:g}x)")
            if b and b.get("peak_mem_gib") and r.get("peak_mem_gib"):  # CUDA: device memory per rank
                q = r["peak_mem_gib"] / b["peak_mem_gib"]
                out.append(f"{rate}: {v} peak device memory {1024 * r['peak_mem_gib']:.1f} MiB vs "
                           f"{1024 * b['peak_mem_gib']:.1f} MiB = {q:.2f}x ({'MET' if q <= mem_ratio else 'NOT met'}, "
                           f"target <= {mem_ratio:g}x)")
            elif b and b.get("peak_rss_mib") and r.get("peak_rss_mib"):
                q = r["peak_rss_mib"] / b["peak_rss_mib"]
                tree = (f"; the largest process of its tree, warm-up children included: "
                        f"{r['peak_tree_rss_mib']:.0f} MiB" if r.get("peak_tree_rss_mib") else "")
                out.append(f"{rate}: {v} peak memory {r['peak_rss_mib']:.0f} MiB vs {b['peak_rss_mib']:.0f} MiB = "
                           f"{q:.2f}x ({'MET' if q <= mem_ratio else 'NOT met'}, target <= {mem_ratio:g}x{tree})")
        if b and o:
            backward = 2 / 3 * b["compute_ms"]
            saved = b["step_ms"] - o["step_ms"]
            out.append(f"{rate}: overlap saves {saved:.0f} ms of {b['step_ms']:.0f} ms; backward ~{backward:.0f} ms: "
                       f"{saved / backward:.2f} of it ({'MET' if saved >= 0.5 * backward else 'NOT met'}, target >= 0.5)")
    return out


def untimed(row: dict) -> bool:
    """A run with comm.fine_timing=false: bytes moved but no collective time booked, so its "other"
    (the trainer's opt_ms) includes the communication and its comm columns read 0."""
    return row.get("comm_ms") == 0 and (row.get("comm_bytes") or 0) > 0


def add_prediction(row: dict, pred_s: float, alpha: float, beta: float) -> dict:
    row["pred_comm_ms"] = 1e3 * pred_s
    row["coll_over_pred"] = row["coll_ms"] / row["pred_comm_ms"] if pred_s > 0 else None
    row["comm_over_pred"] = row["comm_ms"] / row["pred_comm_ms"] if pred_s > 0 else None
    row["alpha_us"], row["beta_ns_per_bit"] = 1e6 * alpha, 1e9 * beta
    return row


def check_targets(rows: list[dict], baseline: str = BASELINE, share: float = 0.70, speedup: float = 3.0,
                  reduction: float = 10.0, model_ratio: float = 1.5) -> list[str]:
    """The slow-link performance targets, evaluated at every rate where the baseline's comm share >= 70 %:
    the best Lion Cub variant's step >= 3x faster and its comm time >= 10x smaller than the baseline's,
    and every variant's collective time within 1.5x (either way) of the cost model. One line per check."""
    lines = []
    ok = [r for r in rows if r.get("status") == "ok"]
    rates = [r["rate"] for r in ok if r["variant"] == baseline and r["comm_share"] >= share]
    if not rates:
        shares = {r["rate"]: round(100 * r["comm_share"], 1) for r in ok if r["variant"] == baseline}
        return [f"no rate where {baseline} spends >= {100 * share:.0f} % communicating (comm % by rate: {shares})"]
    for rate in rates:
        base = next(r for r in ok if r["rate"] == rate and r["variant"] == baseline)
        # rows run with comm.fine_timing=false have a step time but no comm split: not candidates here
        cubs = [r for r in ok if r["rate"] == rate and r["variant"].startswith("lioncub") and r.get("speedup")
                and not untimed(r)]
        lines.append(f"{rate}: {baseline} comm share {100 * base['comm_share']:.1f} % (>= {100 * share:.0f} %)")
        if cubs:
            best = max(cubs, key=lambda r: r["speedup"])
            cut = best.get("comm_reduction")
            # a comm time under the tables' resolution has no ratio: it is at least base / resolution smaller
            least = cut if cut is not None else base["comm_ms"] / COMM_RESOLUTION_MS
            lines.append(f"{rate}: best Lion Cub {best['variant']}: step {base['step_ms']:.0f} -> {best['step_ms']:.0f} ms "
                         f"= {best['speedup']:.2f}x ({'MET' if best['speedup'] >= speedup else 'NOT met'}, target "
                         f">= {speedup:g}x); comm {base['comm_ms']:.0f} -> " +
                         (f"{best['comm_ms']:.0f} ms = {cut:.1f}x smaller" if cut is not None else
                          f"{best['comm_ms']:.2g} ms, under {COMM_RESOLUTION_MS:g} ms: at least {least:.0f}x smaller") +
                         f" ({'MET' if least >= reduction else 'NOT met'}, target >= {reduction:g}x)")
        for r in ok:
            q = r.get("coll_over_pred")
            if r["rate"] != rate or q is None or untimed(r):
                continue
            within = 1 / model_ratio <= q <= model_ratio
            lines.append(f"{rate}: {r['variant']}: collectives {r['coll_ms']:.0f} ms vs model {r['pred_comm_ms']:.0f} ms "
                         f"= {q:.2f}x ({'within' if within else 'NOT within'} {model_ratio:g}x); with pack "
                         f"{r['comm_over_pred']:.2f}x")
    return lines


def _f(x: object, fmt: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return format(x, fmt) if isinstance(x, (int, float)) else str(x)


def _x(x: object, fmt: str) -> str:
    """A ratio's cell: '-' where there is none, else the number and 'x'."""
    out = _f(x, fmt)
    return out if out == "-" else out + "x"


def table4_markdown(rows: list[dict], rates: list[str], variants: list[str]) -> str:
    """Lion Cub Table 4: per variant, 1-step time (s) and comm share (%) at each rate."""
    by = {(r["rate"], r["variant"]): r for r in rows}
    head = "| Optimizer | " + " | ".join(f"{rt} 1step (s) | {rt} Comm. (%)" for rt in rates) + " |"
    sep = "|---|" + "---:|---:|" * len(rates)
    lines = [head, sep]
    for v in variants:
        cells = []
        for rt in rates:
            r = by.get((rt, v))
            if r is None or r.get("status") != "ok":
                cells += [r["status"] if r else "-", "-"]
            else:
                cells += [_f(r["step_ms"] / 1e3, ".3f"), _f(100 * r["comm_share"], ".1f")]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_markdown(rows: list[dict], rate: str, variants: list[str]) -> str:
    by = {r["variant"]: r for r in rows if r["rate"] == rate}
    gpu = any(r.get("peak_mem_gib") for r in by.values())
    lines = [f"| variant | step (ms) | compute | comm (coll + pack) | other | comm % | bytes/step/rank | tokens/s | "
             f"MFU | peak RSS/rank (MiB; its tree's largest) | speedup | vs overlapped fp32 | comm ÷ | model comm (ms) | coll / model |"
             f"{' peak device mem/rank (MiB) |' if gpu else ''}",
             "|---|" + "---:|" * (15 if gpu else 14)]
    for v in variants:
        r = by.get(v)
        if r is None:
            continue
        if r.get("status") != "ok":
            lines.append(f"| {v} | {r.get('status')} |" + " |" * 13)
            continue
        lines.append(
            f"| {v} | {_f(r['step_ms'], '.0f')} | {_f(r['compute_ms'], '.0f')} | {_f(r['comm_ms'], '.0f')} "
            f"({_f(r['coll_ms'], '.0f')} + {_f(r['pack_ms'], '.0f')}) | {_f(r['other_ms'], '.0f')} | "
            f"{_f(100 * r['comm_share'], '.1f')} | {_f(r['comm_bytes'] / 1e6, '.2f')} MB | "
            f"{_f(r.get('tokens_per_s'), ',.0f')} | "
            f"{_f(100 * r['mfu'] if r.get('mfu') is not None else None, '.1f')}{' %' if r.get('mfu') is not None else ''} | "
            f"{_f(r.get('peak_rss_mib'), '.0f')} ({_f(r.get('peak_tree_rss_mib'), '.0f')}) | "
            f"{_x(r.get('speedup'), '.2f')} | "
            f"{_x(r.get('speedup_vs_overlap'), '.2f')} | "
            f"{_x(r.get('comm_reduction'), '.1f')} | {_f(r.get('pred_comm_ms'), '.0f')} | "
            f"{_f(r.get('coll_over_pred'), '.2f')} |"
            + (f" {_f(1024 * r['peak_mem_gib'] if r.get('peak_mem_gib') else None, '.1f')} |" if gpu else ""))
    return "\n".join(lines)


def plot_breakdown(path: Path, rows: list[dict], rates: list[str], variants: list[str]) -> None:
    """Fig. 7 style: one panel per rate, a stacked bar (compute / comm / other) per variant."""
    from bench import require

    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 4.2), squeeze=False)
    # comm = collectives + quantize/pack (Lion Cub Fig. 7 counts both as "Comm"), drawn as two shades
    parts = [("compute_ms", "compute (data + fwd/bwd)", "#4c72b0"), ("coll_ms", "comm: collectives", "#dd8452"),
             ("pack_ms", "comm: quantize/pack", "#f2b880"), ("other_ms", "other (optimizer)", "#8c8c8c")]
    by = {(r["rate"], r["variant"]): r for r in rows if r.get("status") == "ok"}
    for ax, rate in zip(axes[0], rates):
        names = [v for v in variants if (rate, v) in by]
        bottom = [0.0] * len(names)
        for key, label, color in parts:
            vals = [by[(rate, v)][key] / 1e3 for v in names]
            ax.bar(range(len(names)), vals, bottom=bottom, color=color, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"link {rate}")
        ax.set_ylabel("seconds per step (median)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _steps_measured(rows: list[dict], meta: dict) -> str:
    """The measured steps of the rows (a --report-only over runs of several lengths: their range)."""
    got = sorted({int(r["steps"]) for r in rows if r.get("status") == "ok" and r.get("steps")})
    return (f"{got[0]}" if len(got) == 1 else f"{got[0]}-{got[-1]}") if got else str(meta.get("steps"))


def write_reports(out: Path, rows: list[dict], rates: list[str], variants: list[str], meta: dict) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in COLUMNS})
    loads = [r["load1"] for r in rows if r.get("load1") is not None]
    md = [f"# Step-time breakdown ({meta.get('machine', '')})", "",
          f"{meta.get('nproc')} ranks, overrides `{' '.join(meta.get('overrides', []))}`, "
          f"{_steps_measured(rows, meta)} measured steps after {meta.get('warmup')} warm-up; medians"
          f"{', but for a local-update run (comm.mode=diloco) the mean over its whole cycles' if any(r.get('cycle', 1) > 1 for r in rows) else ''}.", "",
          *([f"Machine load (1-minute average at the end of each run): {min(loads):.1f}-{max(loads):.1f} "
             f"on {os.cpu_count()} CPUs.", ""] if loads else []),
          "## Table 4 style", "", table4_markdown(rows, rates, variants), ""]
    for rate in rates:
        md += [f"## {rate}", "", detail_markdown(rows, rate, variants), ""]
    if BASELINE in variants:   # the targets are Lion Cub's against the fp32 Lion baseline
        md += ["## Slow-link targets", "", *[f"- {ln}" for ln in check_targets(rows)], ""]
        fast = check_fast_path_targets(rows)
        md += ["## Fast-path targets", "", *([f"- {ln}" for ln in fast] or ["- no Lion Cub variant measured"]), ""]
    else:
        md += ["## Targets", "", f"Not evaluated: the slow-link and fast-path targets compare Lion Cub with "
                                 f"{BASELINE}, which this table did not measure.", ""]
    (out / "results.md").write_text("\n".join(md))
    if any(r.get("status") == "ok" for r in rows):
        plot_breakdown(out / "breakdown.png", rows, rates, variants)


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------

def child_pythonpath() -> str:
    """PYTHONPATH for the processes a benchmark starts: the repository first (its packages win), then the
    caller's entries in their order, each once (empty entries, which would mean the working directory,
    dropped)."""
    out: list[str] = []
    for p in [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]:
        if p and p not in out:
            out.append(p)
    return os.pathsep.join(out)


def _env() -> dict[str, str]:
    """What the runs' environment sets over the caller's (netsim and torchrun merge it into os.environ)."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": child_pythonpath(),
            "WANDB_MODE": "disabled", "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"}


RSS_FILE = re.compile(r"rank\d+(\.self)?\.json")   # rank_wrap's, and train_here's own peak


def not_replaceable(out: Path, rate: str, variant: str) -> str | None:
    """Why this variant's earlier measurement at `rate` under `out` may not be replaced (None: it may, or there is
    none): its run directory must be one the trainer made holding only the trainer's entries
    (trainer.rundir), its rss directory only this tool's rank<R>.json files. A measurement is replaced, never
    anything else a user put under --out."""
    run_dir, rss_dir = out / "runs" / rate / variant, out / "rss" / rate / variant
    if run_dir.is_symlink() or (run_dir.exists() and not run_dir.is_dir()):
        return f"{run_dir} is not a directory this tool made"
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if not rundir.is_ours(run_dir):
            return f"{run_dir} is not a run directory the trainer made (no {rundir.MARKER})"
        foreign = rundir.foreign_entries(run_dir)
        if foreign:
            return f"{run_dir} holds entries the trainer did not write: {', '.join(foreign[:3])}"
    if rss_dir.is_symlink() or (rss_dir.exists() and not rss_dir.is_dir()):
        return f"{rss_dir} is not a directory this tool made"
    if rss_dir.is_dir():
        other = [p.name for p in rss_dir.iterdir() if not (p.is_file() and RSS_FILE.fullmatch(p.name))]
        if other:
            return f"{rss_dir} holds entries this tool did not write: {', '.join(sorted(other)[:3])}"
    return None


def run_one(args: argparse.Namespace, rate: str, variant: str, net: object | None) -> dict:
    out = Path(args.out)
    run_dir = out / "runs" / rate / variant
    rss_dir = out / "rss" / rate / variant
    log_dir = out / "logs" / rate / variant
    for d in (run_dir, rss_dir):   # an earlier measurement of this variant at this rate (replaceable: checked)
        if d.exists():
            shutil.rmtree(d)
    cfg_files, extra = variant_args(variant, args.config_dir)
    overrides = [*args.overrides, *extra,
                 f"train.max_steps={args.warmup + args.steps}", "train.log_every=1", "train.eval_every=0",
                 "train.eval_steps=1", "diag.every=0", "log.wandb=disabled", f"train.out_dir={run_dir}"]
    train_cmd = [sys.executable, "-m", "bench.step_breakdown", "--train-here",
                 *(["--shared-gpu"] if getattr(args, "shared_gpu", False) else []),
                 "--", str(ROOT / "train.py"), *map(str, cfg_files), *overrides]
    cmd = [sys.executable, "-m", "bench.step_breakdown", "--rank-wrap", str(rss_dir / "rank{RANK}.json"), "--",
           *train_cmd]
    print(f"== {rate} {variant}: {' '.join(train_cmd)}", flush=True)
    t0 = time.perf_counter()
    if net is not None:
        codes = net.run(cmd, timeout=args.timeout, env=_env(), cwd=str(ROOT), log_dir=str(log_dir),
                        stream=None if args.verbose else open(os.devnull, "w"))
    else:
        codes = [_torchrun(args.nproc, cmd, args.timeout, log_dir)]
    row: dict = {"rate": rate, "variant": variant}
    if any(codes):
        row["status"] = f"failed rc={codes}"
        said = first_error(log_dir)
        print(f"   FAILED {codes}; logs in {log_dir}" + (f"\n   {said}" if said else ""), flush=True)
        return row
    row.update(summarize_run(read_jsonl(run_dir / "metrics.jsonl"), args.warmup, cycle_steps(load_run_config(run_dir))))
    row["peak_rss_mib"], row["peak_tree_rss_mib"] = _rss(rss_dir)
    row["status"] = "ok"
    # the trainer checkpoints at its end; a measurement is read from metrics.jsonl and config.yaml and
    # nothing resumes it, so its checkpoint (about 0.5 GB for a study-preset run of four ranks) goes
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    row["wall_s"] = time.perf_counter() - t0
    print(f"   step {row['step_ms']:.0f} ms, comm {row['comm_ms']:.0f} ms ({100 * row['comm_share']:.0f} %), "
          f"{row['wall_s']:.0f} s wall", flush=True)
    return row


def error_said(text: str) -> str:
    """The trainer's error in a log's text with the problems it lists: its first "error: ..." or "error (rank
    N): ..." line (any case), then the "  - problem" lines under it, on one line; or ''."""
    lines = text.splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.lower().startswith("error")), None)
    if at is None:
        return ""
    said = [lines[at].strip()]
    for ln in lines[at + 1:]:
        if not ln.startswith("  - "):
            break
        said.append(ln.strip())
    return " ".join(said)


def first_error(log_dir: Path) -> str:
    """The first rank log in `log_dir` with an error (`error_said`), or ''."""
    for log in sorted(log_dir.glob("*.log")):
        said = error_said(log.read_text(errors="replace"))
        if said:
            return said
    return ""


def _torchrun(nproc: int, cmd: list[str], timeout: float, log_dir: Path) -> int:
    log_dir.mkdir(parents=True, exist_ok=True)
    full = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "--no-python", *cmd]
    env = {**os.environ, **_env()}
    env.pop("RANK", None)
    with open(log_dir / "torchrun.log", "w") as f:
        return subprocess.run(full, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode


def calibrate_rate(args: argparse.Namespace, rate: str, net: object | None) -> tuple[float, float]:
    path = Path(args.out) / "calibration" / f"{rate}.json"
    cmd = [sys.executable, "-m", "bench.step_breakdown", "--calibrate-worker", str(path)]
    print(f"== calibrating alpha/beta at {rate}", flush=True)
    codes = (net.run(cmd, timeout=args.timeout, env=_env(), cwd=str(ROOT),
                     log_dir=str(Path(args.out) / "logs" / rate / "calibration"))
             if net is not None else [_torchrun(args.nproc, cmd, args.timeout, Path(args.out) / "logs" / rate / "calibration")])
    if any(codes):
        raise RuntimeError(f"calibration at {rate} failed (exit codes {codes}); see {args.out}/logs/{rate}/calibration")
    c = json.loads(path.read_text())
    return c["alpha_s"], c["beta_s_per_bit"]


def collect_rows(args: argparse.Namespace, calib: dict[str, tuple[float, float]]) -> list[dict]:
    """Rebuild rows from the run directories (so --report-only re-tabulates without rerunning)."""
    out = Path(args.out)
    rows = []
    for rate in args.rates:
        for v in args.variants:
            run_dir = out / "runs" / rate / v
            row: dict = {"rate": rate, "variant": v}
            metrics = run_dir / "metrics.jsonl"
            status_file = out / "status" / rate / f"{v}.txt"
            if status_file.exists() and status_file.read_text().strip() != "ok":
                row["status"] = status_file.read_text().strip()
                rows.append(row)
                continue
            if not metrics.exists():
                continue
            try:
                row.update(summarize_run(read_jsonl(metrics), args.warmup, cycle_steps(load_run_config(run_dir))))
            except ValueError as e:
                row["status"] = f"incomplete: {e}"
                rows.append(row)
                continue
            row["status"] = "ok"
            load_file = status_file.with_suffix(".load")
            row["load1"] = float(load_file.read_text()) if load_file.exists() else None
            row["peak_rss_mib"], row["peak_tree_rss_mib"] = _rss(out / "rss" / rate / v)
            cfg = load_run_config(run_dir)
            from bench.variants import num_params

            row["n_params"] = num_params(cfg["model"])
            if rate in calib:
                a, b = calib[rate]
                add_prediction(row, predict_step_comm_s(cfg, args.nproc, a, b), a, b)
            rows.append(row)
    return add_relative(rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.step_breakdown", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma list of presets in --config-dir")
    ap.add_argument("--rates", default=",".join(DEFAULT_RATES), help="comma list: unlimited, 1gbit, 100mbit, ...")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=0,
                    help="emulated nodes (netsim): ranks of one node share an unlimited loopback, the rate limits "
                         "only links between nodes; 0 = one namespace per rank")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="steps run first and discarded")
    ap.add_argument("--config-dir", default="configs/cpu_30m")
    ap.add_argument("--overrides", default=" ".join(DEFAULT_OVERRIDES),
                    help="space-separated section.key=value overrides for every run (default: %(default)s)")
    ap.add_argument("--out", type=path_arg, default="bench/out/step_breakdown")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run before its ranks are killed")
    ap.add_argument("--launcher", choices=["netsim", "torchrun"], default="netsim",
                    help="netsim (namespaces + tbf, needs root) or torchrun over loopback (unlimited only)")
    ap.add_argument("--no-calibrate", action="store_true", help="skip the alpha/beta fit (no model column)")
    ap.add_argument("--shared-gpu", action="store_true",
                    help="every rank on cuda:0 with a gloo group (one-GPU machines)")
    ap.add_argument("--report-only", action="store_true", help="only re-tabulate existing runs in --out")
    ap.add_argument("--verbose", action="store_true", help="echo rank output (it always goes to --out/logs)")
    ap.add_argument("--rank-wrap", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--calibrate-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--train-here", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"--rank-wrap", "--train-here"} & set(argv):  # this module's own rank processes: a command follows
        ap.add_argument("cmd", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        args = ap.parse_args(argv)
    else:  # a user's: section.key=value words anywhere among the flags, after --overrides' (util/cli.py's rule)
        ap.add_argument("words", nargs="*", metavar="section.key=value",
                        help="overrides for every run, after --overrides")
        args = ap.parse_intermixed_args(argv)
        bad = [w for w in args.words if "=" not in w or w.startswith("-")]
        if bad:
            ap.error(f"{bad[0]!r}: not a flag or a section.key=value override (variants: --variants A,B)")
        args.cmd = []
    args.variants = [v for v in args.variants.split(",") if v]
    args.rates = [r for r in args.rates.split(",") if r]
    args.overrides = args.overrides.split() + list(getattr(args, "words", []))
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.nodes and (args.nodes < 1 or args.nproc % args.nodes):
        ap.error(f"--nodes {args.nodes} must divide --nproc {args.nproc}")
    if args.launcher == "torchrun" and any(r != "unlimited" for r in args.rates):
        ap.error(f"--launcher torchrun cannot limit bandwidth; rates {args.rates} need --launcher netsim")
    return args


def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_wrap:
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return rank_wrap(Path(args.rank_wrap.replace("{RANK}", os.environ.get("RANK", "0"))), cmd)
    if args.train_here:
        train_here(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd, args.shared_gpu)
        return 0
    if args.calibrate_worker:
        calibrate_worker(Path(args.calibrate_worker))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for v in args.variants:
        variant_args(v, args.config_dir)  # fail before any run on a typo
    if not args.report_only:   # and before any run on a directory it may not replace
        problems = [p for rate in args.rates for v in args.variants if (p := not_replaceable(out, rate, v))]
        if problems:
            for p in problems:
                print(f"error: {p}; move it away or choose another --out (the tool replaces only its own earlier "
                      f"measurements)", file=sys.stderr)
            return 2
    calib_file = out / "calibration.json"
    calib: dict[str, tuple[float, float]] = {}
    if calib_file.exists():
        calib = {k: tuple(v) for k, v in json.loads(calib_file.read_text()).items()}
    if not args.report_only:
        net = None
        if args.launcher == "netsim":
            from bench.netsim import Netsim

            net = Netsim(args.nproc, None, ranks_per_ns=args.nproc // args.nodes if args.nodes else 1).up()
        try:
            for rate in args.rates:
                if net is not None:
                    net.set_rate(rate)
                if not args.no_calibrate:
                    calib[rate] = calibrate_rate(args, rate, net)
                    calib_file.write_text(json.dumps(calib, indent=1))
                for v in args.variants:
                    row = run_one(args, rate, v, net)
                    st = out / "status" / rate / f"{v}.txt"
                    st.parent.mkdir(parents=True, exist_ok=True)
                    st.write_text(row["status"])
                    # machine load while it ran (the 1-minute average at its end): CPU contention from
                    # other jobs inflates compute/pack/optimizer times, not wire time
                    st.with_suffix(".load").write_text(f"{os.getloadavg()[0]:.2f}")
        finally:
            if net is not None:
                net.down()
    rows = collect_rows(args, calib)
    meta = {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or ''}".strip(", "),
            "nproc": args.nproc, "nodes": args.nodes or args.nproc, "overrides": args.overrides, "config_dir": args.config_dir, "steps": args.steps,
            "warmup": args.warmup, "rates": args.rates, "variants": args.variants, "launcher": args.launcher,
            "shared_gpu": args.shared_gpu, "gpu": _gpu_name(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "calibration": {k: {"alpha_us": 1e6 * a, "beta_ns_per_bit": 1e9 * b,
                                "gbit_s": (1 / b / 1e9) if b else None} for k, (a, b) in calib.items()}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    write_reports(out, rows, args.rates, args.variants, meta)
    print((out / "results.md").read_text())
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
