"""Gradient-sync schemes: a mean-allreduce of the flat gradient in fp32 or bf16 (one collective
per flat buffer, Lion Cub App. D.2); every rank then steps one shared optimizer state."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import comm
from comm import cost_model

from .registry import GRADIENT, MEAN, Exchange, ExchangeContext, SchemeOptions, SyncScheme, register


@dataclass
class MeanOptions(SchemeOptions):
    """fp32 and bf16 have no options."""


class MeanAllreduce(Exchange):
    """In-place mean over ranks of a flat buffer, `wire_dtype` on the wire."""

    def __init__(self, wire_dtype: torch.dtype, ctx: ExchangeContext) -> None:
        self.wire_dtype, self.ctx = wire_dtype, ctx

    def __call__(self, x: torch.Tensor, step: int) -> torch.Tensor:
        if self.ctx.world_size == 1:  # the mean of one rank is x itself: no cast, no call
            return x
        return comm.allreduce_mean(x, wire_dtype=self.wire_dtype, group=self.ctx.group, stats=self.ctx.stats,
                                   inplace=x.is_contiguous())

    def start(self, x: torch.Tensor, step: int) -> "AsyncMean":
        """Launch the mean of contiguous `x` in place without waiting (an asynchronous SUM
        allreduce); `.wait()` finishes it with the same operations as __call__, so the result is
        bit-identical. Bytes and seconds are booked by the caller (it knows what is exposed)."""
        if self.ctx.world_size == 1:
            return AsyncMean(None, x, x, 1)
        buf = x if self.wire_dtype == x.dtype else x.to(self.wire_dtype, copy=True)
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.ctx.group, async_op=True)
        return AsyncMean(work, x, buf, self.ctx.world_size)


class AsyncMean:
    def __init__(self, work, x: torch.Tensor, buf: torch.Tensor, P: int) -> None:
        self.work, self.x, self.buf, self.P = work, x, buf, P

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            if self.buf is not self.x:
                self.x.copy_(self.buf)
            self.x.div_(self.P)
            self.work = None
        return self.x


def _scheme(name: str, dtype: torch.dtype, bits: int, wire: str) -> SyncScheme:
    nbytes = bits // 8
    return SyncScheme(
        name=name, kind=GRADIENT, result=MEAN, options=MeanOptions,
        build=lambda o, ctx: MeanAllreduce(dtype, ctx),
        wire_bytes=lambda o, P, n, rank, rows: (nbytes * n, nbytes * n),
        predict=lambda o, P, n, alpha, beta, rows=1: cost_model.ring_allreduce(P, n, bits, alpha, beta),
        wire=wire, bucketable=True,  # element-wise: a bucket's mean is the mean of the bucket
        help=f"mean-allreduce of the flat gradient in {name} (gradient sync)")


FP32 = register(_scheme("fp32", torch.float32, 32, "the flat gradient, fp32 (ring allreduce)"))
BF16 = register(_scheme("bf16", torch.bfloat16, 16, "the flat gradient, bf16 (ring allreduce)"))
