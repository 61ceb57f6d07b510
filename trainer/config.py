"""Run configuration: YAML -> nested dataclasses, CLI overrides, one validation pass.

Precedence: dataclass defaults < YAML file (and the files it `extends:`) < `section.key=value`
overrides. Every field carries a docstring (the string under it); `describe()` prints them as
help. `validate()` collects every problem into one ConfigError naming the key and the allowed
values, so a user fixes a config in one round trip.

The `comm` and `optim` sections are open: besides their common keys they take the options of the
selected entry of a registry (`comm.mode` -> optim.sync, `optim.name` -> optim.registry), each a
typed dataclass that validates itself, so a new mode or optimizer brings its keys with it and
nothing here names a mode.
"""

from __future__ import annotations

# The public module: every name below is imported from here (trainer.config.X). The parts change
# for different reasons, so they live apart: the schema (sections and help texts), loading (YAML,
# `extends:`, overrides), validation (ranges and cross-section rules) and --help-config.
from .config_help import _type_and_default, describe
from .config_load import (_build, _merge, _read_yaml, _split_options, _type_ok, load_config, load_config_args,
                          parse_overrides, read_yaml, split_config_args)
from .config_schema import (AUTO_MODE, LAYER_SELECTORS, VARIANTS_DIR, CommConfig, Config, ConfigError, DataConfig,
                            DiagConfig, LogConfig, ModelConfig, MomentumSyncConfig, OptimConfig, ParallelConfig,
                            TrainConfig, _option, _registries, field_docs)
from .config_validate import _format, _parallel_problems, validate, wandb_problems, warmup_steps

__all__ = ["AUTO_MODE", "LAYER_SELECTORS", "VARIANTS_DIR", "CommConfig", "Config", "ConfigError", "DataConfig",
           "DiagConfig", "LogConfig", "ModelConfig", "MomentumSyncConfig", "OptimConfig", "ParallelConfig",
           "TrainConfig", "describe", "field_docs", "load_config", "load_config_args", "parse_overrides",
           "read_yaml", "split_config_args", "validate", "wandb_problems", "warmup_steps"]
