"""Byte and time accounting of an optimizer step: the phases, their CommStats, the step's report,
and the exact-byte formula and alpha-beta prediction of one step derived from what it exchanges.

An optimizer says what crosses the network in one step as a list of `Call`s (every call of its
scheme's exchange) and `SideCall`s (collectives outside the scheme, e.g. Dion's clipping norm);
`wire_bytes` and `predict_seconds` turn them into bytes by phase and seconds, with the scheme's
own formulas, so measured (CommStats) and predicted bytes come from one description.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

import torch

from comm import CommStats, cost_model

from . import sync

PHASES = ("grad_sync", "update_sync", "momentum_sync", "diag", "guard", "overlapped")
COMM_PHASES = ("grad_sync", "update_sync", "momentum_sync")  # what the step's comm time and bytes count
BACKGROUND = "overlapped"
"""The phase background (overlapped) exchanges book into: their seconds overlap compute."""


class Call(NamedTuple):
    """One call of the scheme's exchange in a step."""

    phase: str
    numel: int
    rows: int
    """Rows of the tensors in the vector (mask_zero_updates' flags); 1 when it has no such flags."""


class SideCall(NamedTuple):
    """One collective outside the scheme (a ring allreduce of `numel` words of `bits`)."""

    phase: str
    numel: int
    bits: int


@dataclass
class StepReport:
    """What one optimizer step did, for the trainer's log. Byte and second sums exclude the
    diagnostics (their own phase, reported apart)."""

    step: int
    seconds: float = 0.0
    """Wall time of step(), diagnostics excluded."""
    phases: dict[str, dict] = field(default_factory=dict)
    """phase -> {bytes_sent, bytes_recv, coll_s, pack_s, calls} (comm.CommStats.step_summary)."""
    diagnostics: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, torch.Tensor] = field(default_factory=dict)
    diag_seconds: float = 0.0
    loss: Any = None
    nonfinite: bool = False
    """The divergence guard found a non-finite loss or gradient on some rank: nothing was exchanged
    or updated, and no optimizer state changed."""
    grad_norms: torch.Tensor | None = None
    """L2 norms of the gradient clipping sees (after a gradient exchange; this rank's own for update
    sync), before clipping: one per role (`CommOptimizer.grad_norm_roles` order), then the global one.
    A device tensor: reading it is left to the logging steps."""
    stop: bool = False
    """Some rank asked to stop (a signal): agreed by the same guard collective, so every rank learns
    it at the same step."""

    def total(self, key: str) -> float:
        return sum(self.phases.get(p, {}).get(key, 0) for p in COMM_PHASES)

    @property
    def coll_s(self) -> float:
        return self.total("coll_s")

    @property
    def pack_s(self) -> float:
        return self.total("pack_s")

    @property
    def comm_s(self) -> float:
        return self.coll_s + self.pack_s

    @property
    def bytes_sent(self) -> int:
        return int(self.total("bytes_sent"))

    @property
    def bytes_recv(self) -> int:
        return int(self.total("bytes_recv"))


class PhaseStats(dict):
    """phase -> the CommStats its collectives book into (every name of PHASES)."""

    def __init__(self, timing: bool = True) -> None:
        super().__init__({phase: CommStats(timing=timing) for phase in PHASES})

    def begin_step(self) -> None:
        for s in self.values():
            s.begin_step()

    def step_summary(self) -> dict[str, dict]:
        return {phase: s.step_summary() for phase, s in self.items()}


def wire_bytes(scheme: sync.SyncScheme, options: sync.SchemeOptions, calls: Iterable[tuple[str, int, int]],
               side_calls: Iterable[tuple[str, int, int]], world_size: int, rank: int) -> dict[str, tuple[int, int]]:
    """Payload bytes (sent, received) `rank` hands to collectives in one step, by phase, as
    comm.CommStats books them: the scheme's formula for every `Call`, n * bits / 8 each way for
    every `SideCall` (none at one rank)."""
    out: dict[str, tuple[int, int]] = {}
    for phase, n, rows in calls:
        s, r = scheme.bytes_per_call(options, world_size, n, rank=rank, rows=rows)
        a, b = out.get(phase, (0, 0))
        out[phase] = (a + s, b + r)
    if world_size > 1:
        for phase, n, bits in side_calls:
            a, b = out.get(phase, (0, 0))
            out[phase] = (a + n * bits // 8, b + n * bits // 8)
    return out


def predict_seconds(scheme: sync.SyncScheme, options: sync.SchemeOptions, calls: Iterable[tuple[str, int, int]],
                    side_calls: Iterable[tuple[str, int, int]], world_size: int, alpha: float, beta: float) -> float:
    """Alpha-beta seconds of one step's communication: the scheme's own model per `Call`, the ring
    allreduce per `SideCall`; alpha in s per message, beta in s per bit."""
    if world_size <= 1:
        return 0.0
    t = sum(scheme.predict(options, world_size, n, alpha, beta, rows=rows) for _, n, rows in calls if n)
    return t + sum(cost_model.ring_allreduce(world_size, n, bits, alpha, beta) for _, n, bits in side_calls)


__all__ = ["BACKGROUND", "COMM_PHASES", "Call", "PHASES", "PhaseStats", "SideCall", "StepReport", "predict_seconds",
           "wire_bytes"]
