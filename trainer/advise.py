"""Measure the network and the model, predict every candidate's step time, rank them: the core of
comm.mode=auto (trainer/automode.py) and of the `python -m bench.advise` table.

Under the launcher the run would use (same ranks, same links), in seconds:
1. Links: per axis (the whole world; with several nodes also inside a node and across nodes) an
   fp32 allreduce sweep fitted to the ring model (comm.cost_model: alpha, beta), and all-to-all /
   all-gather at the largest size against their own alpha-beta rows (ratio measured / model).
2. Compute: forward + backward of the configured model and batch (micro-batches x grad_accum,
   bf16 autocast on CUDA as the trainer does), median of a few steps after one warm-up.
3. Local optimizer work per candidate: its real optimizer (same parameters, same layout, same
   kernels, built by trainer.optimizer as the trainer builds it) stepped on a *fake* process group
   of the same world size, whose collectives move nothing and return at once: what remains is the
   arithmetic, quantize / pack and unpack / vote at the real P, measured without the network.
4. Prediction: step = compute + local + the candidate's own alpha-beta communication model
   (`CommOptimizer.predict_comm_seconds`, each scheme's formula from the optim.sync registry) at
   the world axis's alpha and beta; on several nodes under comm.cost_model.NodeLayout, which
   corrects the collectives that cross the nodes' ports differently from a ring (predict_comm);
   bytes per step from the same registry (`wire_bytes_per_step`); a candidate's comm.momentum_sync adds
   its fp32 allreduce of the selected momenta averaged over its interval (momentum_sync_per_step). A
   local-update scheme (DiLoCo)
   predicts itself on the model's parameters (LocalScheme.predict_local: its cycle's exchanges per
   inner step, less what the following inner steps hide; predict_candidate_comm).
The table ranks candidates by predicted step time, with the speedup over the fp32 baseline and the
quality evidence for each: the paired final-validation-loss difference against its reference in the
committed tables of the study-prose reproduction setting, which trainer/auto_quality.yaml points at
(with its rule: ablations, variants without evidence or measured worse beyond noise are out of auto
unless comm.auto_allow names them). Auto leaves fp32 only for a predicted gain above
comm.auto_min_gain (pick). Candidates are the named variants (configs/variants) merged over the
user's config.
"""
from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import yaml

import data
from comm import Clock, all_gather_single, cost_model
from model import GPT, resolve_config

from .config import (CommConfig, ConfigError, OptimConfig, _merge, load_config, parse_overrides, read_yaml,
                     validate)
from .comm_prediction import (momentum_sync_per_step, node_layout, param_layout, predict_candidate_comm,  # noqa: F401
                              predict_comm)
from .optimizer import build_run_optimizer
from .param_groups import param_groups

ROOT = Path(__file__).resolve().parent.parent
VARIANTS_DIR = ROOT / "configs" / "variants"
QUALITY_FILE = Path(__file__).resolve().with_name("auto_quality.yaml")  # what auto trusts, and the rule
BASELINE = "lion_fp32"
LINK_SIZES = (1 << 14, 1 << 18, 1 << 20, 1 << 22)  # bytes: 16 KB .. 4 MB (seconds, not minutes)


# ------------------------------------------------------------------------------------------------
# candidates: the named variants (configs/variants), merged over the user's config
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Candidate:
    name: str                 # variant name (configs/variants/<name>.yaml) or "<optimizer>+<mode>"
    sections: dict            # {"optim": {...}, "comm": {...}} that replace the user's optimizer / mode


def variant_names(directory: Path = VARIANTS_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml"))


def load_variant(name: str, directory: Path = VARIANTS_DIR) -> Candidate:
    """A configs/variants preset's optimizer and mode. `name@section.key=value@...` (bench.step_breakdown's
    syntax) sets optim / comm keys on top of the preset, e.g. `dion@optim.rank_fraction=0.0625`; the
    candidate keeps the whole string as its name. ValueError / ConfigError naming a bad entry."""
    base, *extra = name.split("@")
    path = directory / f"{base}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown variant {base!r}; valid: {', '.join(variant_names(directory))}")
    doc = read_yaml(path)
    sections = {k: dict(doc.get(k) or {}) for k in ("optim", "comm")}
    try:
        over = parse_overrides(extra)
    except ConfigError as e:
        raise ValueError(f"variant {name!r}: {e}") from None
    other = sorted(set(over) - set(sections))
    if other:
        raise ValueError(f"variant {name!r}: {other[0]}.* is not an optimizer or mode key; a candidate sets optim "
                         f"and comm only (give model, data and parallel settings as overrides of the run)")
    for section, keys in over.items():
        sections[section] = _merge(sections[section], keys)
    return Candidate(name, sections)


def _common_keys(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.name != "options"}


def candidate_config(user: dict, cand: Candidate) -> dict:
    """The user's resolved config with the optimizer and mode of `cand`. The comm section: the user's
    keys common to every mode (kernels, timeouts, ...) kept, the previous mode's own options dropped (they
    may not exist in the new one), the candidate's keys applied. The optim section, where the candidate
    runs the user's optimizer (every comm.mode=auto candidate does): the user's training recipe stays
    (the keys common to every optimizer: lr, betas, weight decay, lr multipliers, schedule, clipping,
    and the user's own options of that optimizer), and only the candidate's options of the optimizer
    (e.g. Dion's rank_fraction) are applied; a variant file's recipe (adamw_fp32.yaml's lr 6e-4) never
    replaces the user's. Where the candidate runs another optimizer (bench.advise comparing optimizers),
    that optimizer's section is the candidate's, over the user's common keys it does not set.
    `replaced_keys` names what the candidate changed."""
    out = copy.deepcopy(user)
    for section, cls in (("optim", OptimConfig), ("comm", CommConfig)):
        common = _common_keys(cls)
        mine = user.get(section) or {}
        keep = {k: v for k, v in mine.items() if k in common}
        over = cand.sections.get(section) or {}
        flat = {k: v for k, v in over.items() if not isinstance(v, dict)}
        if section == "optim" and flat.get("name", mine.get("name")) == mine.get("name"):
            merged = {**mine, **{k: v for k, v in flat.items() if k not in common}}
        else:
            merged = {**keep, **flat}
        for k, v in over.items():  # nested sections (comm.momentum_sync) merge key by key
            if isinstance(v, dict):
                merged[k] = {**(keep.get(k) or {}), **v}
        out[section] = merged
    return out


def replaced_keys(user: dict, chosen: dict, section: str = "optim") -> list[str]:
    """`section.key: old -> new` for every key of the user's `section` that `chosen` (candidate_config's
    result, resolved) holds with another value: what a candidate changed of the user's settings."""
    mine, now = user.get(section) or {}, chosen.get(section) or {}
    return [f"{section}.{k}: {mine[k]!r} -> {now[k]!r}" for k in mine if k in now and now[k] != mine[k]]


def config_from_dict(d: dict):
    """A Config from a plain dict (the config loader's own parsing and checks)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(d, f)
        path = f.name
    try:
        return load_config(path)
    finally:
        os.unlink(path)


# ------------------------------------------------------------------------------------------------
# measurements (collective: every rank calls them with the same arguments)
# ------------------------------------------------------------------------------------------------

def _time_collective(kind: str, nbytes: int, group, device: torch.device, repeats: int) -> float:
    """Min over `repeats` calls (each after a barrier; a call's time is its slowest rank's) of one
    `kind` collective moving `nbytes` per rank: allreduce of nbytes, all-to-all of nbytes, or an
    all-gather whose output is nbytes."""
    P = dist.get_world_size(group)
    n = max(P, nbytes // 4 // P * P)
    x = torch.ones(n, dtype=torch.float32, device=device)
    out = torch.empty_like(x)

    def call():
        if kind == "allreduce":
            dist.all_reduce(x, group=group)
        elif kind == "all_to_all":
            dist.all_to_all_single(out, x, group=group)
        elif kind == "all_gather":
            all_gather_single(out, x[: n // P], group=group)
        else:
            raise ValueError(kind)

    call()  # warm-up: connections, allocation
    times = torch.empty(repeats, dtype=torch.float64)
    for r in range(repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[r] = time.perf_counter() - t0
    times = times.to(device)  # NCCL reduces device tensors only
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return float(times.min())


def measure_link(group, device: torch.device, sizes: Sequence[int] = LINK_SIZES, repeats: int = 3,
                 node_size: int = 1) -> dict:
    """alpha [s] and beta [s/bit] of one axis from an fp32 allreduce sweep (comm.cost_model's fit),
    then all-to-all and all-gather at the largest size against their alpha-beta rows: the model
    the predictions use (with node_size > 1 ranks per node, comm.cost_model.NodeLayout's) and the
    one flat network's (model_flat_s)."""
    P = dist.get_world_size(group)
    if P == 1:
        return {"P": 1, "alpha_s": 0.0, "beta_s_per_bit": 0.0, "gbit_s": math.inf, "checks": {}}
    nbytes = [max(P, s // 4 // P * P) * 4 for s in sizes]
    seconds = [_time_collective("allreduce", s, group, device, repeats) for s in nbytes]
    alpha, beta = cost_model.fit_alpha_beta(P, nbytes, seconds)
    big = nbytes[-1]
    layout = cost_model.NodeLayout(P, node_size) if node_size > 1 else None
    checks = {}
    for kind, model in (("allreduce", cost_model.allreduce_time), ("all_to_all", cost_model.all_to_all_time),
                        ("all_gather", cost_model.all_gather_time)):
        t = seconds[-1] if kind == "allreduce" else _time_collective(kind, big, group, device, repeats)
        with cost_model.node_layout(layout):
            m = model(P, 8 * big, alpha, beta)
        checks[kind] = {"measured_s": t, "model_s": m, "measured_over_model": t / m if m > 0 else None,
                        "model_flat_s": model(P, 8 * big, alpha, beta)}
    return {"P": P, "alpha_s": alpha, "beta_s_per_bit": beta, "gbit_s": (1 / beta / 1e9) if beta > 0 else math.inf,
            "node_size": node_size, "sizes": nbytes, "allreduce_s": seconds, "checks": checks}


def launcher_node_size(P: int) -> int:
    """Ranks per node from the launcher (LOCAL_WORLD_SIZE) when the P ranks span several nodes of
    that size, else 1 (one node, or a layout that is not contiguous equal nodes)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", P))
    return local if 1 < local < P and P % local == 0 else 1


def link_axes() -> dict:
    """The groups whose links a run uses: the world; with several nodes (LOCAL_WORLD_SIZE < world)
    also the ranks of one node and one rank per node (collective: every rank creates every group)."""
    P = dist.get_world_size()
    local = launcher_node_size(P)
    axes = {"world": None}
    if local > 1:
        nodes = P // local
        rank = dist.get_rank()
        for i in range(nodes):
            g = dist.new_group(list(range(i * local, (i + 1) * local)))
            if rank // local == i:
                axes["intra-node"] = g
        for j in range(local):
            g = dist.new_group(list(range(j, P, local)))
            if rank % local == j:
                axes["inter-node"] = g
    return axes


def measure_links(device: torch.device, sizes: Sequence[int] = LINK_SIZES) -> dict:
    """measure_link on every axis of link_axes (collective); the world's checks on several nodes
    against the node layout's model."""
    local = launcher_node_size(dist.get_world_size())
    return {name: measure_link(g, device, sizes, node_size=local if name == "world" else 1)
            for name, g in link_axes().items()}


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest value over the ranks (a step is done when its slowest rank is): every rank then
    predicts, ranks and picks with the same numbers."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def build_model(cfg, data_dir, device: torch.device):
    torch.manual_seed(cfg.train.seed)
    model_cfg = resolve_config(vars(cfg.model), vocab_size=data.dataset_vocab_size(data_dir))
    return GPT(model_cfg).to(device)


def _autocast(cfg, device):
    return (torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda" and cfg.train.dtype == "bfloat16" else contextlib.nullcontext())


def measure_compute(cfg, model, device: torch.device, steps: int = 3) -> dict:
    """Seconds of one step's forward + backward (grad_accum micro-batches of random tokens), median
    of `steps` after one warm-up step (and after compiling, when train.compile is set)."""
    d = cfg.data
    forward = model
    compile_s = 0.0
    if cfg.train.compile:
        forward = torch.compile(model)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (d.batch_size, d.seq_len), generator=g).to(device)
    y = torch.randint(0, vocab, (d.batch_size, d.seq_len), generator=g).to(device)
    clock = Clock(device)

    def one() -> float:
        t0 = clock.now()
        for _ in range(d.grad_accum):
            with _autocast(cfg, device):
                _, loss = forward(x, y)
            (loss / d.grad_accum).backward()
        return clock.now() - t0

    first = one()
    if cfg.train.compile:
        compile_s = first
    times = [one() for _ in range(steps)]
    model.zero_grad(set_to_none=True)
    return {"fwdbwd_s": _slowest(statistics.median(times), device), "compile_s": compile_s}


_FAKE = None


def fake_group():
    """A process group of the world's size whose collectives move nothing and return at once
    (torch's 'fake' backend), so an optimizer's local work at the real P can be timed without the
    network. Collective to create (every rank calls it)."""
    global _FAKE
    if _FAKE is None:
        try:  # registers the 'fake' backend with torch.distributed
            import torch.testing._internal.distributed.fake_pg  # noqa: F401
        except ImportError as e:
            raise RuntimeError(f"this torch ({torch.__version__}) has no fake process group backend, which "
                               f"comm.mode=auto needs to time optimizers without the network: {e}") from None
        _FAKE = dist.new_group(list(range(dist.get_world_size())), backend="fake")
    return _FAKE


def build_candidate_optimizer(cfg, model, group):
    """cfg's optimizer over `model` on `group`, as the trainer builds it, without fine timing or
    overlap (a measurement of the local work, step by step)."""
    return build_run_optimizer(cfg, param_groups(model, cfg.optim), list(model.parameters()), group=group,
                               fine_timing=False, overlap=False)


def measure_local(cfg, model, device: torch.device, steps: int = 3) -> dict:
    """Seconds of one optimizer step of cfg's optimizer with every collective removed (fake group
    of the same world size): median of `steps` after one warm-up step (kernels compiled first)."""
    params = [p for p in model.parameters()]
    saved = [p.detach().clone() for p in params]
    opt = build_candidate_optimizer(cfg, model, fake_group())
    compile_s = opt.warmup()
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g).to(device=device, dtype=p.dtype) * 1e-3 for p in params]
    clock = Clock(device)
    times = []
    for k in range(steps + 1):
        for p, gr in zip(params, grads):
            if p.grad is None:
                p.grad = gr.clone()
            else:
                p.grad.copy_(gr)
        t0 = clock.now()
        opt.step(loss_finite=True)
        t = clock.now() - t0
        if k:
            times.append(t)
    with torch.no_grad():  # the fake exchange left garbage in the parameters: restore them
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
    return {"local_s": _slowest(statistics.median(times), device), "kernels_compile_s": compile_s,
            "predictor": opt}


# ------------------------------------------------------------------------------------------------
# quality evidence: which variants auto may trust (trainer/auto_quality.yaml states the rule)
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Verdict:
    allowed: bool             # may comm.mode=auto choose it
    evidence: str             # the evidence, and when not allowed, why it is out
    reference: bool = False   # an optimizer's own fp32 run: the baseline


def _study_rows(results: Path, study: str, key: str, arm: str) -> list[dict]:
    path = results / f"{study}.csv"
    if not path.is_file():
        return []
    return [r for r in csv.DictReader(path.open()) if r.get(key) == arm and r.get("status", "ok") == "ok"]


def quality_verdicts(names: Sequence[str], named: Sequence[str] = (), path: Path = QUALITY_FILE) -> dict[str, Verdict]:
    """variant -> Verdict from the committed study tables the evidence file points at: out when it is
    an ablation, has no evidence, has fewer than 2 seeds, or is measured worse than its reference
    beyond noise (paired mean - k_se standard errors > 0); a variant in `named` (comm.auto_allow
    names it) is allowed whatever its evidence says, and the evidence says so."""
    try:
        doc = read_yaml(path)
        setting, results, k = doc["setting"], ROOT / doc["results"], float(doc["k_se"])
        entries = doc["variants"]
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"comm.mode=auto: quality evidence file {path} is unreadable or lacks "
                          f"setting / results / k_se / variants ({e}); restore it from the repository") from None
    out = {}
    for name in names:
        e = entries.get(name) or {}
        rows = _study_rows(results, e["study"], e["key"], e["arm"]) if e.get("study") else []
        where = f"{setting} {e.get('study')}"
        if e.get("reference"):
            v = Verdict(True, f"reference ({where}: val {float(rows[0]['val_loss_mean']):.3f}, "
                              f"{rows[0]['val_loss_n']} seeds)" if rows else f"reference (fp32; {setting})",
                        reference=True)
        elif not rows:
            v = Verdict(False, f"no quality evidence (none in {setting})")
        else:
            d = e["delta"]
            means = [float(r[f"{d}_mean"]) for r in rows]
            stds = [float(r[f"{d}_std"]) if r.get(f"{d}_std") else math.nan for r in rows]
            seeds = [int(float(r["val_loss_n"])) for r in rows]
            if len(rows) == 1:
                text = f"val {means[0]:+.3f}" + (f" ± {stds[0]:.3f} std" if seeds[0] > 1 else "")
            else:
                text = f"val {min(means):+.2f} .. {max(means):+.2f} over {len(rows)} settings"
            text += f" vs {e['against']} ({min(seeds)} seed{'s' if min(seeds) > 1 else ''}, {where})"
            worse = [m - k * s / math.sqrt(n) for m, s, n in zip(means, stds, seeds) if n > 1]
            if e.get("ablation"):
                v = Verdict(False, f"{text}; out: ablation, {e['ablation']}")
            elif min(seeds) < 2:
                v = Verdict(False, f"{text}; out: one seed, no noise estimate")
            elif max(worse) > 0:
                v = Verdict(False, f"{text}; out: worse beyond noise (mean - {k:g} s.e. = {max(worse):+.3f} > 0)")
            else:
                v = Verdict(True, text)
        if not v.allowed and name in named:
            v = Verdict(True, f"{v.evidence.split('; out: ')[0]}; allowed by you (comm.auto_allow)")
        out[name] = v
    return out


def pick(result: dict, min_gain: float) -> tuple[dict, str]:
    """(the row comm.mode=auto runs, the reason): the fastest allowed row when its predicted step time
    is more than min_gain faster than the fp32 baseline's, else the baseline. Rows: advise()'s."""
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    best = ok[0]  # rows are sorted by predicted step time
    base = next((r for r in ok if r["variant"] == result.get("baseline")), None)
    if base is None or best is base:
        return best, ("fastest predicted" if base is None else "fp32 is the fastest predicted")
    gain = base["step_s"] / best["step_s"] - 1
    if gain > min_gain:
        return best, f"predicted {gain:.0%} faster than {base['variant']}, above comm.auto_min_gain={min_gain:g}"
    return base, (f"stays on fp32: the fastest allowed, {best['variant']}, is predicted {gain:.0%} faster, "
                  f"not above comm.auto_min_gain={min_gain:g}")


# ------------------------------------------------------------------------------------------------
# the advice
# ------------------------------------------------------------------------------------------------

def advise(user_cfg, candidates: list[Candidate], device: torch.device, data_dir, *, steps: int = 3,
           link_sizes: Sequence[int] = LINK_SIZES, log=print, exclude: bool = False,
           named: Sequence[str] = ()) -> dict:
    """Measure and predict (collective). Returns {"links", "compute", "rows"}; rows sorted by
    predicted step time, inadmissible candidates last with their reason. With `exclude` (auto) a
    candidate the quality evidence keeps out is not measured: its row says why (status
    "excluded"); without it every candidate is measured and its evidence says whether auto may
    choose it. `named`: the variants comm.auto_allow names (allowed whatever their evidence)."""
    P = dist.get_world_size()
    t0 = time.perf_counter()
    links = measure_links(device, link_sizes)
    if P == 1:
        log("advise: one rank: no link to measure, so every candidate's communication is 0 and the ranking is by "
            "compute and local work alone, not what your cluster will see; run it at the run's world size "
            "(torchrun --nproc_per_node=N; python -m bench.netsim for a simulated link)")
    else:
        log(f"advise: links measured in {time.perf_counter() - t0:.1f} s: "
            + "; ".join(f"{k} P={v['P']} alpha {v['alpha_s'] * 1e6:.0f} us, {v['gbit_s']:.3g} Gbit/s"
                        for k, v in links.items()))
    model = build_model(user_cfg, data_dir, device)
    compute = measure_compute(user_cfg, model, device, steps)
    log(f"advise: forward+backward {compute['fwdbwd_s'] * 1e3:.1f} ms/step")
    verdicts = quality_verdicts([c.name for c in candidates], named)
    user = user_cfg.to_dict()
    rows = []
    for cand in candidates:
        row = {"variant": cand.name}
        verdict = verdicts[cand.name]
        if exclude and not verdict.allowed:
            row.update(status="excluded", reason=verdict.evidence)
            rows.append(row)
            continue
        try:
            cfg = config_from_dict(candidate_config(user, cand))
            problems = validate(cfg, world_size=P, raise_error=False)
            if problems:
                raise ConfigError("; ".join(problems))
            local = measure_local(cfg, model, device, steps)
        except (ConfigError, ValueError) as e:
            lines = [ln.strip().removeprefix("- ") for ln in str(e).splitlines() if ln.strip()]
            row.update(status="not admissible", reason="; ".join(lines[1:] if len(lines) > 1 else lines)[:300])
            rows.append(row)
            continue
        opt = local.pop("predictor")
        comm_s, sent = predict_candidate_comm(cfg, opt, links, P, model, compute["fwdbwd_s"] + local["local_s"],
                                              dist.get_rank())
        row.update(status="ok", optimizer=cfg.optim.name, mode=cfg.comm.mode,
                   options=cfg.comm.options.as_dict() if cfg.comm.options is not None else {},
                   compute_s=compute["fwdbwd_s"], local_s=local["local_s"], comm_s=comm_s,
                   step_s=compute["fwdbwd_s"] + local["local_s"] + comm_s, bytes_per_step=sent,
                   evidence=verdict.evidence if verdict.allowed else f"not for auto: {verdict.evidence}",
                   reference=verdict.reference)
        rows.append(row)
        del opt
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["step_s"])
    base = next((r for r in ok if r["variant"] == BASELINE), None) or next(
        (r for r in ok if r.get("reference")), None) or next((r for r in ok if r["mode"] == "fp32"), None)
    for r in ok:
        r["speedup_vs_fp32"] = base["step_s"] / r["step_s"] if base else None
    layout = node_layout(links, P)
    return {"world_size": P, "device": str(device), "links": links, "compute": compute,
            "node_size": layout.node_size if layout else 1,
            "baseline": base["variant"] if base else None,
            "rows": ok + [r for r in rows if r["status"] != "ok"]}


def table_markdown(result: dict) -> str:
    lines = ["| rank | variant | optimizer | mode | predicted step (ms) | compute | local | comm (model) | "
             "bytes/step/rank | speedup vs fp32 | quality evidence |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    k = 0
    for r in result["rows"]:
        if r["status"] != "ok":
            why = "excluded from auto" if r["status"] == "excluded" else "not admissible"
            lines.append(f"| - | {r['variant']} | | | {why}: {r['reason']} | | | | | | |")
            continue
        k += 1
        sp = r.get("speedup_vs_fp32")
        lines.append(f"| {k} | {r['variant']} | {r['optimizer']} | {r['mode']} | {1e3 * r['step_s']:.1f} | "
                     f"{1e3 * r['compute_s']:.1f} | {1e3 * r['local_s']:.1f} | {1e3 * r['comm_s']:.1f} | "
                     f"{r['bytes_per_step'] / 1e6:.3f} MB | {f'{sp:.2f}x' if sp else '-'} | {r['evidence']} |")
    return "\n".join(lines)


def links_markdown(result: dict) -> str:
    lines = ["| axis | P | alpha (us) | bandwidth (Gbit/s) | all-to-all measured / model | all-gather measured / model |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, v in result["links"].items():
        c = v.get("checks", {})
        f = (lambda k: f"{c[k]['measured_over_model']:.2f}" if k in c and c[k]["measured_over_model"] else "-")
        lines.append(f"| {name} | {v['P']} | {v['alpha_s'] * 1e6:.0f} | {v['gbit_s']:.3g} | {f('all_to_all')} | "
                     f"{f('all_gather')} |")
    return "\n".join(lines)
