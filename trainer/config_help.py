"""--help-config: every key of every section with its type, default and help text, and the option
keys of each registry entry (comm.mode, optim.name) tagged with the entries that take them."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

import yaml

from .config_schema import Config, _registries, field_docs


def describe() -> str:
    lines = []
    regs = _registries()
    for sec in dataclasses.fields(Config):
        lines.append(f"{sec.name}:")
        default = sec.default_factory()
        cls = default.__class__
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name != "options":
                value = getattr(default, f.name)
                lines.append(f"  {f.name} ({_type_and_default(cls, f.name, value)}): {docs.get(f.name, '')}")
                if dataclasses.is_dataclass(value):  # a nested section: its keys, dotted
                    sub = field_docs(type(value))
                    lines += [f"  {f.name}.{g.name} ({_type_and_default(type(value), g.name, getattr(value, g.name))}): "
                              f"{sub.get(g.name, '')}" for g in dataclasses.fields(value)]
        if sec.name in regs:
            selector, entries = regs[sec.name]
            owners: dict[str, list[str]] = {}
            helps: dict[str, str] = {}
            for name, ocls in entries:
                for key, text in _option_lines(ocls):
                    owners.setdefault(key, []).append(name)
                    helps.setdefault(key, text)
            for key, names in owners.items():
                lines.append(f"  {key} {helps[key].split(') ', 1)[0]}): [{sec.name}.{selector}={'|'.join(names)}] "
                             f"{helps[key].split(') ', 1)[1]}")
    return "\n".join(lines)


def _option_lines(ocls, prefix: str = "") -> list[tuple[str, str]]:
    """(key, "(type, default) help") of every option of a registry entry's options class; an option
    whose default is itself an options dataclass (a sub-section, e.g. comm.diloco) is followed by
    each of its keys, dotted, with their own type, default and help."""
    out = []
    d = field_docs(ocls)
    for f in dataclasses.fields(ocls):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out.append((prefix + f.name, f"({_type_and_default(ocls, f.name, value)}) {d.get(f.name, '')}"))
        if dataclasses.is_dataclass(value):
            out += _option_lines(type(value), f"{prefix}{f.name}.")
    return out


def _type_and_default(cls, name: str, value: Any) -> str:
    """'float, default 0.0003' for --help-config: the key's type as the YAML takes it, and its default."""
    tp = typing.get_type_hints(cls).get(name)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    tname = (getattr(args[0], "__name__", str(args[0])) + " or null") if len(args) == 1 and \
        type(None) in typing.get_args(tp) else getattr(tp, "__name__", str(tp))
    if dataclasses.is_dataclass(value):
        return "section"
    return f"{tname}, default {yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()!s}"

