"""The per-step divergence guard: before anything is exchanged, every rank says whether its loss or
local gradient is non-finite and whether it wants to stop (a signal), and all ranks agree.

Both answers ride on ONE 4-byte word per rank and one SUM-allreduce: bits 0-15 count the ranks
that saw a non-finite value, bits 16 and up the ranks that asked to stop. With fewer than 2^15
ranks neither lane overflows into the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import comm
from comm import CommStats

STOP_SHIFT = 16
"""The stop lane starts at this bit; the non-finite lane is the bits below it."""


@dataclass(frozen=True)
class Verdict:
    """What every rank agreed on."""

    nonfinite: bool
    """Some rank saw a non-finite loss or gradient: nothing may be exchanged or updated."""
    stop: bool
    """Some rank asked to stop."""


def encode(bad: torch.Tensor, stop: bool) -> torch.Tensor:
    """This rank's word: `bad` (a 0-d bool tensor, left on the device) in the low lane, `stop` above."""
    return bad.reshape(1).to(torch.int32) + ((1 << STOP_SHIFT) if stop else 0)


def decode(word: int) -> Verdict:
    """The agreement from the summed word."""
    return Verdict(nonfinite=bool(word % (1 << STOP_SHIFT)), stop=bool(word >> STOP_SHIFT))


class Guard:
    """The guard of one optimizer: its replicate group and, under hybrid sharding, the shard group
    that holds the other shards of the same parameters (their counts add up first)."""

    def __init__(self, group: Any, stats: CommStats, shard_group: Any = None) -> None:
        self.group, self.stats, self.shard_group = group, stats, shard_group

    def __call__(self, local_grad_norm: torch.Tensor, loss_finite: bool, stop: bool) -> Verdict:
        """Agree on (any rank non-finite, any rank stopping); one host read, the step's only one."""
        bad = torch.logical_not(torch.isfinite(local_grad_norm)) | (not loss_finite)
        word = encode(bad, stop)
        if self.shard_group is not None:
            word = comm.allreduce_packed_(word, group=self.shard_group, stats=self.stats, name="guard_shards")
        word = comm.allreduce_packed_(word, group=self.group, stats=self.stats, name="guard")
        return decode(int(word.item()))


__all__ = ["Guard", "STOP_SHIFT", "Verdict", "decode", "encode"]
