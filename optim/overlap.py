"""Buckets, and communication overlapped with backward (the DDP reducer's behaviour, over our flat
buffers), for every optimizer that can exchange its vector in parts.

Buckets are runs of whole parameters in the order backward finishes their gradients (the reverse
of the model's order), about `bucket_bytes` each. With buckets, the exchange runs once per bucket,
in bucket order, whether or not it overlaps:
- gradient sync: bucket k is a contiguous slice of the flat gradient buffer (model order), mean-
  allreduced on its own;
- update sync (Lion Cub): the optimizer's role-ordered layout is laid out in bucket order instead,
  and the vector of bucket k (c = b1 m + (1 - b1) g, element-wise) is exchanged on its own.
So results with and without overlap are bit-identical for the same buckets (without buckets, one
bucket is the whole vector, as before).

With overlap, every parameter gets a post-accumulate-grad hook; when the last gradient of a bucket
is final (on the last micro-batch of an accumulation, `expect_backward(final=True)`), the bucket's
exchange is launched while backward goes on: an asynchronous allreduce for the mean schemes (their
`start`), or, for multi-stage exchanges (the 1-bit vote, the p-bit sum), a job on one background
thread that runs the buckets' exchanges in order. `finish` (at the optimizer step) launches what is
left, waits, and books the bytes with the seconds the step was actually exposed to as collective
time (the background seconds go to the "overlapped" record, not the step's communication).

Limits: every rank must finish the buckets' gradients in the same order (true for one autograd
graph on every rank); a parameter without a gradient keeps its bucket open until the step, which
then launches it (all ranks alike). Main-thread collectives never run while a background exchange
is in flight: `finish` waits for all of them first.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from comm import Clock, CommStats

from .accounting import BACKGROUND
from .sync import Exchange, ExchangeContext


class Handle(Protocol):
    def wait(self) -> Any: ...


@dataclass(kw_only=True)
class Bucket:
    """A run of whole parameters, the part [lo, hi) of the flat vector it owns, and its state in
    the current step."""

    index: int
    params: list[torch.nn.Parameter]
    """In the order backward completes them."""
    lo: int = 0
    hi: int = 0
    rows: int = 0
    """Rows of its tensors (mask_zero_updates' flags, the byte formula); counted once."""
    pending: int = 0
    launched: bool = False
    handle: Handle | None = None
    result: Any = None

    def start(self, exchange: Exchange, step: int, overlap: bool, submit: Callable[..., Handle]) -> Handle:
        raise NotImplementedError  # pragma: no cover - interface


@dataclass(kw_only=True)
class GradientBucket(Bucket):
    """A slice of a flat gradient buffer, mean-allreduced in place (asynchronously with overlap)."""

    buf: torch.Tensor
    """The flat gradient buffer (optim.layout.GradBuffers) this bucket is buf[lo:hi] of."""

    def start(self, exchange: Exchange, step: int, overlap: bool, submit: Callable[..., Handle]) -> Handle:
        view = self.buf[self.lo:self.hi]
        return exchange.start(view, step) if overlap else Done(exchange(view, step))


@dataclass(kw_only=True)
class UpdateBucket(Bucket):
    """A part of the optimizer's update vector (bucket-ordered layout), made by `vector(bucket)` and
    exchanged on its own context (ExchangeContext.restrict); with overlap on the background thread."""

    vector: Callable[["UpdateBucket"], torch.Tensor]
    ctx: ExchangeContext
    ctx_bg: ExchangeContext
    """ctx booking into the background stats (BACKGROUND)."""

    def start(self, exchange: Exchange, step: int, overlap: bool, submit: Callable[..., Handle]) -> Handle:
        vec = self.vector(self)
        if overlap:
            return submit(exchange, vec, step, self.ctx_bg)
        return Done(exchange(vec, step, self.ctx))


def _rows(params: list[torch.nn.Parameter]) -> int:
    return sum(p.shape[0] if p.ndim >= 2 else 1 for p in params)


def plan(params_model_order: list[torch.nn.Parameter], bucket_bytes: float) -> list[list[torch.nn.Parameter]]:
    """Runs of whole parameters in reverse model order, each about `bucket_bytes` (the last one may
    be smaller); bucket_bytes <= 0: one bucket of everything (in model order)."""
    if bucket_bytes <= 0:
        return [list(params_model_order)]
    out, cur, size = [], [], 0
    for p in reversed(params_model_order):
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def gradient_buckets(order: list[torch.nn.Parameter], bucket_bytes: float,
                     buffers: dict[torch.dtype, torch.Tensor]) -> list[Bucket]:
    """The buckets of the flat gradient buffers (each parameter's .grad a view of its dtype's
    buffer): `plan` per dtype, each bucket the contiguous slice its parameters' views span."""
    buckets: list[Bucket] = []
    for dtype, buf in buffers.items():
        ps, base = [p for p in order if p.dtype == dtype], buf.data_ptr()
        for run in plan(ps, bucket_bytes):
            offs = [(p.grad.data_ptr() - base) // p.grad.element_size() for p in run]
            lo, hi = min(offs), max(o + p.numel() for o, p in zip(offs, run))
            buckets.append(GradientBucket(index=len(buckets), params=run, lo=lo, hi=hi, rows=_rows(run), buf=buf))
    return buckets


def update_buckets(order: list[torch.nn.Parameter], bucket_bytes: float, ctx: ExchangeContext,
                   background: CommStats, vector: Callable[[UpdateBucket], torch.Tensor]) -> list[Bucket]:
    """The buckets of an update vector laid out in bucket order (`update_order`): bucket k is the
    next run of `plan`, with its part of the exchange context."""
    buckets: list[Bucket] = []
    off = 0
    for run in plan(order, bucket_bytes):
        n = sum(p.numel() for p in run)
        part = ctx.restrict(off, off + n)
        buckets.append(UpdateBucket(index=len(buckets), params=run, lo=off, hi=off + n, rows=_rows(run),
                                    vector=vector, ctx=part, ctx_bg=dataclasses.replace(part, stats=background)))
        off += n
    return buckets


def update_order(order: list[torch.nn.Parameter], bucket_bytes: float) -> list[torch.nn.Parameter]:
    """The order of an update vector exchanged in buckets: every bucket one contiguous part."""
    return [p for b in plan(order, bucket_bytes) for p in b]


class Overlap:
    """The buckets of one optimizer, their hooks, launches and waits.

    Each bucket starts its own part of `exchange` (`Bucket.start`, a handle with .wait() -> result);
    book(bucket) -> (name, sent, recv) says what it puts on the wire (booked at finish)."""

    def __init__(self, buckets: list[Bucket], exchange: Exchange,
                 book: Callable[[Bucket], tuple[str, int, int]], stats: CommStats, clock: Clock,
                 overlap: bool) -> None:
        self.buckets, self.exchange, self.book, self.stats, self.clock = buckets, exchange, book, stats, clock
        self.overlap = overlap
        self.final = True
        self.step = 0
        self._of = {id(p): b for b in buckets for p in b.params}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._hooks = []
        if overlap:
            for b in buckets:
                for p in b.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._reset()

    def _reset(self) -> None:
        for b in self.buckets:
            b.pending, b.launched, b.handle, b.result = len(b.params), False, None, None

    def expect_backward(self, final: bool, step: int) -> None:
        """Before a backward: is it the last micro-batch of this step's accumulation?"""
        self.final, self.step = final, step

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self.final:
            return
        b = self._of[id(p)]
        b.pending -= 1
        if b.pending == 0:
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        b.handle = b.start(self.exchange, self.step, self.overlap, self.submit)

    def submit(self, fn: Callable, *args) -> Handle:
        """Run `fn(*args)` on the background thread, in submission order; returns a handle."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lioncub-comm")
        return _Future(self._pool.submit(fn, *args))

    def finish(self, step: int) -> list:
        """Launch every bucket not launched yet (in bucket order), wait for all; with overlap, book
        the bytes and the seconds the step was exposed to (without overlap each exchange ran in
        the step and booked itself). Returns the buckets' results in bucket order."""
        self.step = step
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        t0 = self.clock.start()
        results = [b.handle.wait() for b in self.buckets]
        if self.overlap:
            exposed = self.clock.stop(t0)
            for k, b in enumerate(self.buckets):
                name, sent, recv = self.book(b)
                self.stats.add_bytes(name, sent, recv, coll_s=exposed if k == 0 else 0.0)
        self._reset()
        return results

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class _Future:
    def __init__(self, fut: concurrent.futures.Future) -> None:
        self.fut = fut

    def wait(self):
        return self.fut.result()


class Done:
    """A handle of work that already ran (synchronous exchanges without overlap)."""

    def __init__(self, result) -> None:
        self.result = result

    def wait(self):
        return self.result


__all__ = ["BACKGROUND", "Bucket", "Done", "GradientBucket", "Handle", "Overlap", "UpdateBucket", "gradient_buckets",
           "plan", "update_buckets", "update_order"]
