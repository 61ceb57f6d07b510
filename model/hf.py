"""GPT-2++ <-> Hugging Face `LlamaForCausalLM`: parameter mapping, config.json, safetensors I/O.

GPT-2++ is a Llama-architecture model: pre-norm RMSNorm, SwiGLU MLP, rotary embeddings, no biases,
n_kv_head key/value heads (grouped-query attention when fewer than the query heads; query head i
uses key/value head i // (n_head / n_kv_head), Llama's repeat_kv). The mapping is exact:
- `attn.qkv` ((n_head + 2 n_kv_head) hd x C) is [W_q; W_k; W_v] -> q_proj, k_proj, v_proj; heads
  are consecutive rows of head_dim in both models.
- RoPE: ours rotates the two halves of each head (x1*cos - x2*sin, x1*sin + x2*cos with
  frequency base^(-2i/hd) for i < hd/2: GPT-NeoX's layout), which is exactly Llama's
  `rotate_half` with `cat(freqs, freqs)`, so q/k rows need no permutation (an interleaved-pair
  RoPE would need one; the logits test in tests/model/test_export.py pins this down).
- `mlp.fc` (2H x C) is [W_gate; W_up] (we chunk gate first) -> gate_proj, up_proj; `mlp.proj` ->
  down_proj; norm1/norm2/norm_f -> input_layernorm / post_attention_layernorm / model.norm.
- A tied head is `tie_word_embeddings: true` with no lm_head tensor stored.
The padded vocabulary (50304) stays the model's vocab_size; the learned-position variant has no
Llama equivalent and is refused.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .checkpoint_files import nonfinite_keys
from .gpt import GPT, GPTConfig, model_from_state_dict

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFFormatError(ValueError):
    """A model or directory that cannot be converted exactly (the message says why and what to do)."""


def hf_config(cfg: GPTConfig, *, bos_token_id: int | None, eos_token_id: int | None, dtype: str = "float32") -> dict:
    """config.json of the LlamaForCausalLM equal to a GPT-2++ of config `cfg`. rope_theta is written
    both the transformers 4.x way (top level) and the 5.x way (rope_parameters)."""
    if cfg.pos_emb != "rope":
        raise HFFormatError(f"pos_emb={cfg.pos_emb!r}: Llama has no learned position table, so this model "
                            f"cannot be exported as LlamaForCausalLM; train with model.pos_emb=rope to export")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,  # padded batches (generate, lm-eval) pad with the end-of-text id
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def config_from_hf(hf: dict) -> GPTConfig:
    """The GPTConfig of a Llama config.json, refusing features GPT-2++ does not have."""
    problems = []
    if hf.get("model_type") != "llama":
        problems.append(f"model_type is {hf.get('model_type')!r}, not 'llama'")
    n_head, C = hf.get("num_attention_heads"), hf.get("hidden_size")
    n_kv = hf.get("num_key_value_heads") or n_head
    if n_head and n_head % n_kv:
        problems.append(f"num_key_value_heads {n_kv} does not divide num_attention_heads {n_head}")
    if C and n_head and hf.get("head_dim", C // n_head) != C // n_head:
        problems.append(f"head_dim {hf.get('head_dim')} != hidden_size / num_attention_heads = {C // n_head}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key}=true (GPT-2++ has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf.get('hidden_act')!r} (GPT-2++ uses SwiGLU = silu)")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        problems.append(f"rope type {rope_type!r} (only plain RoPE is supported)")
    if problems:
        raise HFFormatError("cannot import this checkpoint into GPT-2++: " + "; ".join(problems))
    return GPTConfig(
        block_size=int(hf["max_position_embeddings"]), vocab_size=int(hf["vocab_size"]),
        n_layer=int(hf["num_hidden_layers"]), n_head=int(n_head), n_kv_head=int(n_kv), n_embd=int(C),
        mlp_hidden=int(hf["intermediate_size"]), pos_emb="rope",
        rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)))


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our parameters under Llama's names (fused qkv and gate/up split; a tied head stored once)."""
    cfg = model.config
    if cfg.pos_emb != "rope":
        hf_config(cfg, bos_token_id=None, eos_token_id=None)  # raises the explanation
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    C, H, kv = cfg.n_embd, cfg.mlp_hidden, cfg.n_kv_head * cfg.head_dim
    out = {"model.embed_tokens.weight": sd["transformer.wte.weight"],
           "model.norm.weight": sd["transformer.norm_f.weight"]}
    for i in range(cfg.n_layer):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        q, k, v = sd[ours + "attn.qkv.weight"].split([C, kv, kv], dim=0)
        gate, up = sd[ours + "mlp.fc.weight"].split(H, dim=0)
        out.update({
            theirs + "input_layernorm.weight": sd[ours + "norm1.weight"],
            theirs + "self_attn.q_proj.weight": q,
            theirs + "self_attn.k_proj.weight": k,
            theirs + "self_attn.v_proj.weight": v,
            theirs + "self_attn.o_proj.weight": sd[ours + "attn.proj.weight"],
            theirs + "post_attention_layernorm.weight": sd[ours + "norm2.weight"],
            theirs + "mlp.gate_proj.weight": gate,
            theirs + "mlp.up_proj.weight": up,
            theirs + "mlp.down_proj.weight": sd[ours + "mlp.proj.weight"],
        })
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state_dict(tensors: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Inverse of to_hf_state_dict: Llama names -> our state_dict (fused qkv and gate/up)."""
    missing = []

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            missing.append(name)
            return torch.empty(0)
        return tensors[name]

    sd = {"transformer.wte.weight": take("model.embed_tokens.weight"),
          "transformer.norm_f.weight": take("model.norm.weight")}
    for i in range(cfg.n_layer):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        sd[ours + "norm1.weight"] = take(theirs + "input_layernorm.weight")
        sd[ours + "attn.qkv.weight"] = torch.cat([take(theirs + f"self_attn.{p}_proj.weight") for p in "qkv"])
        sd[ours + "attn.proj.weight"] = take(theirs + "self_attn.o_proj.weight")
        sd[ours + "norm2.weight"] = take(theirs + "post_attention_layernorm.weight")
        sd[ours + "mlp.fc.weight"] = torch.cat([take(theirs + "mlp.gate_proj.weight"),
                                                take(theirs + "mlp.up_proj.weight")])
        sd[ours + "mlp.proj.weight"] = take(theirs + "mlp.down_proj.weight")
    if cfg.tie_embeddings:
        head = tensors.get("lm_head.weight")
        if head is not None and not torch.equal(head, sd["transformer.wte.weight"]):
            raise HFFormatError("tie_word_embeddings is true but lm_head.weight differs from "
                                "model.embed_tokens.weight; set tie_word_embeddings to false in config.json")
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
    else:
        sd["lm_head.weight"] = take("lm_head.weight")
    if missing:
        raise HFFormatError(f"the checkpoint lacks {len(missing)} tensor(s) a Llama of this config needs, "
                            f"e.g. {missing[:3]}")
    unused = sorted(set(tensors) - _hf_names(cfg) - {"lm_head.weight"})
    if unused:
        raise HFFormatError(f"the checkpoint holds tensors GPT-2++ has no place for, e.g. {unused[:3]}")
    return sd


def _hf_names(cfg: GPTConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(cfg.n_layer):
        names |= {f"model.layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    return names


def save_hf(model: GPT, out_dir: str | os.PathLike, *, bos_token_id: int | None, eos_token_id: int | None,
            dtype: str | None = None, max_shard_bytes: int = 4 << 30,
            generation: dict | None = None) -> list[Path]:
    """Write config.json, generation_config.json and the weights (model.safetensors, or
    model-0000k-of-0000n.safetensors + index past `max_shard_bytes`) into out_dir. dtype: the
    stored precision (default: the parameters'). Returns the files written."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_hf_state_dict(model)
    if dtype is None:
        dtype = next(k for k, v in DTYPES.items() if v == model.transformer.wte.weight.dtype)
    if dtype not in DTYPES:
        raise HFFormatError(f"dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    tensors = {k: v.to(device="cpu", dtype=DTYPES[dtype]).contiguous() for k, v in tensors.items()}
    config = hf_config(model.config, bos_token_id=bos_token_id, eos_token_id=eos_token_id, dtype=dtype)
    written = [out / "config.json", out / "generation_config.json"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id,
           **(generation or {})}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():  # greedy packing in parameter order
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    if len(groups) == 1:
        save_file(groups[0], str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        return written + [out / WEIGHTS_NAME]
    weight_map = {}
    for k, group in enumerate(groups, 1):
        fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
        written.append(out / fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n")
    return written + [out / WEIGHTS_INDEX]


def read_hf_tensors(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory's safetensors weights (single file or sharded with an index)."""
    from safetensors.torch import load_file

    d = Path(hf_dir)

    def read(f: Path) -> dict[str, torch.Tensor]:
        try:  # safetensors holds tensors only: nothing in it can run
            tensors = load_file(str(f))
        except Exception as e:  # noqa: BLE001 - a damaged file is one line naming it
            raise HFFormatError(f"{f} is unreadable, truncated or corrupt ({type(e).__name__}: "
                                f"{(str(e).strip().splitlines() or [''])[0][:200]})") from None
        bad = nonfinite_keys(tensors)
        if bad:
            raise HFFormatError(f"{f} holds non-finite values in {', '.join(bad[:3])}; it is damaged")
        return tensors

    if (d / WEIGHTS_NAME).is_file():
        return read(d / WEIGHTS_NAME)
    if (d / WEIGHTS_INDEX).is_file():
        try:
            files = sorted(set(json.loads((d / WEIGHTS_INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFFormatError(f"{d / WEIGHTS_INDEX} is unreadable or has no weight_map ({e})") from None
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(read(d / f))
        return out
    raise HFFormatError(f"{d} holds neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX} (only safetensors weights are "
                        f"read; re-save a .bin checkpoint with save_pretrained(..., safe_serialization=True))")


CONFIG_INT_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                   "max_position_embeddings")
CONFIG_OPTIONAL = {"num_key_value_heads": (int, type(None)), "head_dim": (int, type(None)), "model_type": str,
                   "rope_theta": float, "rms_norm_eps": float, "tie_word_embeddings": bool, "hidden_act": str,
                   "rope_parameters": (dict, type(None)), "rope_scaling": (dict, type(None))}


def is_hf_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / "config.json").is_file()


def from_hf(hf_dir: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> GPT:
    """A GPT-2++ holding the weights of a LlamaForCausalLM directory (ours or any Llama, grouped-query
    attention included, without biases or RoPE scaling), ready for fine-tuning or continued pretraining. The parameters are the
    stored ones exactly (in their stored dtype unless `dtype` is given)."""
    d = Path(hf_dir)
    if not is_hf_dir(d):
        raise HFFormatError(f"{d} has no config.json; expected a Hugging Face model directory "
                            f"(e.g. written by `python -m model.export`)")
    from util.files import FileShapeError, read_json_object

    try:  # every key config_from_hf reads, of the type it reads it as: a wrong shape is one line
        hf = read_json_object(d / "config.json", {k: int for k in CONFIG_INT_KEYS}, optional=CONFIG_OPTIONAL)
    except FileShapeError as e:
        raise HFFormatError(str(e)) from None
    cfg = config_from_hf(hf)
    sd = from_hf_state_dict(read_hf_tensors(d), cfg)
    return model_from_state_dict(cfg, sd, device, dtype)
