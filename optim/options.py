"""Typed option dataclasses of registry entries (sync schemes, optimizers), validated in one pass.

A registry entry declares its options as a dataclass derived from `Options`; every field has a
default and a docstring (the string under it), which is its help text in `--help-config`. The
config keeps them flat in their section (`comm.bits`, `optim.nesterov`), so a new scheme or
optimizer brings its own keys without touching the config module. `problems(world_size)`
returns every problem at once, each naming the key (`comm.bits: ...`) and the fix; world-size
dependent checks run when `world_size` is given.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable


@dataclasses.dataclass
class Options:
    """Base of every options dataclass; `section` is the config section its keys live in."""

    section: ClassVar[str] = "comm"

    def problems(self, world_size: int | None = None) -> list[str]:
        """Every problem with these values (and, given `world_size`, at that many ranks)."""
        return []

    def run_problems(self, max_steps: int) -> list[str]:
        """Problems of these values given the run's length (e.g. a warm-up longer than the run)."""
        return []

    def key(self, name: str) -> str:
        return f"{self.section}.{name}"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def choice(problems: list[str], key: str, value: Any, allowed: Iterable) -> None:
    """Append a problem when `value` is not one of `allowed` (the message lists them)."""
    allowed = list(allowed)
    if value not in allowed:
        problems.append(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")


def at_least(problems: list[str], key: str, value: float, low: float) -> None:
    if value < low:
        problems.append(f"{key}: {value} must be >= {low}")
