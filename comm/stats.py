"""Byte and time accounting for every collective in comm/ (CommStats).

Counting rule (docs/architecture.md, "Byte accounting"): bytes are the payload of the tensors handed to collectives,
per rank: `bytes_sent` = size of the tensors this rank passes in (input / send buffers),
`bytes_recv` = size of the tensors it gets filled (output / receive buffers). A rank that only
receives in a rooted collective (broadcast, the non-root side of scatter) sends 0, and a world of
one rank moves nothing. `coll_s` is wall time inside torch.distributed calls, `pack_s` wall time
in pack/unpack/quantize/local reduction; with CUDA tensors the device is synchronised before
each timer is read, so asynchronous kernels are charged to the right bucket.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

_KEYS = ("bytes_sent", "bytes_recv", "coll_s", "pack_s", "calls")


@dataclass
class CallRecord:
    """One public collective call (or one external `timed_pack` block, name 'pack')."""
    name: str
    bytes_sent: int = 0
    bytes_recv: int = 0
    coll_s: float = 0.0
    pack_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """The project's one wall clock for timing phases (trainer sections, optimizer phases,
    collectives). On CUDA `now()` synchronises the device first, so asynchronous kernels are
    charged to the phase that launched them; on CPU it is a plain perf_counter read."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None and device.type == "cuda" else None

    def now(self) -> float:
        _sync(self.device)
        return time.perf_counter()


def _zero() -> dict:
    return {"bytes_sent": 0, "bytes_recv": 0, "coll_s": 0.0, "pack_s": 0.0, "calls": 0}


class CommStats:
    """Per-call records plus per-step and lifetime sums of bytes and seconds.

    `calls` keeps the most recent `max_calls` records (older ones are dropped so a long run does
    not grow without bound); `totals()` and `step_summary()` are exact regardless."""

    def __init__(self, max_calls: int = 100_000) -> None:
        self.max_calls = max_calls
        self.calls: list[CallRecord] = []
        self._step = _zero()
        self._total = _zero()

    # ---- reading -------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start a new per-step accumulation (the trainer calls this before each step)."""
        self._step = _zero()

    def step_summary(self) -> dict:
        """bytes_sent, bytes_recv, coll_s, pack_s, calls accumulated since begin_step()."""
        return dict(self._step)

    def totals(self) -> dict:
        """Same keys as step_summary(), since creation or the last reset()."""
        return dict(self._total)

    def reset(self) -> None:
        self.calls.clear()
        self._step = _zero()
        self._total = _zero()

    # ---- recording -----------------------------------------------------------------------
    def _add(self, rec: CallRecord, count_call: bool) -> None:
        for acc in (self._step, self._total):
            acc["bytes_sent"] += rec.bytes_sent
            acc["bytes_recv"] += rec.bytes_recv
            acc["coll_s"] += rec.coll_s
            acc["pack_s"] += rec.pack_s
            acc["calls"] += int(count_call)
        self.calls.append(rec)
        if len(self.calls) > self.max_calls:
            del self.calls[: len(self.calls) - self.max_calls]

    @contextlib.contextmanager
    def call(self, name: str, device: torch.device | None = None) -> Iterator["CallTimer"]:
        """Record one public collective call; the body books time through the yielded timer."""
        timer = CallTimer(CallRecord(name), device)
        yield timer
        self._add(timer.record, count_call=True)

    @contextlib.contextmanager
    def timed_pack(self, device: torch.device | None = None) -> Iterator[None]:
        """Book the body's wall time as pack/quantize seconds (for callers outside comm/, e.g.
        the optimizer's quantizer). Pass `device` for CUDA work so the timer waits for it."""
        rec = CallRecord("pack")
        clock = Clock(device)
        t0 = clock.now()
        try:
            yield
        finally:
            rec.pack_s = clock.now() - t0
            self._add(rec, count_call=False)


class CallTimer:
    """Books seconds and bytes of one call into its CallRecord."""

    def __init__(self, record: CallRecord, device: torch.device | None) -> None:
        self.record = record
        self.clock = Clock(device)

    @contextlib.contextmanager
    def _timed(self, field: str) -> Iterator[None]:
        t0 = self.clock.now()
        try:
            yield
        finally:
            setattr(self.record, field, getattr(self.record, field) + self.clock.now() - t0)

    def pack(self) -> contextlib.AbstractContextManager[None]:
        """Time packing/unpacking/quantizing work as pack seconds."""
        return self._timed("pack_s")

    def coll(self, sent: torch.Tensor | list | tuple | None = None,
             recv: torch.Tensor | list | tuple | None = None) -> contextlib.AbstractContextManager[None]:
        """Time a torch.distributed call and count the bytes of the tensors handed to it."""
        self.record.bytes_sent += _nbytes(sent)
        self.record.bytes_recv += _nbytes(recv)
        return self._timed("coll_s")


def _nbytes(t: torch.Tensor | list | tuple | None) -> int:
    if t is None:
        return 0
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(u) for u in t)
    return t.numel() * t.element_size()


_DEFAULT = CommStats()


def default_stats() -> CommStats:
    """The process-wide CommStats that collectives record into when given stats=None."""
    return _DEFAULT
