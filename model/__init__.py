"""GPT-2++ model (model/gpt.py, with a KV cache for generation), its size presets and the config
translation (model/presets.py), loading trained runs (model/load.py) and the Hugging Face Llama
mapping (model/hf.py; `python -m model.export` writes an HF directory)."""
from .gpt import (GPT, IO_ROLES, MATRIX_ROLES, ROLES, GPTConfig, KVCache, estimate_mfu, model_from_state_dict, param_layers, param_roles,
                  sample_next)
from .hf import from_hf
from .load import Loaded, load_model
from .presets import PRESETS, get_preset, pad_vocab, resolve_config

__all__ = ["GPT", "GPTConfig", "KVCache", "Loaded", "PRESETS", "IO_ROLES", "MATRIX_ROLES", "ROLES", "estimate_mfu", "from_hf", "get_preset",
           "load_model", "model_from_state_dict", "pad_vocab", "param_layers", "param_roles", "resolve_config",
           "sample_next"]
