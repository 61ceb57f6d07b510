"""Reading the small files a run or a user leaves (config YAML, JSON run records) so that a file of
the wrong shape is one line naming the file, never a TypeError or KeyError deep in a reader.

- `strict_yaml(text, source)`: yaml.safe_load, except that a key given twice in one mapping is an
  error naming both lines (plain YAML keeps the last one silently: a second `train:` section
  would replace the first whole).
- `read_json_object(path, fields, fix)`: a JSON object whose listed keys have the listed types.

Imports nothing of ours (any package may use it)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml


class FileShapeError(ValueError):
    """A file that is not valid YAML / JSON or not of the expected shape; the message is one line
    naming the file and what to do."""


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping holding the same key twice."""

    source = "<string>"

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader reports it itself
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise FileShapeError(f"{self.source}: key {key!r} appears twice in one mapping (lines {first} and "
                                     f"{line}); YAML would silently keep only the second, so merge the two into one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)



def strict_yaml(text: str, source: str | os.PathLike = "<string>") -> Any:
    """yaml.safe_load(text), refusing duplicate keys (FileShapeError naming `source` and both lines);
    yaml.YAMLError for text that is not YAML."""
    loader = _StrictLoader(text)
    loader.source = str(source)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", dict: "an object", list: "a list",
               bool: "true or false"}


def _is(value: Any, kind: type | tuple) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False  # JSON true is not a number here
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return True
    return isinstance(value, kinds)


def read_json_object(path: str | os.PathLike, fields: dict[str, type | tuple] | None = None,
                     fix: str = "", optional: dict[str, type | tuple] | None = None) -> dict:
    """The JSON object in `path`; FileShapeError (one line: the file, what is wrong, `fix`) when it
    is unreadable, not JSON, not an object, lacks a key of `fields`, or a key of `fields` /
    `optional` has another type (int counts as float; true / false never count as numbers)."""
    path = Path(path)
    tail = f"; {fix}" if fix else ""
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileShapeError(f"{path} is missing{tail}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FileShapeError(f"{path} is unreadable ({e}){tail}") from None
    except ValueError as e:
        raise FileShapeError(f"{path} is not valid JSON ({e}){tail}") from None
    if not isinstance(obj, dict):
        raise FileShapeError(f"{path} holds a JSON {type(obj).__name__}, not an object{tail}")
    for key, kind in (fields or {}).items():
        if key not in obj:
            raise FileShapeError(f"{path} lacks the key {key!r}{tail}")
    for key, kind in {**(optional or {}), **(fields or {})}.items():
        if key in obj and not _is(obj[key], kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            want = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            raise FileShapeError(f"{path}: {key!r} is {json.dumps(obj[key])[:80]}, expected {want}{tail}")
    return obj


__all__ = ["FileShapeError", "read_json_object", "strict_yaml"]
