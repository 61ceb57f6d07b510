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
from pathlib import Path
from typing import Any, Iterable

import yaml

ROOT = Path(__file__).resolve().parents[1]

# Lion Cub Fig. 7 / Table 4 rows, plus the baselines (issue 6).
DEFAULT_VARIANTS = ["lion_fp32", "lion_bf16", "adamw_fp32", "dlion_mavo", "lioncub_1bit", "lioncub_4bit",
                    "lioncub_4bit_synchead", "lioncub_8bit_l1"]
BASELINE = "lion_fp32"


def config_path(variant: str, config_dir: str | Path = "configs/cpu_30m") -> Path:
    """configs/<size>/<variant>.yaml; a clear error listing the presets when it does not exist."""
    d = Path(config_dir)
    if not d.is_absolute():
        d = ROOT / d
    path = d / f"{variant}.yaml"
    if not path.is_file():
        have = sorted(p.stem for p in d.glob("*.yaml") if p.stem != "base") if d.is_dir() else []
        raise ValueError(f"no config for variant {variant!r}: {path} does not exist; variants in {d}: "
                         f"{', '.join(have) or '(none: wrong --config-dir?)'}")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl (blank lines skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
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


def num_params(model_cfg: dict) -> int:
    """Parameter count of the model a resolved `model:` section describes (= elements communicated)."""
    from model import GPT, get_preset

    overrides: dict[str, Any] = {"pos_emb": model_cfg.get("pos_emb", "rope")}
    if model_cfg.get("tie_embeddings") is not None:
        overrides["tie_embeddings"] = model_cfg["tie_embeddings"]
    if model_cfg.get("block_size"):
        overrides["block_size"] = model_cfg["block_size"]
    import torch

    with torch.device("meta"):  # shapes only: no memory, no init time
        m = GPT(get_preset(model_cfg["preset"], **overrides))
    return sum(p.numel() for p in m.parameters())


def role_params(model_cfg: dict) -> dict[str, int]:
    """Elements per parameter role (embedding/head/attn/mlp/norm), for momentum-sync traffic."""
    import torch

    from model import GPT, get_preset, param_roles

    overrides: dict[str, Any] = {"pos_emb": model_cfg.get("pos_emb", "rope")}
    if model_cfg.get("tie_embeddings") is not None:
        overrides["tie_embeddings"] = model_cfg["tie_embeddings"]
    with torch.device("meta"):
        m = GPT(get_preset(model_cfg["preset"], **overrides))
    named = dict(m.named_parameters())
    out: dict[str, int] = {}
    for name, role in param_roles(m).items():
        out[role] = out.get(role, 0) + named[name].numel()
    return out


def comm_kind(comm_cfg: dict) -> tuple[str, int | None]:
    """(cost_model.predict mode, lane bits) of one step's main collective for a resolved comm section."""
    mode = comm_cfg["mode"]
    if mode in ("fp32", "bf16"):
        return mode, None
    if mode == "onebit":
        return "sign_vote_1bit", None
    if mode == "pbit":
        return "int_allreduce", int(comm_cfg["bits"])
    if mode == "ps":
        return ("ps_naive" if comm_cfg.get("ps_topology", "naive") == "naive" else "ps_tree"), None
    if mode == "hierarchical":
        return "hierarchical", None
    raise ValueError(f"comm.mode={mode!r} has no cost-model mapping; known: fp32, bf16, onebit, pbit, ps, hierarchical")


def predict_step_comm_s(cfg: dict, world: int, alpha: float, beta: float, *, sync_step: bool = False) -> float:
    """Predicted seconds of communication in one training step (Lion Cub Table 1 via comm.cost_model).

    One collective over all N parameters; with `sync_step`, plus the fp32 momentum allreduce of the
    selected layers that a momentum-sync step adds (Lion Cub §5). ps modes use comm.cost_model's
    models of our packed parameter server (1 bit up; 1 bit or ceil(log2(P+1)) bits back).
    """
    from comm import cost_model

    n = num_params(cfg["model"])
    c = cfg["comm"]
    mode, bits = comm_kind(c)
    t = cost_model.predict(mode, world, n, alpha, beta, bits=bits, node_size=c.get("node_size") or 1,
                           aggregate=c.get("ps_aggregate") or "vote")
    ms = c.get("momentum_sync") or {}
    if sync_step and ms.get("every"):
        roles = role_params(cfg["model"])
        layers = ms.get("layers") or []
        m = sum(v for r, v in roles.items() if "all" in layers or r in layers)
        t += cost_model.ring_allreduce(world, m, 32, alpha, beta)
    return t


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")
