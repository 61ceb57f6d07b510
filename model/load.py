"""Load a trained GPT-2++ from what a run leaves behind: a run directory, one checkpoint directory,
or a Hugging Face export. Used by export, sampling and evaluation.

- run dir (`train.out_dir`): its config.yaml `model:` section and the checkpoint `ckpt/latest`
  names (or, if that pointer is missing, the newest ckpt/step_* holding model.pt).
- checkpoint dir (`ckpt/step_NNNNNN`): model.pt (or, from a sharded run, model/: DCP shards), with
  the config in meta.json.
- HF dir (config.json + safetensors, from `python -m model.export`): `model.hf.from_hf`.
The vocabulary size is read from the stored embedding (it follows the dataset's tokenizer).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .gpt import GPT, model_from_state_dict
from .presets import resolve_config


@dataclass
class Loaded:
    model: GPT
    kind: str
    """"run", "ckpt" or "hf"."""
    weights: Path
    """The file or directory the parameters came from."""
    step: int | None
    run_config: dict | None
    """The run's full resolved config (run and checkpoint dirs), None for an HF directory."""


SHARDED = "model"
"""A sharded run's checkpoint holds the model as torch.distributed.checkpoint shards in this directory."""


def _has_model(path: Path) -> bool:
    return (path / "model.pt").is_file() or (path / SHARDED / ".metadata").is_file()


def read_model_state(where: Path) -> dict[str, torch.Tensor]:
    """The model's state dict of checkpoint dir `where`: model.pt, or a sharded run's DCP shards
    gathered into whole tensors (a weight tied to the embedding is stored once)."""
    if (where / "model.pt").is_file():
        return torch.load(where / "model.pt", map_location="cpu", weights_only=True)
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(where / SHARDED, Path(tmp) / "model.pt")
        state = torch.load(Path(tmp) / "model.pt", map_location="cpu", weights_only=True)
    return state.get("model", state)


def _checkpoint_of_run(run_dir: Path) -> Path:
    ckpt_root = run_dir / "ckpt"
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        path = ckpt_root / pointer.read_text().strip()
        if _has_model(path):
            return path
    steps = sorted((p for p in ckpt_root.glob("step_*") if p.name[5:].isdigit() and _has_model(p)),
                   key=lambda p: int(p.name[5:]))
    if not steps:
        raise FileNotFoundError(f"run dir {run_dir} has no checkpoint (no {ckpt_root}/latest and no "
                                f"step_*/model.pt); train with train.ckpt_every > 0 or until the end")
    return steps[-1]


def locate(path: str | os.PathLike) -> tuple[str, Path, dict | None]:
    """(kind, checkpoint or HF dir, the run's config) for a run, checkpoint or HF directory."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{p} is not a directory; give a run dir (train.out_dir), a checkpoint dir "
                                f"(RUN/ckpt/step_NNNNNN) or a Hugging Face export dir")
    if _has_model(p) and (p / "meta.json").is_file():
        return "ckpt", p, json.loads((p / "meta.json").read_text()).get("config")
    if (p / "config.yaml").is_file() and (p / "ckpt").is_dir():
        import yaml
        return "run", _checkpoint_of_run(p), yaml.safe_load((p / "config.yaml").read_text())
    if (p / "config.json").is_file():
        return "hf", p, None
    raise FileNotFoundError(f"{p} is neither a run dir (config.yaml + ckpt/), a checkpoint dir (model.pt + "
                            f"meta.json) nor a Hugging Face dir (config.json)")


def _strip_prefixes(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # torch.compile and DDP wrappers prefix names; a state dict saved through one still loads
    out = {}
    for k, v in sd.items():
        for prefix in ("_orig_mod.", "module."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu") -> Loaded:
    """The trained model of a run, checkpoint or HF directory, in eval mode on `device`."""
    kind, where, run_config = locate(path)
    if kind == "hf":
        from .hf import from_hf
        model = from_hf(where, device=device)
        return Loaded(model.eval(), kind, where, None, None)
    if not run_config or "model" not in run_config:
        raise ValueError(f"{where}: the run config has no model section; cannot rebuild the model")
    sd = _strip_prefixes(read_model_state(where))
    if "transformer.wte.weight" not in sd:
        raise ValueError(f"{where / 'model.pt'} holds no transformer.wte.weight; not a GPT-2++ state dict")
    vocab = sd["transformer.wte.weight"].shape[0]
    cfg = dataclasses.replace(resolve_config(run_config["model"]), vocab_size=vocab)
    if cfg.tie_embeddings:
        sd.setdefault("lm_head.weight", sd["transformer.wte.weight"])
    model = model_from_state_dict(cfg, sd, device)
    step = int(where.name[5:]) if where.name.startswith("step_") and where.name[5:].isdigit() else None
    return Loaded(model.eval(), kind, where / "model.pt" if (where / "model.pt").is_file() else where / SHARDED,
                  step, run_config)
