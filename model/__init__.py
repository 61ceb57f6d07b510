"""GPT-2++ model (model/gpt.py) and its size presets (model/presets.py)."""
from .gpt import GPT, GPTConfig, ROLES, estimate_mfu, param_layers, param_roles
from .presets import PRESETS, get_preset, resolve_config

__all__ = ["GPT", "GPTConfig", "PRESETS", "ROLES", "estimate_mfu", "get_preset", "param_layers", "param_roles",
           "resolve_config"]
