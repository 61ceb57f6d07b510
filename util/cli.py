"""The one argument convention of every command: config files, then `section.key=value` overrides, in
any order with the command's flags; several config files compose in order (as train.py composes a size
file and a variant file); `--variants A.yaml B.yaml` compares, each file one candidate.

    python -m trainer.memory configs/gpt2_774m.yaml --world 8 data.batch_size=2
    python -m trainer.memory configs/gpt2_774m.yaml configs/variants/lioncub_1bit.yaml --world 8
    python -m bench.advise configs/cpu_30m.yaml --variants configs/variants/lion_fp32.yaml B.yaml

`Parser` is an argparse parser that sorts the bare words of a command line: a word ending in
.yaml / .yml is a config file, a word `key=value` (key: letters, digits, `_`, `.`, `-`) an override,
anything else a positional the command declared (or an error). It only sorts: the command composes
with trainer.config's `load_config(ns.configs, ns.overrides)`, which merges the files in order and
applies the overrides over all of them (overrides win over every file, wherever they stand), and
`variant_runs(ns)` lists, per `--variants` entry, the files that compose into that candidate's config.
Every error is one line on stderr with exit code 2 (argparse's usage block is left to --help).

This module imports nothing of ours (util/'s rule): the commands pass the parsed lists to the loader.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

CONFIG_SUFFIXES = (".yaml", ".yml")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")
_WORDS = "_words"  # the catch-all positional's dest


def is_override(word: str) -> bool:
    """`section.key=value` (or a malformed `key=value`, which the loader reports by name)."""
    key, sep, _ = word.partition("=")
    return bool(sep) and bool(_KEY.match(key))


def is_config(word: str) -> bool:
    return word.lower().endswith(CONFIG_SUFFIXES) and not is_override(word)


def split_words(words: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(config files, overrides, other words) of a command line's bare words, each in its order."""
    configs, overrides, other = [], [], []
    for w in words:
        (overrides if is_override(w) else configs if is_config(w) else other).append(w)
    return configs, overrides, other


def path_arg(value: str) -> str:
    """argparse type of a path option (an output directory, runs to read): absolute against the directory the
    command runs in. The lab's commands launch their training runs from the repository root, so a relative
    path would name one place for the runs they launch and another for what they read and write themselves;
    "" stays "" (unset)."""
    return str(Path(value).expanduser().absolute()) if value else value


ROOT = Path(__file__).resolve().parents[1]


def shown(path: str | Path) -> str:
    """A path as results files and messages write it: relative to the repository when inside it (committed
    results read the same on every machine), else as given."""
    p = Path(path)
    try:
        return p.absolute().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


class Parser(argparse.ArgumentParser):
    """argparse with the project's convention and one-line errors.

    configs: the command takes config files and overrides (`ns.configs`, `ns.overrides`);
    require_config: at least one config file (or --variants entry, where variants is on);
    variants: add `--variants A.yaml B.yaml ...` (`ns.variants`: each entry a candidate; a word
    `key=value` after it is an override for all, not a candidate);
    positionals: names of bare words the command takes besides configs (each optional, in order;
    bench.reproduce's study name);
    override_lists: dests of the command's own many-valued flags that take key=value items
    (bench.reproduce's --set): a config file or other word argparse handed them goes back to the
    command line's words. Commands without configs keep argparse's own positionals and refuse a
    `key=value` word in one line saying so."""

    def __init__(self, *args, configs: bool = False, require_config: bool = False, variants: bool = False,
                 positionals: Sequence[str] = (), override_lists: Sequence[str] = (), config_help: str = "",
                 **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self._takes_configs = configs or require_config or variants
        self._require_config = require_config
        self._takes_variants = variants
        self._names = tuple(positionals)
        self._override_lists = tuple(override_lists)
        if self._takes_configs:
            names = "".join(f"{p.upper()}|" for p in self._names)
            self.add_argument(_WORDS, nargs="*", metavar=f"{names}CONFIG.yaml|section.key=value",
                              help=config_help or "config files (composed in order, as train.py does) and "
                                                  "section.key=value overrides, in any order with the flags")
        if variants:
            self.add_argument("--variants", nargs="+", action="extend", default=[], metavar="VARIANT",
                              help="compare: each config file given here is one candidate (composed over the "
                                   "config files given outside --variants)")

    def error(self, message: str) -> NoReturn:
        """One line, exit 2 (argparse prints its usage block first; --help shows it)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace=None) -> argparse.Namespace:  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        if not self._takes_configs:
            ns, extra = self.parse_known_args(args, namespace)
            if extra:
                self._refuse(extra)
            return ns
        ns = self.parse_intermixed_args(args, namespace)
        words = list(getattr(ns, _WORDS))
        delattr(ns, _WORDS)
        # a many-valued flag takes every bare word after it: hand back the words that are not its kind
        if self._takes_variants:  # the overrides written after --variants belong to every candidate
            words += [v for v in ns.variants if is_override(v)]
            ns.variants = [v for v in ns.variants if not is_override(v)]
        for dest in self._override_lists:
            items = getattr(ns, dest) or []
            words += [v for v in items if not is_override(v)]
            setattr(ns, dest, [v for v in items if is_override(v)])
        ns.configs, ns.overrides, other = split_words(_in_order(words, args))
        if len(other) > len(self._names):
            extra = other[len(self._names):]
            self.error(f"{extra[0]!r}: expected a config file (*.yaml) or a section.key=value override"
                       + (f" (this command takes {', '.join(self._names)} once)" if self._names else ""))
        for i, name in enumerate(self._names):
            setattr(ns, name, other[i] if i < len(other) else None)
        if self._require_config and not ns.configs and not getattr(ns, "variants", None):
            self.error("expected a config file (*.yaml), e.g. configs/default.yaml"
                       + (" (or --variants A.yaml B.yaml)" if self._takes_variants else ""))
        return ns

    def _refuse(self, extra: list[str]) -> NoReturn:
        over = [w for w in extra if is_override(w) or is_config(w)]
        if over:
            self.error(f"{over[0]!r}: this command takes no config file or section.key=value override (those "
                       f"configure a training run: train.py, trainer.memory, bench.advise); its options are flags")
        self.error(f"unrecognized arguments: {' '.join(extra)}")


def _in_order(words: list[str], argv: list[str]) -> list[str]:
    """`words` in the order they stand in `argv` (words gathered from several places of the line)."""
    free = {}
    for i, a in enumerate(argv):
        free.setdefault(a, []).append(i)
    return sorted(words, key=lambda w: free[w].pop(0) if free.get(w) else len(argv))


def variant_name(path: str, others: Sequence[str] = ()) -> str:
    """A candidate's name: its file's stem, or its path without the suffix where two stems are alike
    (configs/gpt2_774m/onebit_adam.yaml beside configs/variants/onebit_adam.yaml)."""
    stem = Path(path).stem
    if sum(Path(o).stem == stem for o in others) > 1:
        return Path(path).with_suffix("").as_posix()
    return stem


def variant_runs(ns: argparse.Namespace,
                 resolve: Callable[[str], str] | None = None) -> list[tuple[str, list[str]]]:
    """(name, config files) per --variants entry: the files given outside --variants, then the entry's
    file, composed in that order (the loader then applies ns.overrides to each). A non-.yaml entry is
    passed to `resolve` (a registry name -> its file); without one it is an error (ValueError)."""
    files = []
    for v in ns.variants:
        if is_config(v):
            files.append(v)
        elif resolve is None:
            raise ValueError(f"--variants {v}: expected a config file (*.yaml)")
        else:
            files.append(resolve(v))
    if len(set(files)) < len(files):
        dup = next(f for f in files if files.count(f) > 1)
        raise ValueError(f"--variants {dup}: given twice; each candidate once")
    return [(variant_name(f, files), [*ns.configs, f]) for f in files]
