"""Load a trained GPT-2++ from what a run leaves behind: a run directory, one checkpoint directory,
or a Hugging Face export. Used by export, sampling and evaluation.

- run dir (`train.out_dir`): the checkpoint `ckpt/latest` names, or the newest intact one before
  it when that one is damaged (each skipped one is named on stderr), with the config in its
  meta.json (the run's config.yaml when meta.json has none).
- checkpoint dir (`ckpt/step_NNNNNN`): model.pt (a sharded run's: model/, DCP shards), with the
  config in meta.json.
- HF dir (config.json + safetensors, from `python -m model.export`): `model.hf.from_hf`.
Checkpoint files are read as model/checkpoint_files.py says (sha256 against meta.json,
weights_only, finite); every failure is a CheckpointError (a ValueError) of one line. The
vocabulary size is read from the stored embedding (it follows the dataset's tokenizer).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint_files import META, MODEL, CheckpointError, load_model_state, newest_intact_model
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


def locate(path: str | os.PathLike) -> tuple[str, Path]:
    """(kind, directory) of a run, checkpoint or HF directory; nothing is read yet."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{p} is not a directory; give a run dir (train.out_dir), a checkpoint dir "
                                f"(RUN/ckpt/step_NNNNNN) or a Hugging Face export dir")
    if (p / META).is_file() or (p / MODEL).is_file():
        return "ckpt", p
    if (p / "ckpt").is_dir():
        return "run", p
    if (p / "config.json").is_file():
        return "hf", p
    raise FileNotFoundError(f"{p} is neither a run dir (config.yaml + ckpt/), a checkpoint dir (model.pt + "
                            f"meta.json) nor a Hugging Face dir (config.json)")


def _report(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _strip_prefixes(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # torch.compile and DDP wrappers prefix names; a state dict saved through one still loads
    out = {}
    for k, v in sd.items():
        for prefix in ("_orig_mod.", "module."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


# A weight this large is reported (a warning, never a refusal): training moves a weight by about lr per
# step (Lion exactly lr x sign, AdamW at most a few lr), from an init of std 0.02, under weight decay.
WARN_ABS_WEIGHT = 1e3
# A weight this large is refused: 2**64 ~ 1.8e19 is the square root of float32's largest value, so its
# square is inf and an RMSNorm over an activation holding it outputs 0 or NaN (the model no longer
# depends on its input); no float32 / bf16 training reaches it without first producing an inf.
REFUSE_ABS_WEIGHT = 2.0 ** 64
PROBE_TOKENS = 16


def check_plausible(model: GPT, where: Path, report=None) -> None:
    """Refuse a model that cannot be a trained one, warn about one far outside training's range.

    The rule: (1) every parameter finite and below REFUSE_ABS_WEIGHT = 2**64 (about 1.8e19) in
    magnitude; (2) the logits of one forward pass over a fixed probe (token ids 0..15), and their
    log-softmax, all finite; otherwise CheckpointError naming `where`, the largest |weight| and its
    tensor. It cannot reject a real model: the trainer never saves a non-finite weight and stops at
    the first non-finite loss (train.on_nonfinite); a weight at or above 2**64 has a square that
    overflows float32, so the RMSNorm of any activation holding it is 0 or NaN, which training would
    have met as an inf first, and it is 16 orders of magnitude above the largest weight training
    reaches (about 1, the norm gains; see WARN_ABS_WEIGHT); and a model whose log-probabilities
    overflow on a 16-token input has a NaN loss there. (3) a |weight| above WARN_ABS_WEIGHT = 1e3 is
    only reported: large finite outliers exist in real models, so that magnitude refuses nothing."""
    report = report or _report
    name, biggest = "", 0.0
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not p.numel():
                continue
            if not bool(torch.isfinite(p).all()):
                raise CheckpointError(f"{where}: refused: parameter {n} holds NaN or inf; a trained model never "
                                      f"does, so the file is damaged or was altered; use another checkpoint")
            m = float(p.detach().abs().max())
            if m > biggest:
                name, biggest = n, m
        cfg = model.config
        t = min(PROBE_TOKENS, cfg.block_size, cfg.vocab_size)
        device = model.transformer.wte.weight.device
        logits = model.logits(torch.arange(t, device=device)[None]).float()
        # the logits and the log-probabilities a loss takes from them (huge finite logits overflow there)
        finite = bool(torch.isfinite(logits).all()) and bool(torch.isfinite(torch.log_softmax(logits, -1)).all())
    if biggest >= REFUSE_ABS_WEIGHT:
        raise CheckpointError(f"{where}: refused: {name} holds |weight| {biggest:.3g}, beyond 2**64 (~1.8e19), whose "
                              f"square overflows float32; no training reaches it (the largest trained weights are "
                              f"about 1), so the file is damaged or was altered; use another checkpoint or export")
    if not finite:
        raise CheckpointError(f"{where}: refused: its weights give non-finite logits (or log-probabilities) on a "
                              f"{t}-token probe (largest |weight| {biggest:.3g}, in {name}); a trained model never "
                              f"does, so the file is damaged or was altered; use another checkpoint or export")
    if biggest > WARN_ABS_WEIGHT:
        report(f"warning: {where}: {name} holds |weight| up to {biggest:.3g}, far above what training reaches "
               f"(below {WARN_ABS_WEIGHT:g}); check where this model came from")


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu") -> Loaded:
    """The trained model of a run, checkpoint or HF directory, in eval mode on `device`; refused when
    it cannot be a trained model (`check_plausible`)."""
    kind, where = locate(path)
    if kind == "hf":
        from .hf import from_hf
        model = from_hf(where, device=device)
        check_plausible(model.eval(), where)
        return Loaded(model.eval(), kind, where, None, None)
    if kind == "run":
        where, sd, meta = newest_intact_model(where / "ckpt", _report)
    else:
        sd, meta = load_model_state(where)
    run_config = meta.get("config")
    if not run_config and kind == "run" and (Path(path) / "config.yaml").is_file():
        import yaml

        from util.files import strict_yaml
        try:
            run_config = strict_yaml((Path(path) / "config.yaml").read_text(), Path(path) / "config.yaml")
        except yaml.YAMLError as e:
            raise ValueError(f"{Path(path) / 'config.yaml'} is not valid YAML ({' '.join(str(e).split())[:200]})") \
                from None
    if not isinstance(run_config, dict) or "model" not in run_config:
        raise ValueError(f"{where}: the run config has no model section; cannot rebuild the model")
    if not isinstance(sd, dict):
        raise CheckpointError(f"{where / MODEL} holds no state dict")
    sd = _strip_prefixes(sd)
    if "transformer.wte.weight" not in sd:
        raise ValueError(f"{where / MODEL} holds no transformer.wte.weight; not a GPT-2++ state dict")
    vocab = sd["transformer.wte.weight"].shape[0]
    cfg = dataclasses.replace(resolve_config(run_config["model"]), vocab_size=vocab)
    if cfg.tie_embeddings:  # a sharded run's checkpoint stores the tied weight once
        sd.setdefault("lm_head.weight", sd["transformer.wte.weight"])
    try:
        model = model_from_state_dict(cfg, sd, device)
    except (RuntimeError, KeyError, TypeError) as e:  # tensors of the wrong names or shapes
        why = " ".join(str(e).split()) or type(e).__name__
        raise CheckpointError(f"{where / MODEL} does not fit the model its run config describes ({why[:240]})") \
            from None
    step = int(where.name[5:]) if where.name.startswith("step_") and where.name[5:].isdigit() else None
    weights = where / (meta.get("sharded_model") or MODEL)
    check_plausible(model.eval(), weights)
    return Loaded(model.eval(), kind, weights, step, run_config)
