"""Config loading: YAML files (strict: a key given twice is an error) and their `extends:` chains,
`section.key=value` overrides, the typed build of the sections, and train.py's command line (sorted
as every command sorts its words: util/cli.py).

Precedence: dataclass defaults < YAML file (and the files it `extends:`) < overrides."""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from util.cli import split_words
from util.files import FileShapeError, strict_yaml

from .config_files import _merge, _read_yaml, read_yaml  # noqa: F401  (re-exported by trainer.config)
from .config_schema import AUTO_MODE, CommConfig, Config, ConfigError, OptimConfig, _registries
from .config_validate import _format, validate


def compose_yaml(paths: list[str | Path] | tuple) -> dict:
    """Config files composed in order as plain dicts, the way load_config composes them before the
    overrides (each file's `extends:` resolved; a later file overrides an earlier one key by key,
    nested mappings merged)."""
    raw: dict = {}
    for p in paths:
        raw = _merge(raw, _read_yaml(Path(p)))
    return raw


def parse_overrides(items: list[str]) -> dict:
    """`section.key=value` (value parsed as YAML) -> nested dict."""
    out: dict = {}
    problems = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or "." not in key:
            problems.append(f"override {item!r}: expected section.key=value (e.g. train.max_steps=100)")
            continue
        try:
            parsed = strict_yaml(value, f"override {key}") if value != "" else ""
        except FileShapeError as e:
            problems.append(str(e))
            continue
        except yaml.YAMLError:
            parsed = value
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override {item!r} conflicts with another override of {part}")
                break
        else:
            node[parts[-1]] = parsed
    if problems:
        raise ConfigError("\n".join(problems))
    return out


def _type_ok(value: Any, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is list or origin is list:
        return isinstance(value, list)
    if tp is str:
        return isinstance(value, str)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    return True


def _section_keys() -> dict[str, list[str]]:
    """Every section's keys (a registry's options included): where a key given in the wrong section lives
    (train.lr -> optim.lr)."""
    out = {}
    regs = _registries()
    hints = typing.get_type_hints(Config)
    for sec in dataclasses.fields(Config):
        keys = [f.name for f in dataclasses.fields(hints[sec.name]) if f.name != "options"]
        for _, options in regs.get(sec.name, ("", []))[1]:
            keys += [k for k in options.field_names() if k not in keys]
        out[sec.name] = keys
    return out


def _build(cls, data: dict, prefix: str, problems: list[str]):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "options"]
    kwargs = {}
    regs = _registries()
    section = prefix.rstrip(".")
    if cls in (CommConfig, OptimConfig) and section in regs:
        data, kwargs["options"] = _split_options(section, data, names, regs[section], problems)
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            # the key itself in another section first (train.lr -> optim.lr), for a top-level section's unknown key
            # only (comm.diloco.lr is no optim.lr), else a near spelling here
            top = prefix.count(".") == 1
            elsewhere = [f"{sec}.{key}" for sec, keys in _section_keys().items()
                         if top and key in keys and f"{sec}." != prefix]
            hint = (f"; did you mean {' or '.join(elsewhere)}?" if elsewhere else
                    f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(names)}")
            problems.append(f"{where}: unknown key{hint}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(f"{where}: expected a mapping of {', '.join(f.name for f in dataclasses.fields(tp))}")
                continue
            kwargs[key] = _build(tp, value, where + ".", problems)
            continue
        if isinstance(value, str) and float in typing.get_args(tp) + (tp,):
            try:  # YAML 1.1 reads 3e-4 (no dot) as a string; accept what float() accepts
                value = float(value)
            except ValueError:
                pass
        if not _type_ok(value, tp):
            tname = getattr(tp, "__name__", str(tp)).replace("NoneType", "null")
            if isinstance(value, bool) and str in (tp, *typing.get_args(tp)):
                # YAML 1.1 turns an unquoted yes/no/on/off into a boolean before we see the word
                words = "true, yes or on" if value else "false, no or off"
                problems.append(f"{where}: expected a word, got {str(value).lower()}: YAML reads an unquoted "
                                f"{words} as a boolean; give one of the key's words (python train.py --help-config "
                                f"lists them) or quote the word")
                continue
            problems.append(f"{where}: expected {tname}, got {value!r} ({type(value).__name__})")
            continue
        if tp is float and isinstance(value, int):
            value = float(value)
        kwargs[key] = value
    return cls(**kwargs)


def _not_about_defaults(checked: list[str], read: list[str], raw: dict) -> list[str]:
    """The whole-config checks' problems less those that quote a key reading the file refused: that key holds
    its default, not the user's value (a "10" for an int, a section that is no mapping), so such a check would
    quote a value the user never wrote. A misspelt key counts as the key it was meant to be ("did you mean")
    unless the file gives that key too. Every other problem is kept: all of them are reported at once."""
    keys = set()
    for r in read:
        key = r.split(":", 1)[0].strip()
        meant = re.search(r"did you mean ([\w.]+)\?", r)
        if meant is None:
            keys.add(key)
        elif not _given(raw, meant.group(1)):
            keys.add(meant.group(1))
    quoted = [re.compile(rf"(?<![\w.]){re.escape(k)}(?!\w)") for k in keys]  # the key or, for a section, a key in it
    return [p for p in checked if not any(q.search(p) for q in quoted)]


def _given(raw: dict, dotted: str) -> bool:
    """Whether the merged raw config holds `dotted` (section.key or section.sub.key)."""
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _split_options(section: str, data: dict, fixed: list[str], registry, problems: list[str]):
    """Separate the selected registry entry's option keys from the section's common keys and
    build the entry's options dataclass (typed, with the same checks as every other key)."""
    selector, entries = registry
    default = {"comm": CommConfig.mode, "optim": OptimConfig.name}[section]
    chosen = data.get(selector, default)
    classes = dict(entries)
    if section == "comm" and chosen == AUTO_MODE:
        # auto picks the mode and that mode's options (from the variant it chooses): a mode's option here
        # has no mode to belong to
        rest = {}
        for key, value in data.items():
            owners = [n for n, c in entries if key in c.field_names()] if key not in fixed else []
            if owners:
                problems.append(f"{section}.{key}: an option of comm.mode={', '.join(owners)}, set with "
                                f"comm.mode=auto, which takes the mode and its options from the variant it picks; "
                                f"remove it, or set comm.mode yourself")
            else:
                rest[key] = value
        return rest, None
    if chosen not in classes:
        return data, None  # the selector itself is reported by validate()
    ocls = classes[chosen]
    own = set(ocls.field_names())
    rest, mine = {}, {}
    for key, value in data.items():
        if key in own:
            mine[key] = value
        elif key in fixed:
            rest[key] = value
        else:
            owners = [n for n, c in entries if key in c.field_names()]
            if owners:
                problems.append(f"{section}.{key}: not an option of {section}.{selector}={chosen} (it belongs to "
                                f"{', '.join(owners)}); remove it or change {section}.{selector}")
            else:
                valid = fixed + sorted(own)
                close = difflib.get_close_matches(str(key), valid, n=1)
                elsewhere = [f"{sec}.{key}" for sec, keys in _section_keys().items() if key in keys and sec != section]
                hint = (f"; did you mean {' or '.join(elsewhere)}?" if elsewhere else
                        f"; did you mean {section}.{close[0]}?" if close else f"; valid keys: {', '.join(valid)}")
                problems.append(f"{section}.{key}: unknown key{hint}")
    return rest, _build(ocls, mine, section + ".", problems)


def split_config_args(args: list[str]) -> tuple[list[str], list[str]]:
    """A command line's config files (*.yaml / *.yml) and key=value overrides, each in its order, wherever
    they stand (util/cli.py's convention: overrides apply over every file). A word that is neither goes
    with the overrides, where parse_overrides names it."""
    files, overrides, other = split_words(args)
    return files, overrides + other


def load_config_args(args: list[str]) -> Config:
    """The Config of train.py's command line: config files (composed in order) and section.key=value
    overrides, in any order (CONFIG.yaml [MORE.yaml ...] [section.key=value ...] is the usual one);
    ConfigError when it names no config file, a word is neither, or the config is invalid."""
    files, overrides, other = split_words(args)
    if other:
        raise ConfigError(f"{other[0]}: expected a config file (*.yaml) or a section.key=value override; usage: "
                          f"train.py CONFIG.yaml [MORE.yaml ...] [section.key=value ...]")
    if not files:
        raise ConfigError(f"expected a config file (*.yaml), e.g. configs/default.yaml; usage: train.py CONFIG.yaml "
                          f"[MORE.yaml ...] [section.key=value ...]")
    return load_config(files, overrides)


def load_config(path: str | Path | list | tuple | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (following `extends:`), apply overrides, build and validate the Config.

    `path` may be several files, merged in order (a size file, then a variant file:
    `configs/gpt2_124m.yaml configs/variants/lioncub_1bit.yaml`). With several files the run
    directory defaults to the merged train.out_dir joined with the last file's name
    (runs/gpt2_124m/lioncub_1bit), unless a file after the first or an override sets it."""
    paths = [Path(p) for p in (path if isinstance(path, (list, tuple)) else [path] if path else [])]
    raw = compose_yaml(paths)
    over = parse_overrides(overrides or [])
    if len(paths) > 1 and "out_dir" in (raw.get("train") or {}) and not any(
            "out_dir" in (_read_yaml(p).get("train") or {}) for p in paths[1:]) \
            and "out_dir" not in (over.get("train") or {}):
        raw["train"] = {**raw["train"], "out_dir": str(Path(raw["train"]["out_dir"]) / paths[-1].stem)}
    raw = _merge(raw, over)
    problems: list[str] = []
    names = [f.name for f in dataclasses.fields(Config)]
    for key in list(raw):
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            problems.append(f"{key}: unknown section" + (f"; did you mean {close[0]}?" if close else
                                                         f"; valid sections: {', '.join(names)}"))
            raw.pop(key)
        elif not isinstance(raw[key], dict):
            problems.append(f"{key}: expected a mapping of keys, got {raw[key]!r}")
            raw.pop(key)
    for section in _registries():
        raw.setdefault(section, {})  # so the selected entry's options are always built
    cfg = _build(Config, raw, "", problems)
    problems += _not_about_defaults(validate(cfg, world_size=None, raise_error=False), problems, raw)
    if problems:
        raise ConfigError(_format(problems))
    return cfg
