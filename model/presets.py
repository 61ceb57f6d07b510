"""Model size presets: the GPT-2 sizes of Lion Cub App. F.2 and small CPU models for tests."""
from __future__ import annotations

from .gpt import GPTConfig

# name -> (n_layer, n_head, n_embd, block_size)
_SHAPES = {
    "debug": (2, 2, 64, 128),          # unit tests: seconds on one CPU core
    "tiny": (4, 4, 128, 256),          # default config: learns visibly in minutes on a laptop
    "cpu-30m": (6, 6, 384, 256),       # ~30M params with the GPT-2 vocab (tied)
    "gpt2-124m": (12, 12, 768, 1024),
    "gpt2-350m": (24, 16, 1024, 1024),
    "gpt2-774m": (36, 20, 1280, 1024),
    "gpt2-1558m": (48, 25, 1600, 1024),
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
    fields["mlp_hidden"] = 0 if "n_embd" in overrides else fields["mlp_hidden"]
    fields.update(overrides)
    return GPTConfig(**fields)


def resolve_config(section: dict, vocab_size: int | None = None) -> GPTConfig:
    """The GPTConfig a run config's `model:` section describes: {preset, tie_embeddings (null =
    the preset's), pos_emb, block_size (0 = the preset's)}; `vocab_size`, when given, replaces
    the preset's, padded up to a multiple of 64 (GPT-2's 50257 -> 50304) for fast matmuls."""
    overrides: dict = {"pos_emb": section.get("pos_emb", "rope")}
    if section.get("tie_embeddings") is not None:
        overrides["tie_embeddings"] = section["tie_embeddings"]
    if section.get("block_size"):
        overrides["block_size"] = section["block_size"]
    if vocab_size:
        overrides["vocab_size"] = -(-int(vocab_size) // 64) * 64
    return get_preset(section["preset"], **overrides)
