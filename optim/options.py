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
import difflib
import math
from typing import Any, ClassVar, Iterable


@dataclasses.dataclass
class Options:
    """Base of every options dataclass; `section` is the config section its keys live in."""

    section: ClassVar[str] = "comm"

    def problems(self, world_size: int | None = None) -> list[str]:
        """Every problem with these values (and, given `world_size`, at that many ranks)."""
        return []

    def run_problems(self, max_steps: int, *, blocks: int | None = None) -> list[str]:
        """Problems of these values given the run: its length (e.g. a warm-up longer than the run) and the
        model's transformer blocks (None: not known before the model is built, e.g. model.init_from)."""
        return []

    def notes(self) -> list[str]:
        """Values that are valid but change what a run does in a way a user may not expect: one line
        each, naming the key, printed under the run's banner (never a refusal: see problems)."""
        return []

    def key(self, name: str) -> str:
        return f"{self.section}.{name}"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def choice(problems: list[str], key: str, value: Any, allowed: Iterable) -> None:
    """Append a problem when `value` is not one of `allowed` (the message lists them, and names the closest
    one where a misspelling is likely)."""
    allowed = list(allowed)
    if value not in allowed:
        close = (difflib.get_close_matches(value, [a for a in allowed if isinstance(a, str)], n=1)
                 if isinstance(value, str) else [])   # a misspelt name, never a number near another
        problems.append(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}"
                        + (f"; did you mean {close[0]}?" if close else ""))


def at_least(problems: list[str], key: str, value: float, low: float) -> None:
    if value < low:
        problems.append(f"{key}: {value} must be >= {low}")


def common_problems(*, lr: float | None = None, betas=None, eps: float | None = None,
                    weight_decay: float | None = None, grad_clip: float | None = None,
                    beta1: float | None = None) -> list[str]:
    """Problems of the optim.* keys every optimizer takes (those given), each rule written once: the
    config validates a run with it and an optimizer built directly checks its arguments with it."""
    p: list[str] = []
    if lr is not None and not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        p.append(f"optim.lr: {lr} must be a positive number")
    if betas is not None and (len(betas) != 2 or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
        p.append(f"optim.betas: {list(betas)} must be two numbers in [0, 1) (beta = 1 would never update the "
                 f"momentum; the papers use (0.9, 0.99) for Lion, (0.9, 0.95) for AdamW)")
    if beta1 is not None and not 0 <= beta1 < 1:  # an optimizer with one factor: optim.betas[0]
        p.append(f"optim.betas: [0] is {beta1}; it must be in [0, 1)")
    for key, val in (("eps", eps), ("weight_decay", weight_decay), ("grad_clip", grad_clip)):
        if val is not None and not val >= 0:
            p.append(f"optim.{key}: {val} must be >= 0" + (" (0 disables clipping)" if key == "grad_clip" else ""))
    return p
