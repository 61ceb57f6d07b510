"""Config files as plain dicts: a YAML file read strictly (a key given twice is an error), its `extends:`
chain resolved, mappings merged key by key. The lowest layer of the config package: trainer.config_load
composes files with it, trainer.config_validate reads the variant files with it."""
from __future__ import annotations

import difflib
from pathlib import Path

import yaml

from util.files import FileShapeError, strict_yaml

from .config_schema import ConfigError


def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config 'extends' cycle: {' -> '.join(map(str, seen + (path,)))}")
    if not path.is_file():
        if not path.parent.is_dir():
            raise ConfigError(f"config file not found: {path} (its directory {path.parent} does not exist)")
        near = sorted(p.name for p in path.parent.iterdir() if p.suffix in (".yaml", ".yml"))
        close = difflib.get_close_matches(path.name, near, n=1)
        listed = ", ".join(near[:20]) + (f" and {len(near) - 20} more" if len(near) > 20 else "")
        raise ConfigError(f"config file not found: {path}" + (f"; did you mean {path.parent / close[0]}?" if close else
                                                               f"; {path.parent} holds {listed}" if near else ""))
    try:  # a key given twice (a second `train:` section) is an error naming both lines, never a silent loss
        raw = strict_yaml(path.read_text(), path) or {}
    except FileShapeError as e:
        raise ConfigError(str(e)) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    parents = raw.pop("extends", None) or []
    if isinstance(parents, str):
        parents = [parents]
    base: dict = {}
    for parent in parents:  # later parents override earlier ones, the file itself overrides all
        base = _merge(base, _read_yaml(path.parent / parent, seen + (path,)))
    return _merge(base, raw)


def read_yaml(path: str | Path) -> dict:
    """A config file as a plain dict, its `extends:` chain resolved (ConfigError on a bad file)."""
    return _read_yaml(Path(path))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
