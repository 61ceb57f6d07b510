"""Byte and time accounting for every collective in comm/ (CommStats), and the project's clock.

Counting rule (docs/architecture.md, "Byte accounting"): bytes are the payload of the tensors handed to collectives,
per rank: `bytes_sent` = size of the tensors this rank passes in (input / send buffers),
`bytes_recv` = size of the tensors it gets filled (output / receive buffers). A rank that only
receives in a rooted collective (broadcast, the non-root side of scatter) sends 0, and a world of
one rank moves nothing. `coll_s` is time inside torch.distributed calls, `pack_s` time in
pack/unpack/quantize/local reduction.

Timing never synchronises the hot path: on CPU a section is two perf_counter reads; with CUDA
tensors it is a pair of CUDA events recorded on the current stream, resolved (waiting for the end
event only) when the sums are read, i.e. when the trainer reads a step's summary. `timing=False`
turns the seconds off entirely (bytes are still counted), so the cost of fine-grained timing can
be measured and avoided.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

_KEYS = ("bytes_sent", "bytes_recv", "coll_s", "pack_s", "calls")


class Clock:
    """The project's one clock. `now()` is a wall-clock read that waits for queued CUDA work (for
    step boundaries); `start()` / `stop()` time a section without waiting: perf_counter on CPU,
    CUDA events on a CUDA device (the span resolves to seconds when read)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None and device.type == "cuda" else None

    def now(self) -> float:
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self):
        if self.device is None:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, start) -> "float | Span":
        if self.device is None:
            return time.perf_counter() - start
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return Span(start, end)


@dataclass
class Span:
    """A CUDA-event section whose seconds are read later (waits for its end event only)."""
    start: object
    end: object

    def seconds(self) -> float:
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def _resolve(v: "float | Span | list") -> float:
    if isinstance(v, list):
        return sum(_resolve(x) for x in v)
    return v.seconds() if isinstance(v, Span) else float(v)


@dataclass
class CallRecord:
    """One public collective call (or one external `timed_pack` block, name 'pack')."""
    name: str
    bytes_sent: int = 0
    bytes_recv: int = 0
    coll: list = field(default_factory=list, repr=False)
    pack: list = field(default_factory=list, repr=False)

    @property
    def coll_s(self) -> float:
        return _resolve(self.coll)

    @property
    def pack_s(self) -> float:
        return _resolve(self.pack)

    def as_dict(self) -> dict:
        return {"name": self.name, "bytes_sent": self.bytes_sent, "bytes_recv": self.bytes_recv,
                "coll_s": self.coll_s, "pack_s": self.pack_s}


def _zero() -> dict:
    return {"bytes_sent": 0, "bytes_recv": 0, "coll_s": [], "pack_s": [], "calls": 0}


def _read(acc: dict) -> dict:
    out = dict(acc)
    for k in ("coll_s", "pack_s"):
        out[k] = _resolve(acc[k])
        acc[k] = [out[k]]  # resolved once
    return out


class CommStats:
    """Per-call records plus per-step and lifetime sums of bytes and seconds.

    `calls` keeps the most recent `max_calls` records (older ones are dropped so a long run does
    not grow without bound); `totals()` and `step_summary()` are exact regardless. timing=False:
    bytes only, no clock reads."""

    def __init__(self, max_calls: int = 100_000, timing: bool = True) -> None:
        self.max_calls = max_calls
        self.timing = timing
        self.calls: list[CallRecord] = []
        self._step = _zero()
        self._total = _zero()

    # ---- reading -------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start a new per-step accumulation (the trainer calls this before each step)."""
        self._step = _zero()

    def step_summary(self) -> dict:
        """bytes_sent, bytes_recv, coll_s, pack_s, calls accumulated since begin_step()."""
        return _read(self._step)

    def totals(self) -> dict:
        """Same keys as step_summary(), since creation or the last reset()."""
        return _read(self._total)

    def reset(self) -> None:
        self.calls.clear()
        self._step = _zero()
        self._total = _zero()

    # ---- recording -----------------------------------------------------------------------
    def _add(self, rec: CallRecord, count_call: bool) -> None:
        for acc in (self._step, self._total):
            acc["bytes_sent"] += rec.bytes_sent
            acc["bytes_recv"] += rec.bytes_recv
            acc["coll_s"].extend(rec.coll)
            acc["pack_s"].extend(rec.pack)
            acc["calls"] += int(count_call)
        self.calls.append(rec)
        if len(self.calls) > self.max_calls:
            del self.calls[: len(self.calls) - self.max_calls]

    def add_bytes(self, name: str, sent: int, recv: int, coll_s: float = 0.0) -> None:
        """Book a call made elsewhere (e.g. an exchange run by a background thread whose own
        timing is overlapped with compute): its bytes, and the seconds the caller was exposed to."""
        rec = CallRecord(name, sent, recv)
        if coll_s:
            rec.coll.append(coll_s)
        self._add(rec, count_call=True)

    @contextlib.contextmanager
    def call(self, name: str, device: torch.device | None = None) -> Iterator["CallTimer"]:
        """Record one public collective call; the body books time through the yielded timer."""
        timer = CallTimer(CallRecord(name), device, self.timing)
        yield timer
        self._add(timer.record, count_call=True)

    @contextlib.contextmanager
    def timed_pack(self, device: torch.device | None = None) -> Iterator[None]:
        """Book the body's time as pack/quantize seconds (for callers outside comm/, e.g. the
        optimizer's quantizer). Pass `device` for CUDA work so it is timed with events."""
        rec = CallRecord("pack")
        clock = Clock(device) if self.timing else None
        t0 = clock.start() if clock else None
        try:
            yield
        finally:
            if clock:
                rec.pack.append(clock.stop(t0))
            self._add(rec, count_call=False)


class CallTimer:
    """Books seconds and bytes of one call into its CallRecord."""

    def __init__(self, record: CallRecord, device: torch.device | None, timing: bool = True) -> None:
        self.record = record
        self.clock = Clock(device) if timing else None

    @contextlib.contextmanager
    def _timed(self, spans: list) -> Iterator[None]:
        if self.clock is None:
            yield
            return
        t0 = self.clock.start()
        try:
            yield
        finally:
            spans.append(self.clock.stop(t0))

    def pack(self) -> contextlib.AbstractContextManager[None]:
        """Time packing/unpacking/quantizing work as pack seconds."""
        return self._timed(self.record.pack)

    def coll(self, sent: torch.Tensor | list | tuple | None = None,
             recv: torch.Tensor | list | tuple | None = None) -> contextlib.AbstractContextManager[None]:
        """Time a torch.distributed call and count the bytes of the tensors handed to it."""
        self.record.bytes_sent += _nbytes(sent)
        self.record.bytes_recv += _nbytes(recv)
        return self._timed(self.record.coll)


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
