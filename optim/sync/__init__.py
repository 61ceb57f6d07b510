"""Synchronisation schemes (`comm.mode`): the registry and the built-in schemes.

    from optim import sync
    scheme = sync.get("pbit"); opts = scheme.options(bits=8, quantizer="l1")
    exchange = scheme.build(opts, sync.ExchangeContext(world_size=P, rank=r))
    update = exchange(c_local, step)

`python -m optim` prints the README's tables of modes from the registry.
"""
from __future__ import annotations

from . import allreduce, pbit, votes  # noqa: F401  (registers the built-in schemes)
from . import compressed  # noqa: F401  (loco, compressed: error-feedback compressed schemes)
from .diloco import LOCAL  # registers diloco (the local-update scheme, after the wires it uses); LOCAL: its kind
from .pbit import effective_levels
from .registry import (GRADIENT, MEAN, SIGN, UPDATE, Exchange, ExchangeContext, SchemeOptions, SyncScheme, get,
                       names, option_owners, register, schemes, unregister)

__all__ = ["GRADIENT", "MEAN", "SIGN", "UPDATE", "Exchange", "ExchangeContext", "SchemeOptions", "SyncScheme",
           "effective_levels", "get", "markdown_table", "names", "option_owners", "register", "schemes",
           "unregister"]


def markdown_table(P: int = 8, n: int = 8_000_000) -> str:
    """The README's table of communication modes: one row per registered scheme, bytes per
    element sent by a worker (rank 1) per step with default options at P ranks."""
    rows = ["| `comm.mode` | kind | what crosses the network | options (`comm.*`) | bytes sent per element, P=%d |" % P,
            "|---|---|---|---|---:|"]
    for s in schemes():
        opts = s.default_options()
        sent, _ = s.bytes_per_call(opts, P, n, rank=1)
        keys = ", ".join(f"`{k}`" for k in s.options.field_names()) or "-"
        rows.append(f"| `{s.name}` | {s.kind} | {s.wire} | {keys} | {sent / n:.3g} |")
    return "\n".join(rows)

