"""Lion Cub's p-bit direct allreduce (§3 "direct allreduce", §4.2 eq. 1, App. F.1): every rank
quantizes its local update c_i to integers in [-L, L], the integers are SUM-allreduced in packed
`bits`-wide lanes (exact while P * 2L <= 2**bits - 1), and every rank applies sign(sum), an exact
tie giving 0.

Levels: the largest L with P * 2L <= 2**bits - 1 (capped at 127: votes travel as int8) unless
`levels` is set; L == 0 means signs only: tb(c) sent as 0/1 flags (Lion Cub 4-bit at 8 workers,
"workers only send 1/-1 values"), the sum 2 * count_plus - P. `effective_levels` is the project's
one rule for L; the config, the optimizer and the cost model all call it.

Quantization is per parameter tensor: each tensor gets its own M_p (Lion Cub Fig. 3: update
magnitudes differ by orders of magnitude between layers; one model-wide M_p would round the
lm_head's updates to 0). Under hybrid sharding (ctx.shard_group) a rank holds a block of rows of
each tensor, and M_p is still the whole tensor's (eq. 1 averages over all its elements): the
shards' partials cross the shard group in one all_gather per step (comm.quantize.sharded_lp_means),
before quantizing; each replica's scale is that of its own c_i. Stochastic rounding draws from a
per-rank generator seeded from the run
seed and the rank, saved with the exchange's state so a resumed run is bit-exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import comm
from comm import cost_model, kernels
from comm.quantize import sharded_lp_means

from ..options import choice
from ..quantize import MAX_LEVELS, ROUNDINGS
from .registry import SIGN, UPDATE, ExchangeContext, SyncScheme, register
from .votes import VoteExchange, VoteOptions, _mask_bytes, _mask_time

QUANTIZER_P = {"sign": None, "l0": 0.0, "l1": 1.0, "l2": 2.0, "linf": math.inf, "lp": None}


def effective_levels(bits: int, world_size: int, levels: int = -1) -> int:
    """L for `bits`-wide lanes at `world_size` ranks: `levels` when set (>= 0), else the largest L
    with P * 2L <= 2**bits - 1, capped at MAX_LEVELS (0 = signs only; also when not even signs fit,
    which the options' checks report)."""
    if levels >= 0:
        return levels
    return max(0, min(comm.max_levels(world_size, bits), MAX_LEVELS))


@dataclass
class PBitOptions(VoteOptions):
    bits: int = 4
    """Lane width on the wire: 1, 2, 4, 8 or 16 bits per element."""
    quantizer: str = "sign"
    """How the local update is quantized: sign, l0, l1, l2, linf or lp (Lion Cub §4.2 eq. 1)."""
    p: float = 1.0
    """With quantizer lp: the norm exponent p (0 = geometric mean, 1 = L1, ...)."""
    levels: int = -1
    """Quantization levels L (values in [-L, L]); -1 = the largest L with P*2L <= 2**bits - 1 (0 = signs only)."""
    clip: float = 2.0
    """Clip ratio of eq. (1) (Lion Cub uses 2)."""
    rounding: str = "nearest"
    """nearest or stochastic (unbiased) rounding."""

    def problems(self, world_size: int | None = None) -> list[str]:
        p = super().problems(world_size)
        choice(p, self.key("bits"), self.bits, comm.INT_BITS)
        choice(p, self.key("quantizer"), self.quantizer, QUANTIZER_P)
        choice(p, self.key("rounding"), self.rounding, ROUNDINGS)
        if self.levels < -1:
            p.append(f"{self.key('levels')}: {self.levels} must be -1 (automatic) or >= 0")
        if self.levels > MAX_LEVELS:
            p.append(f"{self.key('levels')}: {self.levels} exceeds {MAX_LEVELS} (votes travel as int8); use -1 "
                     f"(automatic) or <= {MAX_LEVELS}")
        if not self.clip > 0:
            p.append(f"{self.key('clip')}: {self.clip} must be > 0")
        if self.quantizer == "lp" and not self.p >= 0:
            p.append(f"{self.key('p')}: {self.p} must be >= 0 for {self.key('quantizer')}=lp "
                     "(0 = geometric mean, 1 = L1, ...)")
        if world_size is not None and not p:
            p += self._world_problems(world_size)
        return p

    def _world_problems(self, world: int) -> list[str]:
        lanes = comm.lane_max(self.bits)
        L = effective_levels(self.bits, world, self.levels)
        if L == 0 and comm.max_levels(world, self.bits) < 0:
            better = next((b for b in (2, 4, 8, 16) if comm.max_levels(world, b) >= 0), None)
            return [f"{self.key('bits')}: {self.bits}-bit sign lanes hold at most {lanes} ranks, world size is "
                    f"{world}; use {self.key('bits')}={better}"
                    + (" (Lion Cub uses 8-bit with L1 beyond 15 ranks)" if self.bits == 4 else "")]
        if L == 0 and self.quantizer != "sign":
            better = next((b for b in (2, 4, 8, 16) if comm.max_levels(world, b) >= 1), None)
            return [f"{self.key('bits')}: {self.bits}-bit lanes leave no quantization level for "
                    f"{self.key('quantizer')}={self.quantizer} at {world} ranks (need P*2L <= {lanes}); use "
                    f"{self.key('bits')}={better} or {self.key('quantizer')}=sign"]
        if L > comm.max_levels(world, self.bits):
            return [f"{self.key('levels')}: {L} levels x {world} ranks overflow {self.bits}-bit lanes "
                    f"(P*2L = {world * 2 * L} > {lanes}); use {self.key('levels')}={comm.max_levels(world, self.bits)} "
                    f"or more bits"]
        if self.quantizer == "linf" and self.rounding == "nearest" and L >= 1 and L / self.clip <= 0.5:
            # eq. (1) with M = max|x| maps every element into [-L/clip, L/clip]: all round to 0
            return [f"{self.key('quantizer')}: linf with {L} level(s) and clip {self.clip} rounds every element to 0 "
                    f"at {world} ranks (L / clip <= 0.5): nothing would ever move; use {self.key('quantizer')}=l1, "
                    f"{self.key('rounding')}=stochastic, a smaller {self.key('clip')} or more bits"]
        return []


class PBit(VoteExchange):
    def __init__(self, options: PBitOptions, ctx: ExchangeContext) -> None:
        super().__init__(options, ctx)
        bad = options.problems(ctx.world_size)
        if bad:
            raise ValueError("; ".join(bad))
        self.levels = effective_levels(options.bits, ctx.world_size, options.levels)
        self.exact_zeros = self.levels >= 1
        self.p = QUANTIZER_P[options.quantizer] if options.quantizer != "lp" else options.p
        self.gen = torch.Generator(device=ctx.device)
        self.gen.manual_seed(ctx.seed)

    def aggregate(self, c, step, ctx):
        tb = self.o.tb_step(step)
        dev = c.device if c.is_cuda else None
        # quantize straight into the wire, unpack straight into the int8 sign (comm.kernels: every impl
        # gives the bytes of the reference, quantize -> comm.int_allreduce -> sign; the eager impl, too,
        # without the reference's int32 sums of 4 bytes per element)
        n = c.numel()
        segs = ctx.segments_for(n)
        means = None
        if self.levels >= 1 and self.p is not None and ctx.shard_group is not None \
                and comm.world(ctx.shard_group)[0] > 1:
            # whole-tensor M_p from the shards' partials (one small all_gather on the shard axis;
            # like the gradient norm's reduction there, not booked as replicate-axis wire bytes)
            means = sharded_lp_means(c, segs, self.p, ctx.shard_group)
        with ctx.stats.timed_pack(device=dev):
            wire = kernels.quantize_pack(c, segs, self.levels, self.p, self.o.clip, self.o.bits,
                                         self.o.rounding, self.gen, tb, impl=ctx.kernels, means=means)
        comm.allreduce_packed_(wire, group=ctx.group, stats=ctx.stats, name="int_allreduce")
        with ctx.stats.timed_pack(device=dev):
            return kernels.unpack_sum(wire, self.o.bits, n, self.levels, ctx.world_size, sign=True,
                                      dtype=torch.int8, impl=ctx.kernels)

    def warmup(self) -> float:
        return kernels.warmup(self.ctx.device, bits=(self.o.bits,), levels=(self.levels,), p=(self.p,),
                              rounding=(self.o.rounding,), world_sizes=(self.ctx.world_size,),
                              impl=self.ctx.kernels, layout=self.ctx.segments or None, clip=self.o.clip,
                              agree=True, group=self.ctx.group)

    def state_dict(self) -> dict:
        return {"rng_state": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["rng_state"])

    remaps_state = True  # its state is a generator's: a new rank starts a fresh stream

    def reshard_state(self, states: list[dict]) -> dict:
        """On another world size every rank keeps the fresh stream seeded from the run seed and its
        new rank (stochastic rounding needs independent streams, not the old ones). A saved state that
        is not a generator's (another comm.mode's: error feedback) is refused, not dropped."""
        other = sorted({k for s in states for k in s} - {"rng_state"})
        if other:
            raise ValueError(f"comm.mode exchange {type(self).__name__}: the saved exchange state holds {other}, "
                             f"another mode's; resume with the comm.mode it was written with")
        return {"rng_state": self.gen.get_state()}


def _lane_bytes(bits: int, n: int) -> int:
    if bits == 16:  # two 16-bit lanes per int32 word (neither gloo nor NCCL reduces int16)
        return 4 * comm.ceil_div(n, 2)
    return comm.ceil_div(n * bits, 8)


def _pbit_bytes(o: PBitOptions, P: int, n: int, rank: int, rows: int) -> tuple[int, int]:
    wire = _lane_bytes(o.bits, n) + _mask_bytes(o, rows, effective_levels(o.bits, P, o.levels) == 0)
    return wire, wire


def _pbit_predict(o: PBitOptions, P: int, n: int, a: float, b: float, rows: int = 1) -> float:
    signs_only = effective_levels(o.bits, P, o.levels) == 0
    return cost_model.direct_allreduce(P, n, o.bits, a, b) + _mask_time(o, P, rows, a, b, signs_only)


PBIT = register(SyncScheme(
    name="pbit", kind=UPDATE, result=SIGN, options=PBitOptions,
    build=lambda o, ctx: PBit(o, ctx), wire_bytes=_pbit_bytes, predict=_pbit_predict,
    wire="quantized updates (Lp, eq. 1) summed in packed bits-wide integer lanes (Lion Cub §3, App. F.1)",
    help="Lion Cub p-bit direct allreduce of quantized local updates (update sync)",
    bucketable=True))  # per-tensor scales, and a bucket holds whole tensors
