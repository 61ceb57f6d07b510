"""Which variant reaches a given loss first on my links? Loss against wall time per variant, and the
time each needs to reach a target loss: (a) on this machine under the bandwidth simulator at one link,
(b) on a cluster you describe.

    python -m bench.time_to_loss --variants adamw_fp32 lion_fp32 lioncub_1bit --setting study-prose \\
        --link 1gbit --cluster "nodes=2 gpus_per_node=8 gpu=h100 inter=10gbit intra=nvlink" --train --measure
    python -m bench.time_to_loss --variants adamw_fp32 lioncub_1bit --runs RUNS --breakdown BD --link 100mbit

How the time axis is built (docs/time_to_loss.md): the numerics of a step do not depend on the link, so
each variant is trained once, unsimulated (`--train`, or runs you already have: `--runs DIR` holding
DIR/<variant>/metrics.jsonl and config.yaml), and its loss-against-step curve (validation loss by
default) is stretched by its time per step:
(a) MEASURED: the step time of the same variant and setting trained under bench.netsim at `--link`
    by bench.step_breakdown (`--measure` runs it into `--breakdown`; the median step, or for a
    local-update run, comm.mode=diloco, the mean over whole cycles of comm.diloco.inner_steps steps);
(b) PREDICTED: compute = training FLOPs per step (model.flops_per_token x tokens per step) over the
    cluster's GPUs at their dense bf16 peak x MFU (the MFU you give, or the one the GPU check measured,
    docs/results/gpu_check), plus communication = the registry's alpha-beta model of the variant's
    exchange (optimizer.predict_comm_seconds; a local-update scheme such as DiLoCo: its own
    LocalScheme.predict_local, its cycle's exchanges spread over the inner steps, less what the inner
    steps after each hide) on the links you name, under comm.cost_model.NodeLayout.
The target (default: the final `--metric` of the synchronous AdamW run, `--reference`) is crossed
where the curve first reaches it, interpolated linearly between evaluations (a local-update curve,
whose evaluated model changes only at some steps, SyncScheme.model_changes, by the same line drawn
between its evaluated models at the steps they were made: the crossing is the first outer step whose
model the line puts at the target, as a synchronous curve's is the first step); a variant whose curve never reaches it is reported as such. Output in `--out`: results.md (tables, what is measured and
what predicted), results.csv, time_to_loss.png, meta.json.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from bench import runstore, step_breakdown
from bench.variants import ROOT, load_run_config, read_jsonl, train_records
from optim import sync
from trainer.config import AUTO_MODE, ConfigError, load_config
from trainer.logger import NO_NUMERICS
from util.cli import Parser, is_config, path_arg, shown, variant_runs

GPU_CHECK_DIR = ROOT / "docs" / "results" / "gpu_check"
REFERENCE = "adamw_fp32"
# Per-direction link rates of the named intra-node links (bit/s): NVLink 4 (H100 SXM) moves 450 GB/s
# each way per GPU; PCIe 5.0 x16 about 64 GB/s.
NAMED_LINKS = {"nvlink": 3.6e12, "pcie": 5.12e11}
DEFAULT_LATENCY = {"inter": 30e-6, "intra": 5e-6}   # seconds per message, assumed (override inter_latency=...)
CLUSTER_KEYS = ("nodes", "gpus_per_node", "gpu", "inter", "intra", "mfu", "inter_latency", "intra_latency")


# ------------------------------------------------------------------------------------------------
# curves: loss against step from a run directory
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Curve:
    name: str
    source: str                     # the run directories / run-store entries it was read from
    steps: list[float]
    losses: list[float]             # the mean over its runs (seeds) at the steps all of them evaluated
    tokens_per_step: float | None   # global tokens per optimizer step (the train records' tokens / step)
    config: dict
    runs: int = 1

    @property
    def changes(self) -> list[float] | None:
        """The steps after which the model this curve evaluates changes (model_changes), None: every step."""
        return model_changes(self.config)


def model_changes(cfg: dict) -> list[float] | None:
    """For a run whose scheme declares it (SyncScheme.model_changes: a local-update run evaluates its global
    parameters, which move at outer steps and at the end), the steps after which its evaluated model
    changes; None where it changes after every step (the curve is then interpolated between evaluations)."""
    c, max_steps = cfg.get("comm") or {}, (cfg.get("train") or {}).get("max_steps")
    try:
        scheme = sync.get(c.get("mode", "fp32"))
        changes = scheme.changes_at(scheme.options_from(c), int(max_steps)) if max_steps else None
    except (KeyError, ValueError, TypeError):  # a mode this build lacks: its step time reports the problem
        return None
    return None if changes is None else [float(t) for t in changes]


ARM_KEYS = ("model", "data", "optim", "comm", "parallel")   # what two seeds of one arm share


def curve_setup(c: Curve) -> str:
    """What a curve's runs trained: model preset, dataset, global tokens per step, lr ('?' where unknown)."""
    model, data, optim = (c.config.get(k) or {} for k in ("model", "data", "optim"))
    tps = f"{c.tokens_per_step:,.0f} tokens/step" if c.tokens_per_step else "? tokens/step"
    lr = f"lr {optim['lr']:g}" if isinstance(optim.get("lr"), (int, float)) else "lr ?"
    if isinstance(optim.get("matrix_lr"), (int, float)) and optim.get("matrix_lr"):
        lr += f" (matrices {optim['matrix_lr']:g})"
    return f"model {model.get('preset', '?')}, data {data.get('dataset', '?')}, {tps}, {lr}"


def setup_differences(curves: dict[str, Curve]) -> list[str]:
    """A note for each of model, dataset and global batch in which the curves differ: then equal steps are
    not equal work, and a loss target means something else for each (compare them at equal time, or
    train them alike)."""
    out = []
    for what, of in (("model", lambda c: (c.config.get("model") or {}).get("preset")),
                     ("dataset", lambda c: (c.config.get("data") or {}).get("dataset")),
                     ("global batch", lambda c: c.tokens_per_step and round(c.tokens_per_step))):
        seen = {n: of(c) for n, c in curves.items()}
        if len({v for v in seen.values() if v is not None}) > 1:
            out.append(f"- **The curves differ in {what}** ({', '.join(f'{n}: {v}' for n, v in seen.items())}): "
                       f"their losses and steps are not like for like.")
    return [""] + out if out else []


def _records_and_config(name: str, src: Path) -> tuple[list[dict], dict]:
    """A run directory (metrics.jsonl, config.yaml) or an entry of bench.reproduce's run store (*.json.gz,
    read by bench.runstore: this module imports no study, so the studies may import it)."""
    if src.name.endswith(".json.gz"):
        entry = runstore.load_stored(src.parent, src.name[: -len(".json.gz")])
        if not entry or not isinstance(entry.get("records"), list) or not isinstance(entry.get("config"), dict):
            raise ValueError(f"{name}: {src} is not a readable run-store entry with records and config")
        return entry["records"], ran_config(name, src, entry["config"], entry["records"])
    if not (src / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{name}: {src / 'metrics.jsonl'} is missing; train it (--train) or point "
                                f"--run {name}=DIR at a run")
    recs = read_jsonl(src / "metrics.jsonl")
    return recs, ran_config(name, src, load_run_config(src), recs)


def ran_config(name: str, src: Path, cfg: dict, records: Sequence[dict]) -> dict:
    """The config the run trained with: `cfg` itself, or for a config that says comm.mode=auto, `cfg`
    with the mode and options it chose (trainer.automode): from <run dir>/auto_mode.json, else from the
    auto_mode event of its records (a run-store entry keeps those; the variant's sections are read from
    configs/variants), applied as the trainer applies them. Neither there: one error saying so."""
    if (cfg.get("comm") or {}).get("mode") != AUTO_MODE:
        return cfg
    from trainer import advise, automode

    decision = automode.stored_decision(src) if src.is_dir() else None   # a wrong shape: ConfigError
    if decision is not None:
        cand = advise.Candidate(decision["variant"], decision["sections"])
    else:
        events = [r for r in records if r.get("event") == "auto_mode" and isinstance(r.get("variant"), str)]
        if not events:
            where = src / automode.DECISION if src.is_dir() else f"a run directory beside {src.name}"
            raise ValueError(f"{name}: {src} trained with comm.mode=auto and nothing records the mode it chose "
                             f"(no readable {where}, no auto_mode event in its metrics); point --run {name}=DIR "
                             f"at the run directory holding its auto_mode.json, or train the variant it should "
                             f"stand for with a fixed comm.mode")
        try:
            cand = advise.load_variant(events[-1]["variant"])
        except ValueError as e:
            raise ValueError(f"{name}: {src} chose {events[-1]['variant']!r} under comm.mode=auto, which configs/"
                             f"variants no longer holds ({e}); give its {automode.DECISION}") from None
    return advise.config_from_dict(advise.candidate_config(cfg, cand)).to_dict()


def load_curve(name: str, sources: str | Path | Sequence[str | Path], metric: str = "val_loss") -> Curve:
    """`metric` against step of one run, or the mean of several runs of one arm (seeds: their configs
    may differ in nothing but train.*) at the steps every one evaluated; a repeated step keeps its last
    record. A source is a run directory or a run-store entry (*.json.gz)."""
    srcs = [Path(sources)] if isinstance(sources, (str, Path)) else [Path(x) for x in sources]
    per = []
    for src in srcs:
        recs, cfg = _records_and_config(name, src)
        pts = {r["step"]: float(r[metric]) for r in recs if metric in r and "step" in r}
        if not pts:
            raise ValueError(f"{name}: {src} has no {metric} record; evaluate during the run (train.eval_every) "
                             f"or use --metric train_loss")
        if per:
            bad = _differs(per[0][2], cfg, ARM_KEYS)
            if bad:
                raise ValueError(f"{name}: {src} is another arm than {srcs[0]} ({bad}); give one arm's seeds "
                                 f"per variant")
        per.append((pts, recs, cfg))
    steps = sorted(set.intersection(*(set(p) for p, _, _ in per)))
    if not steps:
        raise ValueError(f"{name}: its runs share no step with a {metric} record; give runs evaluated alike")
    train = [r for r in train_records(per[0][1]) if r.get("tokens") and r["step"] > 0]
    tps = train[-1]["tokens"] / train[-1]["step"] if train else None
    # statistics.fmean (an exactly rounded sum): the same bits as a study's mean of the same finals in any
    # order, so a target taken from them is reached by this curve
    losses = [statistics.fmean(p[s] for p, _, _ in per) for s in steps]
    return Curve(name, ", ".join(map(shown, srcs)), [float(s) for s in steps], losses, tps, per[0][2], len(per))


def _born(changes: Sequence[float], step: float) -> float:
    """The step after which the model current at `step` was made: the last change at or before it (0: the
    initial model)."""
    return max((c for c in changes if c <= step), default=0.0)


def crossing_step(steps: Sequence[float], losses: Sequence[float], target: float,
                  changes: Sequence[float] | None = None) -> float | None:
    """The first step at which the curve reaches `target` (loss <= target), interpolated linearly
    between the two evaluations around it; the first evaluation's step when it is already there;
    None when the curve never reaches it. With `changes` (the steps after which the evaluated model
    changes: a local-update run's outer steps) the same line is drawn between the two evaluated models,
    each placed at the step it was made, and only a model can reach the target: the first change whose
    model the line puts at or below it (the model evaluated there when none between). A synchronous
    curve is the case where the model changes after every step, so both kinds are read alike: an
    evaluation every 200 steps of a run whose model changes every 10 is interpolated as one whose model
    changes every step, and one evaluated every 2 steps at H = 10 is not (no model between)."""
    for i, (s, loss) in enumerate(zip(steps, losses)):
        if loss <= target:
            if i == 0:
                return float(s)
            s0, l0 = steps[i - 1], losses[i - 1]
            if changes is None:
                return float(s0 + (s - s0) * (l0 - target) / (l0 - loss))
            a, b = _born(changes, s0), _born(changes, s)
            if b <= s0:   # the model evaluated at s0 seen again, and now at the target (its evaluations
                return float(s)   # disagree): the evaluation that found it there, s, not the step it was made
            for c in sorted(c for c in changes if s0 < c < b):
                if l0 + (loss - l0) * (c - a) / (b - a) <= target:
                    return float(c)
            return float(b)
    return None


def loss_at_step(steps: Sequence[float], losses: Sequence[float], step: float,
                 changes: Sequence[float] | None = None) -> float | None:
    """The curve's loss at `step`, linear between the two evaluations around it; None before its first
    evaluation or past its last (a curve says nothing there). With `changes` (crossing_step) the loss of
    the model current at `step`: where an evaluation saw that model, that evaluation's; else on the line
    between the evaluated models before and after it, each placed at the step it was made."""
    if changes is not None:
        m = _born(changes, step)
        born = [_born(changes, s) for s in steps]
        if m > born[-1]:   # a model made after the last one evaluated: the curve says nothing of it
            return None
        for b, loss in zip(born, losses):
            if b == m:
                return float(loss)
        for (a, l0), (b, l1) in zip(zip(born, losses), zip(born[1:], losses[1:])):
            if a < m < b:
                return float(l0 + (l1 - l0) * (m - a) / (b - a))
        return None
    for i, s in enumerate(steps):
        if math.isclose(step, s, rel_tol=1e-9):
            return float(losses[i])
        if step < s:
            if i == 0:
                return None
            s0, l0 = steps[i - 1], losses[i - 1]
            return float(l0 + (losses[i] - l0) * (step - s0) / (s - s0))
    return None


# ------------------------------------------------------------------------------------------------
# (b) a cluster described in words
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: str                  # a key of trainer.logger.PEAK_FLOPS (its dense bf16 peak)
    inter_bps: float | None   # per-node network port, bit/s each way (None on one node)
    intra_bps: float
    mfu: float | None         # None: the GPU check's measurement (gpu_check_mfu)
    inter_latency: float = DEFAULT_LATENCY["inter"]
    intra_latency: float = DEFAULT_LATENCY["intra"]
    text: str = ""

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    def world_link(self) -> tuple[float, float]:
        """(alpha, beta) of a ring over every rank: across the node ports on several nodes (a ring in
        rank order crosses each port once each way, comm.cost_model's NodeLayout), else the intra link."""
        if self.nodes > 1:
            return self.inter_latency, 1.0 / self.inter_bps
        return self.intra_latency, 1.0 / self.intra_bps

    def layout(self, shard: int = 1):
        """comm.cost_model.NodeLayout of the replicate axis (the world at shard = 1): ranks / shard workers,
        gpus_per_node / shard of them on each node (a shard group is `shard` consecutive ranks of one node,
        trainer/parallel.py); None where that axis has one member per node or one node."""
        from comm import cost_model

        per_node = self.gpus_per_node // shard
        if self.nodes <= 1 or per_node <= 1:
            return None
        # the inter axis: one rank per node, all gpus_per_node such groups at once sharing each port
        return cost_model.NodeLayout(self.ranks // shard, per_node, intra=(self.intra_latency, 1.0 / self.intra_bps),
                                     inter=(self.inter_latency, self.gpus_per_node / self.inter_bps))

    def replicate_link(self, shard: int = 1) -> tuple[float, float]:
        """(alpha, beta) of a ring over the replicate axis at parallel.shard_size = shard: the shard
        groups' `shard` rings (one per shard index) run at once and each crosses every node's port once
        each way, so they share it (beta x shard); on one node each rank has its own link. shard = 1:
        world_link."""
        alpha, beta = self.world_link()
        return (alpha, beta * shard) if self.nodes > 1 else (alpha, beta)


def _link(key: str, value: str) -> float:
    from bench.netsim import parse_rate

    if value.lower() in NAMED_LINKS:
        return NAMED_LINKS[value.lower()]
    try:
        bps = parse_rate(value)
    except ValueError:
        bps = None
    if bps is None:
        raise ValueError(f"--cluster {key}={value}: not a link rate; use e.g. {key}=10gbit, {key}=400gbit"
                         + (" or nvlink / pcie" if key == "intra" else ""))
    return bps


def parse_cluster(text: str) -> Cluster:
    """`nodes=2 gpus_per_node=8 gpu=h100 inter=10gbit intra=nvlink [mfu=0.35] [inter_latency=30us]`
    -> Cluster; every bad key or value is a one-line ValueError naming it."""
    from trainer.logger import PEAK_FLOPS

    kv: dict[str, str] = {}
    for word in text.replace(",", " ").split():
        key, sep, value = word.partition("=")
        if not sep or not value:
            raise ValueError(f"--cluster: {word!r} is not key=value; e.g. \"nodes=2 gpus_per_node=8 gpu=h100 "
                             f"inter=10gbit intra=nvlink\"")
        if key not in CLUSTER_KEYS:
            raise ValueError(f"--cluster: unknown key {key!r}; valid: {', '.join(CLUSTER_KEYS)}")
        if key in kv:
            raise ValueError(f"--cluster: {key} given twice; give it once")
        kv[key] = value

    def count(key: str, default: int | None = None) -> int:
        if key not in kv:
            if default is None:
                raise ValueError(f"--cluster: {key}= is missing; e.g. {key}=2")
            return default
        try:
            n = int(kv[key])
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--cluster {key}={kv[key]}: must be an integer >= 1")
        return n

    def seconds(key: str) -> float:
        if key not in kv:
            return DEFAULT_LATENCY[key.removesuffix("_latency")]
        v = kv[key].lower()
        for unit, f in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
            if v.endswith(unit):
                try:
                    x = float(v[: -len(unit)]) * f
                except ValueError:
                    break
                if x >= 0 and math.isfinite(x):
                    return x
                break
        raise ValueError(f"--cluster {key}={kv[key]}: a latency with its unit, e.g. {key}=30us")

    nodes, per = count("nodes"), count("gpus_per_node", 1)
    gpu = kv.get("gpu", "")
    peaks = {k.lower(): k for k in PEAK_FLOPS}
    if gpu.lower() not in peaks:
        raise ValueError(f"--cluster gpu={gpu or '?'}: {'unknown GPU' if gpu else 'missing'}; one of "
                         f"{', '.join(sorted(peaks))} (its dense bf16 peak sets the compute time)")
    if nodes > 1 and "inter" not in kv:
        raise ValueError(f"--cluster: {nodes} nodes need inter=<rate> (each node's network port, e.g. inter=10gbit)")
    mfu = None
    if "mfu" in kv and kv["mfu"] != "gpu-check":
        try:
            mfu = float(kv["mfu"])
        except ValueError:
            mfu = -1.0
        if not 0 < mfu <= 1:
            raise ValueError(f"--cluster mfu={kv['mfu']}: a fraction in (0, 1], e.g. mfu=0.35, or mfu=gpu-check "
                             f"(the GPU check's measurement)")
    return Cluster(nodes, per, peaks[gpu.lower()], _link("inter", kv["inter"]) if nodes > 1 else None,
                   _link("intra", kv.get("intra", "nvlink")), mfu, seconds("inter_latency"), seconds("intra_latency"),
                   text=" ".join(f"{k}={v}" for k, v in kv.items()))


def gpu_check_mfu(gpu: str, variant: str, reference: str = REFERENCE, results: Path = GPU_CHECK_DIR
                  ) -> tuple[float, str]:
    """(MFU, where it comes from): the `variant` row (else the `reference` row, else the median of the rows) of
    the latest GPU check's step tables on that GPU (docs/results/gpu_check/<gpu>_run<k>[_*]_train_results.csv, every
    table of run k: a rerun's rows replace the first table's)."""
    runs: dict[int, list[Path]] = {}
    for p in results.glob(f"{gpu.lower()}_run*_train_results.csv"):
        k = p.name.removeprefix(f"{gpu.lower()}_run").split("_", 1)[0]
        if k.isdigit():
            runs.setdefault(int(k), []).append(p)
    by: dict[str, tuple[dict, Path]] = {}
    for k in sorted(runs, reverse=True):
        for path in sorted(runs[k], key=lambda q: (len(q.name), q.name)):   # the run's own table, then reruns
            by.update({r["variant"]: (r, path) for r in csv.DictReader(path.open())
                       if r.get("status") == "ok" and r.get("mfu")})
        if by:
            break
    if not by:
        raise ValueError(f"--cluster gpu={gpu}: the GPU check measured no MFU on {gpu} ({results}); give mfu=0.35")
    pick = variant if variant in by else reference if reference in by else None
    if pick is None:   # every variant of the table still gets a step time, from the same rows
        mfus = sorted(float(r["mfu"]) for r, _ in by.values())
        med = statistics.median(mfus)
        return med, (f"GPU check on {gpu}: the median of its {len(mfus)} measured variant(s) "
                     f"({', '.join(sorted(by))}); neither {variant} nor {reference} was measured there")
    row, path = by[pick]
    why = "" if pick == variant else f", {variant} was not measured there"
    return float(row["mfu"]), f"GPU check {path.name}, {pick} row{why}"


def run_vocab(cfg: dict, vocab_size: int | None = None) -> int | None:
    """The vocabulary the run's model had: `vocab_size` when given, else its dataset's tokenizer's
    (None: the preset's, GPT-2)."""
    import data

    if vocab_size:
        return vocab_size
    ds = (cfg.get("data") or {}).get("dataset", "builtin")
    where = ds if Path(ds).is_absolute() or ds == "builtin" else str(ROOT / ds)
    try:
        return data.dataset_vocab_size(where)
    except (OSError, ValueError) as e:
        raise ValueError(f"data.dataset={ds}: cannot read its vocabulary here ({str(e).splitlines()[0]}); give "
                         f"--vocab-size N (study-prose: 8192) or prepare the dataset") from None


def _model(cfg: dict, vocab: int | None = None):
    import torch

    from model import GPT, resolve_config

    with torch.device("meta"):
        return GPT(resolve_config(cfg["model"], vocab_size=vocab))


def predict_cluster_step(curve: Curve, cluster: Cluster, reference: str = REFERENCE,
                         vocab_size: int | None = None) -> dict:
    """Predicted seconds per step of `curve`'s variant on `cluster` at the curve's global batch:
    compute from FLOPs and MFU, communication from the registry's cost model (module docstring)."""
    from comm import cost_model
    from trainer.logger import PEAK_FLOPS

    cfg = curve.config
    if curve.tokens_per_step is None:
        raise ValueError(f"{curve.name}: its metrics.jsonl has no train record with tokens; cannot size a step")
    c = cfg.get("comm") or {}
    scheme = sync.get(c.get("mode", "fp32"))
    shard = int((cfg.get("parallel") or {}).get("shard_size", 1) or 1)
    P = cluster.ranks
    if shard > 1 and scheme.kind != sync.LOCAL:
        raise ValueError(f"{curve.name}: parallel.shard_size={shard} is modelled on --cluster for local-update "
                         f"schemes only (comm.mode={scheme.name} exchanges per step on each rank's shards, with "
                         f"scheme-specific shard-axis traffic); predict it at parallel.shard_size=1")
    if shard > 1 and cluster.gpus_per_node % shard:
        raise ValueError(f"{curve.name}: parallel.shard_size={shard} does not divide gpus_per_node="
                         f"{cluster.gpus_per_node}: a shard group shares one node's fast links (the trainer "
                         f"refuses it too)")
    vocab = run_vocab(cfg, vocab_size)
    model = _model(cfg, vocab)
    if cluster.mfu is not None:
        mfu, mfu_src = cluster.mfu, "given"
    else:
        mfu, mfu_src = gpu_check_mfu(cluster.gpu, base_variant(curve.name), reference)
    flops = model.flops_per_token((cfg.get("data") or {}).get("seq_len")) * curve.tokens_per_step
    compute = flops / (P * PEAK_FLOPS[cluster.gpu] * mfu)
    alpha, beta = cluster.replicate_link(shard)
    out = {"ranks": P, "mfu": mfu, "mfu_source": mfu_src, "compute_s": compute, "flops_per_step": flops}
    with cost_model.node_layout(cluster.layout(shard)):
        if scheme.kind == sync.LOCAL:  # a local-update scheme predicts its own cycle on the model
            from trainer.comm_prediction import fsdp_comm, param_layout, sharded_param_layout

            try:
                options = scheme.options_from(c)
            except ValueError as e:
                raise ValueError(f"{curve.name}: {e}") from None
            workers = P // shard  # the replicate axis; at S > 1 each worker exchanges its shards of the model
            params = sharded_param_layout(model, shard) if shard > 1 else param_layout(model)
            pred = scheme.predict_local(options, workers, params, alpha, beta, step_compute_s=compute,
                                        background=True)
            out.update(comm_s=pred.comm_s, bytes_per_step=pred.bytes_per_step, peak_step_bytes=pred.peak_step_bytes,
                       comm_how=f"{scheme.name}: a cycle's exchanges over {workers} workers ({pred.cycle_comm_s * 1e3:.1f} "
                                f"ms exposed of {pred.wire_s * 1e3:.1f} ms) over {pred.cycle_steps} inner steps")
            if shard > 1:  # FSDP inside each worker's shard group, over one node's links
                micro = int((cfg.get("data") or {}).get("grad_accum", 1) or 1)
                fsdp_s, fsdp_bytes = fsdp_comm(model, shard, cluster.intra_latency, 1.0 / cluster.intra_bps, micro)
                out["comm_s"] += fsdp_s
                out["fsdp_bytes_per_step"] = fsdp_bytes  # the fast axis; bytes_per_step stays the slow one's
                out["comm_how"] += (f"; FSDP in each node's shard groups of {shard}: {fsdp_s * 1e3:.1f} ms, "
                                    f"{fsdp_bytes / 1e6:.1f} MB sent per rank per step at {cluster.intra_bps / 1e9:.4g} Gbit/s, "
                                    f"booked exposed (an upper bound: FSDP2 overlaps it with compute)")
        else:
            from bench.variants import build_optimizer_for, predict_step_comm_s

            opt = build_optimizer_for(cfg, vocab)
            step = opt.predict_comm_seconds(alpha, beta, P)
            every = int((c.get("momentum_sync") or {}).get("every", 0) or 0)
            how = "per step"
            if every:
                with_sync = predict_step_comm_s(cfg, P, alpha, beta, sync_step=True, vocab_size=vocab)
                step += (with_sync - step) / every
                how = f"per step, with the momentum sync every {every} steps spread over them"
            sent = sum(s for s, _ in opt.wire_bytes_per_step(P, 0).values())
            out.update(comm_s=step, bytes_per_step=sent, peak_step_bytes=sent, comm_how=how)
    out["step_s"] = out["compute_s"] + out["comm_s"]
    return out


def node_port_bytes(cfg: dict, nodes: int, gpus_per_node: int, vocab_size: int | None = None) -> float:
    """Bytes through each node's network port per step (one way, the slow axis between nodes) of the run
    `cfg` on `nodes` x `gpus_per_node` ranks, by the registry's cost model as predict_cluster_step uses it:
    its communication seconds on a probe cluster whose node ports move one byte a second with no latency,
    whose links inside a node are free and whose compute takes no time (so nothing hides an exchange). A
    ring allreduce of B bytes per rank in rank order over two nodes crosses each port with 2 (P - 1) / P x B
    (1.5 B at P = 4); at parallel.shard_size = S the S rings of the replicate axis share each port; a local-
    update scheme's cycle is spread over its inner steps. What the column of bytes handed to the
    collectives per rank (comm_bytes) cannot say: the traffic between nodes, which the slow links carry."""
    probe = Cluster(nodes, gpus_per_node, "H100", inter_bps=8.0, intra_bps=1e30, mfu=1e30,
                    inter_latency=0.0, intra_latency=0.0, text=f"probe {nodes} x {gpus_per_node}")
    curve = Curve("probe", "-", [], [], 1.0, cfg)   # tokens only size the compute, which takes no time here
    return predict_cluster_step(curve, probe, vocab_size=vocab_size)["comm_s"]


# ------------------------------------------------------------------------------------------------
# (a) step times measured under the simulator by bench.step_breakdown
# ------------------------------------------------------------------------------------------------

STEP_KEYS = ("model", "data.batch_size", "data.seq_len", "data.grad_accum", "optim", "comm", "parallel")
# keys inside STEP_KEYS that change a step's numbers but not its work or bytes: two runs differing only
# in them share a step time (an arm's swept lr, DiLoCo's swept outer lr). Every other key counts, so a
# key added later is compared until it is listed here.
NUMBERS_ONLY = frozenset({
    "optim.lr", "optim.betas", "optim.eps", "optim.weight_decay", "optim.grad_clip", "optim.schedule",
    "optim.warmup_steps", "optim.warmup_fraction", "optim.min_lr_ratio", "optim.decay_fraction",
    "optim.decay_shape", "optim.schedule_steps", "optim.embedding_lr_mult", "optim.head_lr_mult",
    "optim.scalar_lr_mult", "optim.matrix_lr", "optim.mu",
    "comm.diloco.outer_lr", "comm.diloco.outer_momentum", "comm.diloco.nesterov", "comm.diloco.alpha",
    "comm.diloco.final_average"})


def _get(cfg: dict, dotted: str):
    v = cfg
    for part in dotted.split("."):
        v = (v or {}).get(part) if isinstance(v, dict) else None
    return v


def config_mismatch(curve_cfg: dict, measured_cfg: dict) -> str | None:
    """The first setting that shapes a step's time and differs between the two runs, or None."""
    return _differs(curve_cfg, measured_cfg, STEP_KEYS, ("curve run", "measured run"), NUMBERS_ONLY)


def step_differences(curve_cfg: dict, variant_cfg: dict) -> list[tuple[str, Any]]:
    """(dotted key, the curve's value) of every setting that shapes a step's time where the curve's run
    differs from `variant_cfg` (its variant file with the same overrides): what bench.step_breakdown must
    add to the variant (`name@key=value`) to time the step the curve trained."""
    out: list[tuple[str, Any]] = []
    for key in STEP_KEYS:
        for dotted, a, b in _leaves(_get(curve_cfg, key), _get(variant_cfg, key), key):
            if a != b and dotted not in NUMBERS_ONLY:
                out.append((dotted, a))
    return out


def _leaves(a: Any, b: Any, key: str) -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, a's value, b's value) at every leaf of two config sections, nested sections walked."""
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {}
        for k in sorted(set(a) | set(b)):
            yield from _leaves(a.get(k), b.get(k), f"{key}.{k}")
    else:
        yield key, a, b


def _override(key: str, value: Any) -> str:
    """key=value as a config override reads it back (YAML flow: true/false, null, numbers, lists)."""
    return f"{key}={json.dumps(value) if not isinstance(value, str) else value}"


def _differs(cfg_a: dict, cfg_b: dict, keys: Sequence[str], names: tuple[str, str] = ("one", "the other"),
             ignore: frozenset[str] = frozenset()) -> str | None:
    """The first of `keys` (dotted; a section compares leaf by leaf, nested sections too) whose value
    differs, said in words; keys in `ignore` are not compared."""
    x, y = names
    for key in keys:
        for dotted, a, b in _leaves(_get(cfg_a, key), _get(cfg_b, key), key):
            if a != b and dotted not in ignore:
                return f"{dotted}: {x} {a!r}, {y} {b!r}"
    return None


def measured_name(name: str, files: Sequence[str], overrides: Sequence[str], curve: Curve) -> str:
    """The bench.step_breakdown variant that times the step `curve` trained: `name`, plus `@key=value` for
    each step-shaping setting in which the curve's runs differ from the variant's files with these
    overrides (an arm trained at another Dion rank than its variant file is measured at its own; an lr
    is not a difference: NUMBERS_ONLY). `name` alone when the files do not load (measured_step says why)."""
    try:
        cfg = load_config([ROOT / f for f in files], list(overrides)).to_dict()
    except (ConfigError, OSError):
        return name
    return "@".join([name, *(_override(k, v) for k, v in step_differences(curve.config, cfg))])


def schedule_of(curves: Iterable[Curve]) -> list[str]:
    """The override that gives a short measured run the lr schedule of the curves' runs, so that it times
    their first steps: the schedule's horizon (optim.schedule_steps, else train.max_steps; the longest of
    the curves'). The lr does not shape a step's time, but a run shorter than its warmup is refused
    (optim.warmup_steps >= train.max_steps), which a 1,200-step study's 20 warmup steps are against
    the 13 steps measured."""
    horizon = max((_get(c.config, "optim.schedule_steps") or _get(c.config, "train.max_steps") or 0
                   for c in curves), default=0)
    return [f"optim.schedule_steps={horizon}"] if horizon else []


def measured_step(curve: Curve, breakdown: Path, link: str, warmup: int, as_name: str | None = None) -> dict:
    """The step time of `curve`'s variant in bench.step_breakdown's run at `link` ({} with a reason
    in "missing" when there is none or it ran another setting); `as_name`: the variant string it was
    measured as (measured_name), when not the curve's name."""
    from bench.step_breakdown import cycle_steps, summarize_run

    run = breakdown / "runs" / link / (as_name or curve.name)
    if not (run / "metrics.jsonl").is_file():
        return {"missing": f"no step_breakdown run at {run} (--measure runs it)"}
    recs = read_jsonl(run / "metrics.jsonl")
    try:
        cfg = ran_config(curve.name, run, load_run_config(run), recs)
    except ValueError as e:
        return {"missing": f"the run measured at {link}: {e}"}
    bad = config_mismatch(curve.config, cfg)
    train = [r for r in train_records(recs) if r.get("tokens") and r["step"] > 0]
    tps = train[-1]["tokens"] / train[-1]["step"] if train else None
    if bad is None and curve.tokens_per_step and tps and abs(tps - curve.tokens_per_step) > 0.5:
        bad = f"global tokens per step: curve run {curve.tokens_per_step:g}, measured run {tps:g} (another world size?)"
    if bad:
        return {"missing": f"the run measured at {link} differs from the curve's: {bad}"}
    s = summarize_run(recs, warmup, cycle_steps(cfg))
    k = s["steps"] // s["cycle"]
    how = (f"mean of {s['steps']} steps = {k} whole cycle{'s' if k > 1 else ''}" if s["cycle"] > 1
           else f"median of {s['steps']} steps")
    return {"step_s": s["step_ms"] / 1e3, "comm_s": s["comm_ms"] / 1e3, "compute_s": s["compute_ms"] / 1e3, "how": how}


# ------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------

def default_target(curves: dict[str, Curve], reference: str, metric: str) -> tuple[float, str]:
    if reference not in curves:
        raise ValueError(f"no --target given and no {reference} run among the variants ({', '.join(curves)}) to take "
                         f"it from; give --target LOSS or --reference VARIANT")
    c = curves[reference]
    return c.losses[-1], f"{reference}'s final {metric} (step {c.steps[-1]:g})"


def report_rows(curves: dict[str, Curve], target: float, step_times: dict[str, dict[str, dict]],
                reference: str) -> list[dict]:
    """One row per (setting, variant): the step time, the step and time of the target crossing
    (None: never reached), the ratio to the reference's time, and the loss at equal time (budget_loss:
    the curve at the step it reaches when the setting's quickest whole run ends, budget_s; None before
    its first evaluation). step_times: {setting: {variant: {"step_s", ... } or {"missing": why}}}."""
    rows = []
    for setting, by in step_times.items():
        ref_time = None
        part = []
        for name, c in curves.items():
            st = by.get(name) or {"missing": "not evaluated"}
            cross = crossing_step(c.steps, c.losses, target, c.changes)
            row = {"setting": setting, "variant": name, "final_loss": c.losses[-1], "steps": c.steps[-1],
                   "target_step": cross, **{k: v for k, v in st.items()}}
            if "step_s" in st:
                row["total_s"] = c.steps[-1] * st["step_s"]
                row["target_s"] = cross * st["step_s"] if cross is not None else None
                if name == reference:
                    ref_time = row["target_s"]
            part.append(row)
        # equal time: each curve where the quickest whole run of this setting ends
        budget = min((row["total_s"] for row in part if row.get("step_s", 0) > 0), default=None)
        for row in part:
            t = row.get("target_s")
            row["speedup"] = ref_time / t if ref_time and t else None
            if budget is not None and row.get("step_s", 0) > 0:
                c = curves[row["variant"]]
                row["budget_s"], row["budget_step"] = budget, min(budget / row["step_s"], c.steps[-1])
                row["budget_loss"] = loss_at_step(c.steps, c.losses, row["budget_step"], c.changes)
        rows += part
    return rows


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 3600:.2f} h" if x >= 7200 else f"{x / 60:.1f} min" if x >= 120 else f"{x:.2f} s"


def markdown(rows: list[dict], settings: dict[str, str], target: float, target_src: str, metric: str) -> str:
    out = []
    for setting, what in settings.items():
        mine = [r for r in rows if r["setting"] == setting]
        budget = next((r["budget_s"] for r in mine if r.get("budget_s")), None)
        out += [f"## {setting}", "", what, "",
                "| variant | final " + metric + " | steps | step (ms) | compute (ms) | comm (ms) | step time from | "
                f"reaches {target:.4f} at step | time to target | vs reference | whole run | "
                f"{metric} at {_fmt_s(budget)} (at step) |",
                "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in mine:
            if "step_s" not in r:
                out.append(f"| {r['variant']} | {r['final_loss']:.4f} | {r['steps']:g} | - | - | - | "
                           f"{r['missing']} | {_cross(r)} | - | - | - | - |")
                continue
            sp = r.get("speedup")
            out.append(f"| {r['variant']} | {r['final_loss']:.4f} | {r['steps']:g} | {1e3 * r['step_s']:.1f} | "
                       f"{_ms(r.get('compute_s'))} | {_ms(r.get('comm_s'))} | {r['how']} | {_cross(r)} | "
                       f"{_fmt_s(r['target_s']) if r['target_s'] is not None else 'not reached'} | "
                       f"{f'{sp:.2f}x' if sp else '-'} | {_fmt_s(r['total_s'])} | {_at_budget(r)} |")
        if budget is not None:
            out += ["", f"Equal time: each curve where the quickest whole run here ends ({_fmt_s(budget)}): its "
                        f"{metric} at that time's step (step time x step = {_fmt_s(budget)}), linear between its "
                        "evaluations; 'before its first evaluation' where the curve has none yet. A local-update "
                        "curve (DiLoCo) evaluates its global model, which changes only at outer steps: the same "
                        "line is drawn between its evaluated models at the steps they were made, its target step "
                        "is the first outer step whose model the line puts at the target, and its loss at a time "
                        "is that of the model current then (its evaluation's where one saw it)."]
        out.append("")
    return "\n".join([f"Target {metric} {target:.4f}: {target_src}.", "", *out])


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}" if x >= 0.1 else f"{1e3 * x:.3g}"


def _at_budget(r: dict) -> str:
    if r.get("budget_step") is None:
        return "-"
    if r.get("budget_loss") is None:
        return f"before its first evaluation ({r['budget_step']:.0f})"
    return f"{r['budget_loss']:.4f} ({r['budget_step']:.0f})"


def _cross(r: dict) -> str:
    return "not reached" if r["target_step"] is None else f"{r['target_step']:.0f}"


def curve_panels(curves: dict[str, Curve], step_times: dict[str, dict[str, dict]]) -> dict:
    """{setting: {variant: (seconds, losses)}} for the variants with a step time."""
    return {setting: {n: ([s * by[n]["step_s"] for s in c.steps], list(c.losses))
                      for n, c in curves.items() if "step_s" in by.get(n, {})}
            for setting, by in step_times.items()}


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """ys linear in xs at x (xs ascending; clamped to the ends)."""
    if x <= xs[0]:
        return ys[0]
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def end_to_end(curves: dict[str, Curve], e2e: Path, metric: str, target: float, measured: dict[str, dict]
               ) -> tuple[list[dict], dict]:
    """The check of the construction: runs trained end to end under the simulator (e2e/<variant>/,
    same setting and link) give loss against the trainer's train_time_s (seconds inside timed train
    steps); their time to the target and whole-run time beside the constructed ones (curve step x
    measured step time). Returns (rows, {variant: (seconds, losses)})."""
    rows, panel = [], {}
    for name, c in curves.items():
        path = e2e / name / "metrics.jsonl"
        if not path.is_file():
            continue
        pts = {r["step"]: (float(r["train_time_s"]), float(r[metric])) for r in read_jsonl(path)
               if metric in r and "train_time_s" in r}
        steps = sorted(pts)
        if not steps:
            rows.append({"variant": name, "missing": f"{path} has no {metric} record with train_time_s"})
            continue
        secs, losses = [pts[s][0] for s in steps], [pts[s][1] for s in steps]
        panel[name] = (secs, losses)
        m = measured.get(name, {})
        # the step where the run crossed (read at its model changes, as the curve's), at its time: the train
        # time linear between the evaluations around it
        e2e_step = crossing_step(steps, losses, target, c.changes)
        cross_t = None if e2e_step is None else float(_interp(e2e_step, steps, secs))
        cross_s = crossing_step(c.steps, c.losses, target, c.changes)
        row = {"variant": name, "e2e_target_s": cross_t, "e2e_total_s": secs[-1], "e2e_steps": steps[-1],
               "e2e_final_loss": losses[-1], "curve_final_loss": c.losses[-1]}
        if "step_s" in m:
            row["built_target_s"] = cross_s * m["step_s"] if cross_s is not None else None
            row["built_total_s"] = steps[-1] * m["step_s"]
        rows.append(row)
    return rows, panel


def end_to_end_markdown(rows: list[dict], link: str, metric: str) -> str:
    out = [f"## Check: trained end to end under the simulator at {link}", "",
           f"The same variants trained under bench.netsim at {link} end to end; time = the trainer's train_time_s "
           f"(MEASURED), against the construction above (curve x measured step time).", "",
           f"| variant | final {metric} end to end / curve run | time to target end to end | constructed | ratio | "
           f"whole run end to end | constructed | ratio |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "missing" in r:
            out.append(f"| {r['variant']} | {r['missing']} | | | | | | |")
            continue
        ratio = (lambda a, b: f"{b / a:.2f}" if a and b else "-")
        bt, bw = r.get("built_target_s"), r.get("built_total_s")
        out.append(f"| {r['variant']} | {r['e2e_final_loss']:.4f} / {r['curve_final_loss']:.4f} | "
                   f"{_fmt_s(r['e2e_target_s']) if r['e2e_target_s'] is not None else 'not reached'} | "
                   f"{_fmt_s(bt) if bt is not None else '-'} | {ratio(r['e2e_target_s'], bt)} | "
                   f"{_fmt_s(r['e2e_total_s'])} | {_fmt_s(bw)} | {ratio(r['e2e_total_s'], bw)} |")
    return "\n".join(out + [""])


# ------------------------------------------------------------------------------------------------
# training the curves and measuring the steps (subprocesses)
# ------------------------------------------------------------------------------------------------

LR_KEYS = ("optim.lr",)   # a setting's shared lr (bench.reproduce's --lr shared); its warmup is kept for all


def setting_overrides(setting: str, lr: str = "variant") -> tuple[tuple[str, ...], int, int]:
    """(overrides, steps, evaluations) of a bench.reproduce setting at its full scale: its model, corpus, batch
    and warmup; with lr="setting" also its shared lr (every variant at one lr), else each variant keeps its own
    (its file's optim.lr: which method reaches a loss first is asked of each at its lr)."""
    if setting not in runstore.SETTINGS:
        raise ValueError(f"--setting {setting}: unknown; one of {', '.join(runstore.SETTINGS)}")
    st = runstore.SETTINGS[setting]
    over = runstore.merge_overrides(runstore.FULL_OVERRIDES, st.full)
    if lr != "setting":
        over = tuple(o for o in over if o.partition("=")[0] not in LR_KEYS)
    return over, st.steps or 300, st.evals or 10


def _env() -> dict:
    from bench.step_breakdown import child_pythonpath

    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "WANDB_MODE": "disabled", "OMP_NUM_THREADS":
           os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("RANK", None)
    return env


def _curve_settings(steps: int, evals: int, run_dir: Path) -> list[str]:
    """What train_curve sets on top of the variant and the overrides."""
    return [f"train.max_steps={steps}", f"train.eval_every={max(1, steps // evals)}", "train.log_every=1",
            "diag.every=0", "log.wandb=disabled", f"train.out_dir={run_dir}"]


# what makes a stored curve run another run than the one --train would start (a loss curve's numerics)
CURVE_KEYS = ("model", "data", "optim", "comm", "parallel", "train.max_steps", "train.seed", "train.eval_every",
              "train.eval_steps", "train.dtype")
# ... and the settings inside them that leave the curve as it is (timeouts, caches, memory, timing, auto's own)
NOT_THE_CURVE = NO_NUMERICS   # settings that change how a run executes, not its numbers (trainer.logger)


def _dataset(v: Any) -> Any:
    """data.dataset as a place: builtin, or the resolved directory however it was spelt."""
    return v if not isinstance(v, str) or v.rstrip("/") == "builtin" else str(Path(v).expanduser().resolve())


def curve_run_mismatch(files: list[str], overrides: list[str], run_dir: Path, steps: int, evals: int) -> str | None:
    """Where the run already in `run_dir` differs from what train_curve would train there now (the first
    setting of CURVE_KEYS that shapes the curve, saved value against wanted), or None when it is that run.
    The saved config is read back through the config loader (keys added since it ran take their defaults;
    as written when it no longer loads); comm.mode=auto is compared as the mode the run picked."""
    from trainer.advise import config_from_dict
    want = load_config(files, [*overrides, *_curve_settings(steps, evals, run_dir)]).to_dict()
    saved = load_run_config(run_dir)
    try:
        saved = config_from_dict(saved).to_dict()
    except (ConfigError, ValueError, TypeError):
        pass  # a key since removed or renamed: compared as written
    keys = [k for k in CURVE_KEYS if not (k == "comm" and _get(want, "comm.mode") == AUTO_MODE)]  # auto: its pick
    for key in keys:
        for dotted, a, b in _leaves(_get(saved, key), _get(want, key), key):
            if dotted.startswith(NOT_THE_CURVE):
                continue
            if dotted == "data.dataset":
                a, b = _dataset(a), _dataset(b)
            if a != b:
                return f"{dotted} is {a!r} there, {b!r} now"
    return None


def train_curve(name: str, files: list[str], overrides: list[str], run_dir: Path, nproc: int, steps: int,
                evals: int, link: str = "", nodes: int = 0) -> None:
    """Train one variant: unsimulated (torchrun), or with `link` end to end under bench.netsim (for
    --e2e: one network namespace per rank, or per node of nproc / nodes ranks)."""
    args = ["train.py", *files, *overrides, *_curve_settings(steps, evals, run_dir)]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = run_dir.parent / f"{name}.log"
    if link:
        from bench import netsim

        print(f"== training {name} under bench.netsim at {link}: {' '.join(args)}", flush=True)
        with open(log_path, "w") as log:
            codes = netsim.run(nproc, [sys.executable, *args], link, timeout=3600, env=_env(), cwd=str(ROOT),
                               log_dir=str(run_dir.parent / f"{name}.logs"), stream=log,
                               ranks_per_ns=nproc // nodes if nodes else 1)
        rc = max(codes, key=abs)
    else:
        launcher = ([sys.executable, "-m", "launch.torchrun", "--standalone", f"--nproc_per_node={nproc}"]
                    if nproc > 1 else [sys.executable])
        print(f"== training {name} (unsimulated): {' '.join([*launcher, *args])}", flush=True)
        with open(log_path, "w") as log:
            rc = subprocess.run([*launcher, *args], cwd=ROOT, env=_env(), stdout=log,
                                stderr=subprocess.STDOUT).returncode
    if rc:
        said = step_breakdown.error_said(log_path.read_text(errors="replace"))
        raise RuntimeError(f"training {name} failed (exit {rc}{': ' + said if said else ''}); see {log_path}")


def measure_steps(names: list[str], overrides: list[str], link: str, breakdown: Path, nproc: int, steps: int,
                  warmup: int, nodes: int = 0) -> None:
    cmd = [sys.executable, "-m", "bench.step_breakdown", "--rates", link, "--variants", ",".join(names),
           "--config-dir", "configs/variants", "--overrides", " ".join(overrides), "--out", str(breakdown),
           "--nproc", str(nproc), "--nodes", str(nodes), "--steps", str(steps), "--warmup", str(warmup),
           "--no-calibrate"]
    print(f"== measuring step times at {link}: {' '.join(cmd)}", flush=True)
    rc = subprocess.run(cmd, cwd=ROOT, env=_env()).returncode
    if rc:
        print(f"   bench.step_breakdown exited {rc}; variants without a measurement are reported as such", flush=True)


# ------------------------------------------------------------------------------------------------
# the command
# ------------------------------------------------------------------------------------------------

def variant_specs(ns, resolve) -> tuple[list[tuple[str, list[str]]], dict[str, list[str]]]:
    """(name, config files) per --variants entry, and {name: its own overrides}: `name@key=value@...`
    (as bench.advise and bench.step_breakdown read it) is variant `name` with those overrides on top of
    everyone's, so one variant file sweeps a setting (diloco_h10@comm.diloco.inner_steps=50); the entry
    as given is its name (its runs: <runs>/<entry>/)."""
    own: dict[str, list[str]] = {}
    bases = []
    for v in ns.variants:
        base, *extra = v.split("@")
        if any("=" not in x for x in extra):
            raise ValueError(f"--variants {v}: after '@' give key=value overrides, e.g. "
                             f"{base}@comm.diloco.inner_steps=50")
        if any("/" in x for x in extra):  # the entry names its run directories
            raise ValueError(f"--variants {v}: an override of the entry's own holds a '/'; give path-valued "
                             f"settings to every variant (key=value after the variants) or in a config file")
        own[v] = extra
        bases.append(base if is_config(base) else resolve(base))
    spelt: dict[Path, str] = {}  # one file, however it is spelt: its first spelling
    for i, b in enumerate(bases):
        bases[i] = spelt.setdefault((Path(b) if Path(b).is_absolute() else ROOT / b).resolve(), b)
    unique = list(dict.fromkeys(bases))  # variant_runs names each file (a stem, or a path where stems clash)
    named = dict(zip(unique, variant_runs(argparse.Namespace(variants=unique, configs=ns.configs), resolve)))
    out, mine = [], {}
    for v, b in zip(ns.variants, bases):
        name = "@".join([named[b][0], *own[v]])
        if name in mine:
            raise ValueError(f"--variants {v}: given twice (as {name}); each candidate once")
        out.append((name, named[b][1]))
        mine[name] = own[v]
    return out, mine


def base_variant(name: str) -> str:
    """The variant's own name of a candidate (`name@key=value` -> name)."""
    return name.split("@", 1)[0]


def parse_args(argv: Sequence[str] | None = None):
    ap = Parser(prog="python -m bench.time_to_loss", description=__doc__.split("\n\n")[0], configs=True,
                variants=True, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--setting", default="study-prose", help="bench.reproduce setting of the runs (model, corpus, "
                                                              "batch): its overrides come before yours")
    ap.add_argument("--lr", default="variant", choices=["variant", "setting"],
                    help="the lr of a curve --train trains: each variant's own (its file's optim.lr; default), "
                         "or the setting's shared one (every variant at one lr, as bench.reproduce's --lr shared); "
                         "optim.lr=X after the variants sets it for all; the warmup is the setting's")
    ap.add_argument("--metric", default="val_loss", choices=["val_loss", "train_loss"])
    ap.add_argument("--target", type=float, default=None, help="loss to reach (default: --reference's final)")
    ap.add_argument("--reference", default=REFERENCE, help="the synchronous baseline variant")
    ap.add_argument("--runs", type=path_arg, default="", help="directory of curve runs, <runs>/<variant>/ (default: <out>/runs)")
    ap.add_argument("--run", action="append", default=[], metavar="VARIANT=SRC[,SRC...]",
                    help="one variant's curve: run directories or bench.reproduce run-store entries (*.json.gz); "
                         "several (seeds of one arm) are averaged")
    ap.add_argument("--train", action="store_true", help="train the curve runs that are missing (unsimulated)")
    ap.add_argument("--steps", type=int, default=0, help="steps of a trained curve run (default: the setting's)")
    ap.add_argument("--nproc", type=int, default=4, help="ranks of trained and measured runs")
    ap.add_argument("--link", default="", help="(a): the simulated links, comma list of bench.netsim rates "
                                                "(100mbit,1gbit)")
    ap.add_argument("--nodes", type=int, default=0, help="(a): simulated nodes (bench.netsim: the ranks of a node "
                                                         "share an unlimited loopback); 0 = one namespace per rank")
    ap.add_argument("--breakdown", type=path_arg, default="", help="(a): bench.step_breakdown --out directory (default: "
                                                     "<out>/breakdown)")
    ap.add_argument("--measure", action="store_true", help="(a): run bench.step_breakdown for variants not measured")
    ap.add_argument("--measure-steps", type=int, default=10, help="(a): measured steps per run (DiLoCo: whole cycles)")
    ap.add_argument("--warmup", type=int, default=3, help="(a): warm-up steps dropped from a measured run")
    ap.add_argument("--e2e", type=path_arg, default="", help="(a): runs trained end to end under the simulator at --link, "
                                              "<e2e>/<variant>/, to check the construction against")
    ap.add_argument("--train-e2e", action="store_true", help="(a): train the --e2e runs that are missing, under "
                                                             "bench.netsim at --link (needs root)")
    ap.add_argument("--cluster", action="append", default=[],
                    help='(b), repeatable: e.g. "nodes=2 gpus_per_node=8 gpu=h100 inter=10gbit intra=nvlink '
                         '[mfu=0.35|gpu-check] [inter_latency=30us]"')
    ap.add_argument("--vocab-size", type=int, default=0, help="(b): the runs' vocabulary where their dataset is "
                                                              "not on this machine (study-prose: 8192)")
    ap.add_argument("--out", type=path_arg, default="bench/out/time_to_loss")
    ns = ap.parse_args(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)
    ns.links = [x for x in ns.link.split(",") if x]

    def resolve(v: str) -> str:
        path = ROOT / "configs" / "variants" / f"{v}.yaml"
        if not path.is_file():
            names = sorted(p.stem for p in (ROOT / "configs" / "variants").glob("*.yaml"))
            ap.error(f"--variants {v}: no configs/variants/{v}.yaml; one of {', '.join(names)}, or a config file")
        return str(path.relative_to(ROOT))

    try:
        ns.candidates, ns.own_overrides = variant_specs(ns, resolve)
        ns.cluster_specs = [parse_cluster(c) for c in ns.cluster]
        from bench.netsim import parse_rate

        for link in ns.links:
            try:
                parse_rate(link)
            except ValueError as e:
                raise ValueError(f"--link {link}: {e}") from None
        ns.setting_overrides, ns.setting_steps, ns.evals = setting_overrides(ns.setting, ns.lr)
    except ValueError as e:
        ap.error(str(e))
    if not ns.candidates:
        ap.error("--variants: name at least one variant (configs/variants name or a config file)")
    if (ns.e2e or ns.train_e2e or ns.measure) and not ns.links:
        ap.error("--e2e, --train-e2e and --measure are about the simulated link: give --link RATE too")
    if ns.e2e and len(ns.links) != 1:
        ap.error(f"--e2e checks one link; give one --link, not {ns.link}")
    if ns.nodes and (ns.nodes < 1 or ns.nproc % ns.nodes):
        ap.error(f"--nodes {ns.nodes} must divide --nproc {ns.nproc}")
    if ns.train_e2e and not ns.e2e:
        ap.error("--train-e2e: give --e2e DIR (where the end-to-end runs go)")
    if not ns.links and not ns.cluster:
        ap.error("nothing to report: give --link RATE (measured under the simulator) and/or --cluster \"...\" "
                 "(predicted)")
    ns.given = {}
    names = [n for n, _ in ns.candidates]
    for r in ns.run:
        # a candidate's name may hold '=' (name@key=value): the longest name the entry starts with
        name = max((n for n in names if r.startswith(n + "=")), key=len, default=None)
        if name is None:
            ap.error(f"--run {r}: expected VARIANT=SRC with VARIANT one of --variants ({', '.join(names)})"
                     if "=" in r else f"--run {r}: expected VARIANT=SRC")
        if name in ns.given:
            ap.error(f"--run {name}: given twice; give one --run per variant (several sources comma-separated)")
        ns.given[name] = r[len(name) + 1:]
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    out = Path(ns.out)
    runs = Path(ns.runs) if ns.runs else out / "runs"
    given = ns.given
    overrides = list(runstore.merge_overrides(ns.setting_overrides, ns.overrides))   # yours replace the setting's
    sources = {}
    steps = ns.steps or ns.setting_steps
    try:
        if ns.target is None and ns.reference not in dict(ns.candidates):  # before any training
            raise ValueError(f"no --target given and no {ns.reference} run among the variants "
                             f"({', '.join(dict(ns.candidates))}) to take it from; give --target LOSS or "
                             f"--reference VARIANT")
        for name, files in ns.candidates:  # a misspelt override is refused here, not by the ranks (or never),
            try:                            # at the length and evaluations --train would run it with
                load_config([f if Path(f).is_absolute() or Path(f).is_file() else ROOT / f for f in files],
                            [*overrides, *ns.own_overrides.get(name, []), *_curve_settings(steps, ns.evals, runs / name)])
            except ConfigError as e:
                raise ValueError(f"{name}: {' '.join(str(e).split())}") from None
        foreign = [f for f in ("results.md", "results.csv", "time_to_loss.png", "meta.json", "end_to_end.csv")
                   if (out / f).exists()]
        if foreign and not _ours(out):
            raise ValueError(f"--out {shown(out)} holds {', '.join(foreign)} that this command did not write (no "
                             f"meta.json of its own beside them); choose another --out")

        def train_or_reuse(name, files, mine, run_dir, flag, **how):
            if not (run_dir / "metrics.jsonl").is_file():
                train_curve(name, files, mine, run_dir, ns.nproc, steps, ns.evals, **how)
            elif bad := curve_run_mismatch(files, mine, run_dir, steps, ns.evals):  # not silently another run
                if bad.startswith(LR_KEYS) and ns.lr != "setting":
                    bad += "; a run trained at the setting's shared lr is read with --lr setting"
                raise ValueError(f"{flag}: {run_dir} holds a run of another config ({bad}); delete it to train "
                                 f"{name} again there, or point {'--runs (or --out)' if flag == '--train' else '--e2e'} "
                                 f"elsewhere")

        for name, files in ns.candidates:
            mine = [*overrides, *ns.own_overrides.get(name, [])]  # a name@key=value entry's own last
            src = given[name].split(",") if name in given else [runs / name]
            if name not in given and ns.train:
                train_or_reuse(name, files, mine, runs / name, "--train")
            sources[name] = src
            e2e = Path(ns.e2e) / name if ns.e2e else None
            if e2e is not None and ns.train_e2e:
                train_or_reuse(name, files, mine, e2e, "--train-e2e", link=ns.links[0], nodes=ns.nodes)
        curves = {n: load_curve(n, src, ns.metric) for n, src in sources.items()}
        target, target_src = ((ns.target, "given (--target)") if ns.target is not None
                              else default_target(curves, ns.reference, ns.metric))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"python -m bench.time_to_loss: error: {e}", file=sys.stderr)
        return 2
    step_times: dict[str, dict[str, dict]] = {}
    settings: dict[str, str] = {}
    bd = Path(ns.breakdown) if ns.breakdown else out / "breakdown"
    where = f"{ns.nproc} ranks" + (f" on {ns.nodes} simulated nodes" if ns.nodes else ", one namespace each")
    # the variant file's name plus @key=value for what the curve's runs changed (a name@key=value entry's own too)
    own = {n: measured_name(base_variant(n), files, overrides, curves[n]) for n, files in ns.candidates}
    for link in ns.links:
        # a run under the variant's bare name that trained the curve's step serves; else the curve's own
        as_name = {n: n if "step_s" in measured_step(c, bd, link, ns.warmup) else own[n] for n, c in curves.items()}
        missing = [n for n in curves if "step_s" not in measured_step(curves[n], bd, link, ns.warmup, as_name[n])]
        # bench.step_breakdown runs variants by name (configs/variants/<name>.yaml) with overrides only
        odd = [n for n, files in ns.candidates
               if n in missing and files != [f"configs/variants/{base_variant(n)}.yaml"]]
        if odd and ns.measure:
            print(f"   --measure: {', '.join(odd)} are not a bare configs/variants file; measure them with "
                  f"bench.step_breakdown yourself and pass --breakdown", flush=True)
        missing = [n for n in missing if n not in odd]
        if missing and ns.measure:
            from bench.step_breakdown import cycle_steps

            cycle = math.lcm(*(cycle_steps(curves[n].config) for n in missing))  # DiLoCo: whole cycles
            measure_steps([as_name[n] for n in missing], [*schedule_of(curves[n] for n in missing), *overrides],
                          link, bd, ns.nproc, -(-ns.measure_steps // cycle) * cycle, ns.warmup, ns.nodes)
        key = f"(a) this machine, simulated link {link}"
        step_times[key] = {n: measured_step(c, bd, link, ns.warmup, as_name[n]) for n, c in curves.items()}
        for n in odd:  # the row says why --measure left it, not that --measure would run it
            if "missing" in step_times[key][n]:
                step_times[key][n] = {"missing": f"not measured: {', '.join(dict(ns.candidates)[n])} is not a bare "
                                                 f"configs/variants file, which bench.step_breakdown runs by name; "
                                                 f"measure it yourself and pass --breakdown"}
        settings[key] = (f"Step times MEASURED: each variant trained under bench.netsim at {link} ({where}) by "
                         f"bench.step_breakdown ({shown(bd)}); loss against step from the unsimulated runs (MEASURED).")
    for cl in ns.cluster_specs:
        key = f"(b) cluster {cl.text}"
        by = {}
        for n, c in curves.items():
            try:
                by[n] = predict_cluster_step(c, cl, ns.reference, ns.vocab_size)
                by[n]["how"] = f"predicted: MFU {by[n]['mfu']:.3f} ({by[n]['mfu_source']}); comm {by[n]['comm_how']}"
            except ValueError as e:
                by[n] = {"missing": str(e)}
        step_times[key] = by
        a, b = cl.world_link()
        settings[key] = (f"Step times PREDICTED for {cl.ranks} GPUs: compute = FLOPs per step / ({cl.ranks} x "
                         f"{cl.gpu} dense bf16 peak x MFU), communication = the registry's alpha-beta model at "
                         f"alpha {a * 1e6:.0f} us, {1 / b / 1e9:.3g} Gbit/s per ring hop"
                         f"{' (assumed latency)' if 'latency' not in cl.text else ''}. The loss curves are the "
                         f"runs' (MEASURED at their own world size and global batch, kept on the cluster); methods "
                         f"whose numerics depend on the worker count (votes, DiLoCo) may train differently at "
                         f"{cl.ranks} workers. At parallel.shard_size = S > 1 (local-update schemes only) the "
                         f"workers are the {cl.ranks} / S replicas, each rank exchanging its shards of the model "
                         f"with its peers on the other nodes (the S rings share each node's port), and FSDP's "
                         f"traffic inside each node's shard groups is added, booked exposed (an upper bound).")
    rows = report_rows(curves, target, step_times, ns.reference)
    check = ([], {})
    if ns.e2e:
        check = end_to_end(curves, Path(ns.e2e), ns.metric, target,
                           step_times[f"(a) this machine, simulated link {ns.links[0]}"])
    write_outputs(out, rows, curves, step_times, settings, target, target_src, ns, check)
    print((out / "results.md").read_text())
    return 0


def _ours(out: Path) -> bool:
    """`out` holds this command's report (its meta.json, with the command line it ran), which a run replaces."""
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "argv" in meta and "target" in meta


def write_outputs(out: Path, rows: list[dict], curves: dict[str, Curve], step_times: dict, settings: dict,
                  target: float, target_src: str, ns, check: tuple[list[dict], dict] = ([], {})) -> None:
    from bench.plot import plot_time_to_loss

    out.mkdir(parents=True, exist_ok=True)
    cols = ["setting", "variant", "final_loss", "steps", "step_s", "comm_s", "target_step", "target_s", "speedup",
            "total_s", "budget_s", "budget_step", "budget_loss", "how", "missing", "compute_s", "mfu",
            "bytes_per_step", "peak_step_bytes", "fsdp_bytes_per_step"]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    yours = f"; yours on top: `{' '.join(ns.overrides)}`" if ns.overrides else ""
    # the setting shapes only what this command trains or measures (--train, --train-e2e, --measure)
    used = ns.train or ns.train_e2e or ns.measure
    setting = (f"Setting `{ns.setting}` (the overrides of the runs this command trains or measures){yours}. "
               if used else "No run trained or measured by this command (its --setting and overrides are unused). ")
    md = ["# Time to loss", "", f"{setting}Curves (MEASURED, unsimulated; the mean of a variant's runs where it "
          f"has several) from:", "",
          *[f"- {n} ({c.runs} run{'s' if c.runs > 1 else ''}, {curve_setup(c)}): {c.source}" for n, c in curves.items()],
          *setup_differences(curves), "", markdown(rows, settings, target, target_src, ns.metric)]
    panels = curve_panels(curves, step_times)
    if check[0]:
        md.append(end_to_end_markdown(check[0], ns.links[0], ns.metric))
        panels[f"(a) end to end under the simulator at {ns.links[0]} (check)"] = check[1]
        with open(out / "end_to_end.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=sorted({k for r in check[0] for k in r}))
            w.writeheader()
            w.writerows(check[0])
    (out / "results.md").write_text("\n".join(md))
    plot_time_to_loss(panels, out / "time_to_loss.png", target, ns.metric)
    (out / "meta.json").write_text(json.dumps({
        "argv": ns.argv, "setting": ns.setting, "target": target, "target_source": target_src, "metric": ns.metric,
        "clusters": ns.cluster, "links": ns.links, "nodes": ns.nodes,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
