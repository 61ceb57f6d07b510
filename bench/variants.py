"""Shared helpers of the end-to-end benchmarks: the paper's variants, their trainer command lines,
their metrics.jsonl records, and the alpha-beta prediction of their per-step communication.

A *variant* is a preset name under configs/<size>/ (lion_fp32, lioncub_4bit, ...). The benchmarks
run `train.py configs/<size>/<variant>.yaml` with overrides, read the run's resolved config.yaml
and metrics.jsonl back, and map the resolved `comm` section onto comm.cost_model (Lion Cub
Table 1): what crosses the network in one step is one collective over the flat vector of all N
parameters (the trainer's flat gradient buffer, or the optimizer's flat c_local, Lion Cub App. D.2).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Iterable

import yaml

ROOT = Path(__file__).resolve().parents[1]

# Lion Cub Fig. 7 / Table 4 rows, plus the baselines.
DEFAULT_VARIANTS = ["lion_fp32", "lion_fp32+overlap", "adamw_fp32", "adamw_fp32+overlap", "lion_bf16", "dlion_mavo",
                    "lioncub_1bit", "lioncub_4bit", "lioncub_4bit_synchead", "lioncub_8bit_l1"]
BASELINE = "lion_fp32"
OVERLAP_BASELINE = "lion_fp32+overlap"  # what DDP users run: bucketed allreduce during backward


def config_files(variant: str, config_dir: str | Path = "configs/cpu_30m") -> list[Path]:
    """The config files of `variant` at a model size: <config_dir>/<variant>.yaml where a size keeps
    its own version of the variant, else the size file <config_dir>.yaml composed with
    configs/variants/<variant>.yaml. A clear error listing the variants when neither exists."""
    d = Path(config_dir)
    if not d.is_absolute():
        d = ROOT / d
    own = d / f"{variant}.yaml"
    if own.is_file():
        return [own]
    size, common = d.with_suffix(".yaml"), ROOT / "configs" / "variants" / f"{variant}.yaml"
    if size.is_file() and common.is_file():
        return [size, common]
    have = sorted({p.stem for p in (ROOT / "configs" / "variants").glob("*.yaml")} | {p.stem for p in d.glob("*.yaml")})
    raise ValueError(f"no config for variant {variant!r} at {d.name}: neither {own} nor {size} + {common} exist; "
                     f"variants: {', '.join(have)}" + ("" if size.is_file() else f" (no size file {size})"))



def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl (blank lines skipped; a line torn by a killed writer is
    skipped with a note on stderr)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"{path}:{n}: skipped a torn record (a run killed while writing it)", file=sys.stderr)
    return out


def train_records(records: Iterable[dict]) -> list[dict]:
    """The per-step train records (those with step_ms), in step order."""
    return sorted((r for r in records if "step_ms" in r), key=lambda r: r["step"])


def load_run_config(run_dir: str | Path) -> dict:
    """The resolved config.yaml the trainer wrote into its run directory."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the run in {run_dir} did not start (see its rank logs)")
    return yaml.safe_load(path.read_text())


def _meta_model(model_cfg: dict, vocab_size: int | None = None):
    import torch

    from model import GPT, resolve_config

    with torch.device("meta"):  # shapes only: no memory, no init time
        return GPT(resolve_config(model_cfg, vocab_size))


def num_params(model_cfg: dict) -> int:
    """Parameter count of the model a resolved `model:` section describes (= elements communicated)."""
    return sum(p.numel() for p in _meta_model(model_cfg).parameters())


def num_rows(model_cfg: dict) -> int:
    """Parameter rows (dim 0 of >= 2-D tensors, 1 per 0-/1-D tensor): the flags of mask_zero_updates."""
    return sum(p.shape[0] if p.ndim >= 2 else 1 for p in _meta_model(model_cfg).parameters())


def role_params(model_cfg: dict, vocab_size: int | None = None) -> dict[str, int]:
    """Elements per parameter role (embedding/head/attn/mlp/norm), for momentum-sync traffic; at
    `vocab_size` (a dataset's tokenizer; None = the preset's)."""
    from model import param_roles

    m = _meta_model(model_cfg, vocab_size)
    named = dict(m.named_parameters())
    out: dict[str, int] = {}
    for name, role in param_roles(m).items():
        out[role] = out.get(role, 0) + named[name].numel()
    return out


def build_optimizer_for(cfg: dict, vocab_size: int | None = None):
    """The optimizer a resolved run config builds (one process, CPU), for its byte formula and its
    alpha-beta prediction at any world size (CommOptimizer.wire_bytes_per_step / predict_comm_seconds);
    the model at `vocab_size` (a dataset's tokenizer resizes the embedding and head; None = the preset's)."""
    import torch

    from model import GPT, resolve_config
    from optim import build_optimizer
    from trainer.config import load_config
    from trainer.param_groups import param_groups

    sections = {"optim": cfg.get("optim") or {"name": "lion"}, "comm": cfg["comm"]}  # lion runs on every sign mode
    c = load_config(None, [f"{sec}.{k}={_yaml(v)}" for sec, d in sections.items() for k, v in d.items()
                           if not isinstance(v, dict)] + ["comm.momentum_sync.every=0"])
    torch.manual_seed(0)
    model = GPT(resolve_config(cfg["model"], vocab_size))
    o, cc = c.optim, c.comm
    return build_optimizer(o.name, param_groups(model, o), betas=tuple(o.betas), eps=o.eps, comm_mode=cc.mode,
                           comm_options=cc.options, optim_options=o.options, grad_clip=o.grad_clip,
                           param_order=list(model.parameters()), bucket_mb=cc.bucket_mb, overlap=cc.overlap)


def _yaml(v) -> str:
    import json

    return json.dumps(v) if not isinstance(v, str) else v


def predict_step_comm_s(cfg: dict, world: int, alpha: float, beta: float, *, sync_step: bool = False,
                        vocab_size: int | None = None) -> float:
    """Predicted seconds of communication in one training step: the optimizer's own alpha-beta
    prediction (each exchange's scheme model from the optim.sync registry, Lion Cub Table 1 formulas
    via comm.cost_model); with `sync_step`, plus the fp32 momentum allreduce of the selected layers
    that a momentum-sync step adds (Lion Cub §5)."""
    from comm import cost_model

    t = build_optimizer_for(cfg, vocab_size).predict_comm_seconds(alpha, beta, world)
    ms = cfg["comm"].get("momentum_sync") or {}
    if sync_step and ms.get("every"):
        roles = role_params(cfg["model"], vocab_size)
        layers = ms.get("layers") or []
        m = sum(v for r, v in roles.items() if "all" in layers or r in layers)
        t += cost_model.ring_allreduce(world, m, 32, alpha, beta)
    return t


def variant_args(variant: str, config_dir: str | Path = "configs/cpu_30m") -> tuple[list[Path], list[str]]:
    """A variant name -> (its config files, extra overrides). `name@section.key=value@...` adds
    overrides; `name+overlap` is `name` with DDP-style buckets overlapped with backward
    (comm.bucket_mb=25, comm.overlap=true): the baseline real users run."""
    name, *extra = variant.split("@")
    if name.endswith("+overlap"):
        name = name.removesuffix("+overlap")
        extra = ["comm.bucket_mb=25", "comm.overlap=true", *extra]
    return config_files(name, config_dir), extra


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")
