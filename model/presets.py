"""Model size presets (the GPT-2 sizes of Lion Cub App. F.2 and small CPU models for tests) and
`resolve_config`, the one translation of a config's `model:` section into a GPTConfig."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .gpt import GPTConfig

# name -> (n_layer, n_head, n_embd, block_size)
_SHAPES = {
    "debug": (2, 2, 64, 128),          # unit tests: seconds on one CPU core
    "tiny": (4, 4, 128, 256),          # default config: learns visibly in minutes on a laptop
    "cpu-30m": (6, 6, 384, 256),       # ~30M params with the GPT-2 vocab (tied)
    "study": (8, 5, 320, 256),         # the reproduction studies on the prose corpus (8192-id BPE, tied):
                                       # 12.3M params, 79 % in attention/MLP matrices; a step costs about tiny's
    "gpt2-124m": (12, 12, 768, 1024),
    "gpt2-350m": (24, 16, 1024, 1024),
    "gpt2-774m": (36, 20, 1280, 1024),
    "gpt2-1558m": (48, 25, 1600, 1024),
    "gpt-7b": (32, 32, 4096, 2048),    # the 7B class (Llama-2-7B's shape; 6.6B parameters tied): memory planning
}

PRESETS: dict[str, GPTConfig] = {
    name: GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=T) for name, (L, H, C, T) in _SHAPES.items()
}


def get_preset(name: str, **overrides) -> GPTConfig:
    """A fresh GPTConfig for preset `name`, with field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    base = PRESETS[name]
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    fields["mlp_hidden"] = 0 if "n_embd" in overrides else fields["mlp_hidden"]  # derived: recompute
    fields["n_kv_head"] = 0 if "n_head" in overrides else fields["n_kv_head"]
    fields.update(overrides)
    return GPTConfig(**fields)


VOCAB_MULTIPLE = 64
"""Vocabulary sizes are padded up to a multiple of 64 (GPT-2's 50257 -> 50304) for fast matmuls."""
_FROM_DATA = ("vocab_size",)
"""GPTConfig fields the data decides (the tokenizer's vocabulary), never the model section."""


def model_keys(config: type = GPTConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(shape keys, switch keys) of a GPTConfig class: its numeric fields, which a config's model section
    may set over its preset (0 keeps the preset's), and its other fields (architecture switches such as
    pos_emb; None keeps the preset's). Derived from the class, so a new GPTConfig field is a model key
    with no edit here."""
    fields = [f for f in dataclasses.fields(config) if f.name not in _FROM_DATA]
    shape = tuple(f.name for f in fields if f.type in ("int", "float", int, float))
    return shape, tuple(f.name for f in fields if f.name not in shape)


SHAPE_KEYS, SWITCH_KEYS = model_keys()
SECTION_KEYS = ("preset", *SWITCH_KEYS, *SHAPE_KEYS)
RUN_KEYS = ("init_from", "activation_checkpointing")
"""model-section keys that are not the architecture (the trainer's; resolve_config ignores them)."""


def pad_vocab(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """`n` rounded up to a multiple of `multiple` (50257 -> 50304)."""
    if n < 1:
        raise ValueError(f"vocab_size must be >= 1, got {n}")
    return -(-n // multiple) * multiple


def resolve_config(section: Mapping[str, Any] | Any, vocab_size: int | None = None) -> GPTConfig:
    """The GPTConfig a config's `model:` section describes: {preset, tie_embeddings (None = the
    preset's), the other switches (SWITCH_KEYS: pos_emb, ...; None or absent = the preset's), the shape
    keys (SHAPE_KEYS; 0 or absent = the preset's)}, as
    a dict or the trainer's dataclass. `vocab_size` (e.g. a dataset's tokenizer vocabulary) replaces
    the preset's, padded up to a multiple of 64; None keeps the preset's (GPT-2, 50304)."""
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        section = dataclasses.asdict(section)
    section = {k: v for k, v in dict(section).items() if k not in RUN_KEYS}
    unknown = sorted(set(section) - set(SECTION_KEYS))
    if unknown:
        raise ValueError(f"model section has unknown key(s) {unknown}; known: {list(SECTION_KEYS)}")
    if "preset" not in section:
        raise ValueError(f"model section has no preset; valid presets: {', '.join(PRESETS)}")
    overrides: dict[str, Any] = {}
    for key in SWITCH_KEYS:
        if section.get(key) is not None and section.get(key) != "":
            overrides[key] = section[key]
    for key in SHAPE_KEYS:
        if section.get(key):
            overrides[key] = section[key]
    if vocab_size is not None:
        overrides["vocab_size"] = pad_vocab(int(vocab_size))
    return get_preset(section["preset"], **overrides)
