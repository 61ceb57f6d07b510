"""comm.mode=diloco: DiLoCo and Streaming DiLoCo as a sync scheme of the registry, a local-update
kind (LOCAL): the inner optimizer steps each worker's parameters with nothing crossing the replicate
axis, and every comm.diloco.inner_steps steps (per fragment) the workers average their
pseudo-gradients in a wire format of this module and an outer SGD applies the mean (the outer loop
itself, apart from any trainer: optim/diloco.py; the strategy that runs it after each step:
optim/strategy.py LocalSync).

This module holds what the registry says about the mode, in one place: its options (the
`comm.diloco.*` sub-section: `DiLoCoOptions`, carried by `DiLoCoSchemeOptions` so the keys live
under `comm.diloco` and never clash with another scheme's flat `comm.*` keys such as pbit's
`bits`, `quantizer`, `clip`), the wires of the pseudo-gradient mean and their exact byte formulas
and alpha-beta times (`wire_bytes`, `wire_seconds`, `cycle_bytes`, `cycle_seconds`), the prediction
of a cycle on a model (`fragment_numels`, `predict_cycle`: the entry's predict_cycle), and the
registry entry (a LocalScheme, optim/sync/registry.py). The per-step exchange the base builds
(`OuterExchange`) sends nothing; it carries the outer loop's state into the optimizer's checkpoint
(docs/diloco.md).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

import comm
from comm import cost_model
from comm.e3m0 import e3m0_allreduce_mean, e3m0_bytes, e3m0_chunk_bytes, e3m0_layout
from comm.packing import lane_max
from comm.quantize import segment_lp_means

from ..options import Options
from .registry import (LOCAL, MEAN, Exchange, ExchangeContext, LocalPrediction, LocalScheme, SchemeOptions, SyncScheme,
                       get, register, schemes)

WIRES = ("fp32", "bf16", "loco", "sign", "e3m0", "pbit_mean")
"""Wire formats of the pseudo-gradient average: each gives an estimate of the real-valued mean."""
PBIT_QUANTIZERS = {"linf": math.inf, "l1": 1.0}
PBIT_BITS = (4, 8, 16)


def _wire_scheme(wire: str) -> tuple[SyncScheme, SchemeOptions] | None:
    """The registry scheme and options a wire runs on (None: e3m0 and pbit_mean, which are ours only)."""
    if wire in ("fp32", "bf16"):
        s = get(wire)
        return s, s.default_options()
    if wire == "loco":
        s = get("loco")
        return s, s.options()
    if wire == "sign":
        s = get("compressed")
        return s, s.options(compressor="scaled_sign", scale="mean_abs")
    return None


@dataclass
class DiLoCoOptions(Options):
    """The comm.diloco.* keys (docs/diloco.md)."""

    section = "comm.diloco"

    inner_steps: int = 500
    """H: inner steps of each worker between two syncs of a fragment (DiLoCo: 500)."""
    outer_lr: float = 0.7
    """Learning rate of the outer SGD applied to the averaged pseudo-gradient (DiLoCo: 0.7)."""
    outer_momentum: float = 0.9
    """Momentum of the outer SGD (DiLoCo: 0.9; 0 = plain averaging of the models with outer_lr 1)."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD (DiLoCo); false = heavy ball."""
    fragments: int = 1
    """F: fragments synchronised on staggered offsets (Streaming DiLoCo); 1 = DiLoCo."""
    overlap_steps: int = 0
    """tau: inner steps a fragment's exchange overlaps before its outer step is applied (0 = none)."""
    alpha: float = 0.0
    """Mixing factor: after a fragment's outer step, local = alpha * local + (1 - alpha) * global
    (0 = adopt the global parameters, DiLoCo's reset)."""
    final_average: bool = True
    """At the end of training, average in the steps each fragment trained since its last sync (the
    workers' mean, no outer momentum), so no worker's last inner steps are dropped (train.max_steps
    not a multiple of inner_steps, and every Streaming DiLoCo run); false = the global parameters of
    each fragment's last outer step."""
    wire: str = "fp32"
    """Wire format of the pseudo-gradient average: fp32, bf16, loco (4-bit, error feedback), sign
    (1-bit with a scale per block, error feedback), e3m0 (4-bit float, Streaming DiLoCo) or
    pbit_mean (Lion Cub's integer lanes with a shared scale per block)."""
    block: int = 2048
    """Elements per fp32 scale of the loco, sign, e3m0 and pbit_mean wires (a positive multiple of 8)."""
    bits: int = 8
    """pbit_mean: lane width (4, 8 or 16 bits); the levels are the largest L with P * 2L <= 2**bits - 1."""
    quantizer: str = "linf"
    """pbit_mean: the block's scale M_p of Lion Cub eq. 1: linf (max |x|, nothing clipped) or l1 (mean |x|)."""
    clip: float = 1.0
    """pbit_mean: clip ratio of eq. 1 (values beyond clip * M_p saturate at +-L; 1 with linf clips nothing)."""

    def problems(self, world_size: int | None = None, blocks: int | None = None) -> list[str]:
        """Every problem of these options; `blocks`: the model's transformer blocks (fragments are
        made of whole blocks), checked when given."""
        p: list[str] = []

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        H = self.inner_steps
        if not is_int(H) or H < 1:
            p.append(f"{self.key('inner_steps')}: {H!r} must be an integer >= 1 (inner steps between syncs; "
                     f"DiLoCo uses 500)")
        if not (isinstance(self.outer_lr, (int, float)) and math.isfinite(self.outer_lr) and self.outer_lr > 0):
            p.append(f"{self.key('outer_lr')}: {self.outer_lr!r} must be a positive number (DiLoCo: 0.7)")
        if not (isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1):
            p.append(f"{self.key('outer_momentum')}: {self.outer_momentum!r} must be in [0, 1) (DiLoCo: 0.9)")
        if not isinstance(self.nesterov, bool):
            p.append(f"{self.key('nesterov')}: {self.nesterov!r} must be true or false")
        if not isinstance(self.final_average, bool):
            p.append(f"{self.key('final_average')}: {self.final_average!r} must be true or false")
        F = self.fragments
        if not is_int(F) or F < 1:
            p.append(f"{self.key('fragments')}: {F!r} must be an integer >= 1 (1 = DiLoCo, F > 1 = Streaming "
                     f"DiLoCo's fragments)")
        else:
            if blocks is not None and F > blocks:
                p.append(f"{self.key('fragments')}: {F} fragments but the model has {blocks} blocks (a fragment "
                         f"is made of whole blocks); use at most {blocks}")
            if is_int(H) and H >= 1 and F > H:
                p.append(f"{self.key('fragments')}: {F} fragments need distinct offsets within the "
                         f"{self.key('inner_steps')}={H} steps of a cycle; use at most {H} fragments or more "
                         f"inner steps")
        tau = self.overlap_steps
        if not is_int(tau) or tau < 0:
            p.append(f"{self.key('overlap_steps')}: {tau!r} must be an integer >= 0 (0 = no overlap)")
        elif is_int(H) and H >= 1 and tau >= H:
            p.append(f"{self.key('overlap_steps')}: {tau} must be < {self.key('inner_steps')}={H} (a fragment's "
                     f"average must arrive before its next pseudo-gradient is sent)")
        if not (isinstance(self.alpha, (int, float)) and 0 <= self.alpha <= 1):
            p.append(f"{self.key('alpha')}: {self.alpha!r} must be in [0, 1] (0 = adopt the global parameters)")
        if self.wire not in WIRES:
            known = {s.name: s for s in schemes()}
            if self.wire in known and known[self.wire].result != MEAN:
                p.append(f"{self.key('wire')}: {self.wire!r} returns a sign vote, not a mean, so it cannot carry "
                         f"the average of the pseudo-gradients; use one of {', '.join(WIRES)}")
            else:
                p.append(f"{self.key('wire')}: {self.wire!r} is not one of {', '.join(WIRES)}")
        if not is_int(self.block) or self.block <= 0 or self.block % 8:
            p.append(f"{self.key('block')}: {self.block!r} must be a positive multiple of 8 (elements per fp32 "
                     f"scale of the loco, sign, e3m0 and pbit_mean wires; e.g. 2048, about one weight row)")
        if self.wire == "pbit_mean":
            if self.bits not in PBIT_BITS:
                p.append(f"{self.key('bits')}: {self.bits!r} is not one of {', '.join(map(str, PBIT_BITS))} "
                         f"(pbit_mean needs at least one quantization level per rank)")
            elif world_size is not None and comm.max_levels(world_size, self.bits) < 1:
                better = next((b for b in PBIT_BITS if comm.max_levels(world_size, b) >= 1), None)
                p.append(f"{self.key('bits')}: {self.bits}-bit lanes leave no quantization level at {world_size} "
                         f"workers (need P * 2L <= {lane_max(self.bits)})"
                         + (f"; use {self.key('bits')}={better}" if better else "; use another wire"))
            if self.quantizer not in PBIT_QUANTIZERS:
                p.append(f"{self.key('quantizer')}: {self.quantizer!r} is not one of {', '.join(PBIT_QUANTIZERS)}")
            if not (isinstance(self.clip, (int, float)) and math.isfinite(self.clip) and self.clip > 0):
                p.append(f"{self.key('clip')}: {self.clip!r} must be a positive number (1 with linf clips nothing)")
        return p

    def check(self, world_size: int | None = None, blocks: int | None = None) -> "DiLoCoOptions":
        """Raise ValueError with every problem, one per line; return self when there is none."""
        bad = self.problems(world_size, blocks)
        if bad:
            raise ValueError("\n".join(bad))
        return self

    def offsets(self) -> list[int]:
        """o_k: the inner step (1-based) of fragment k's first sync; then every inner_steps steps."""
        return [((k + 1) * self.inner_steps) // self.fragments for k in range(self.fragments)]

    def due(self, t: int, delay: int = 0) -> list[int]:
        """The fragments whose pseudo-gradient is sent after inner step t (delay 0), or whose outer step is
        applied after it (delay overlap_steps)."""
        H = self.inner_steps
        return [k for k, o in enumerate(self.offsets()) if t - delay >= o and (t - delay - o) % H == 0]

    def wire_options(self) -> SchemeOptions | None:
        ws = _wire_scheme(self.wire)
        if ws is None:
            return None
        scheme, opts = ws
        if "block" in type(opts).field_names():
            opts = dataclasses.replace(opts, block=self.block)
        return opts



# ---- wires ------------------------------------------------------------------------------------

class E3M0Exchange(Exchange):
    """The E3M0 4-bit float mean of comm.e3m0 as an Exchange (stateless: no error feedback)."""

    def __init__(self, block: int, ctx: ExchangeContext) -> None:
        self.block, self.ctx = block, ctx

    def __call__(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return e3m0_allreduce_mean(x, self.block, group=self.ctx.group, stats=self.ctx.stats)


def _pbit_lane_bytes(bits: int, n: int) -> int:
    """Bytes of n values in `bits`-wide lanes as comm.int_allreduce sends them (16-bit: two per int32)."""
    return 4 * comm.ceil_div(n, 2) if bits == 16 else comm.ceil_div(n * bits, 8)


class PBitMeanExchange(Exchange):
    """A real mean through Lion Cub's integer lanes (App. F.1): per block of `block` elements,
    M = M_p of the block (eq. 1; linf or l1), the ranks agree on the largest M (one fp32 MAX
    allreduce of the block scales), each quantizes q = clamp(round(L / (clip * M) * x), -L, L)
    (round half to even) with L = comm.max_levels(P, bits), comm.int_allreduce sums the q exactly,
    and the mean is sum * (clip * M / L) / P, identical on every rank. Stateless (no error
    feedback): with linf and clip 1 nothing saturates and the error is at most half a level per
    rank, clip * M / (2L)."""

    def __init__(self, options: DiLoCoOptions, ctx: ExchangeContext) -> None:
        bad = options.problems(ctx.world_size)
        if bad:
            raise ValueError("\n".join(bad))
        self.o, self.ctx = options, ctx
        self.levels = comm.max_levels(ctx.world_size, options.bits)
        self.p = PBIT_QUANTIZERS[options.quantizer]

    def __call__(self, x: torch.Tensor, step: int) -> torch.Tensor:
        o, ctx, L = self.o, self.ctx, self.levels
        flat = x.detach().reshape(-1).to(torch.float32)
        n, B = flat.numel(), o.block
        sizes = [min(B, n - a) for a in range(0, n, B)]
        M = segment_lp_means(flat, [(i * B, m) for i, m in enumerate(sizes)], self.p).to(torch.float32)
        with ctx.stats.call("pbit_mean_scales") as timer:
            if ctx.world_size > 1:
                with timer.coll(sent=M, recv=M):
                    dist.all_reduce(M, op=dist.ReduceOp.MAX, group=ctx.group)
        with ctx.stats.timed_pack():
            per = torch.tensor(sizes, device=flat.device)
            unit = torch.where(M > 0, o.clip * M / L, 0.0)            # the value of one level
            inv = torch.where(M > 0, L / (o.clip * M), 0.0)
            q = (flat * inv.repeat_interleave(per)).round_().clamp_(-L, L)
            q = q.to(torch.int8 if L <= 127 else torch.int32)
        total = comm.int_allreduce(q, L, o.bits, group=ctx.group, stats=ctx.stats)
        return (total.to(torch.float32) * unit.repeat_interleave(per) / ctx.world_size).view(x.shape)


def _pbit_mean_bytes(options: DiLoCoOptions, P: int, n: int) -> tuple[int, int]:
    """The block scales' MAX allreduce (4 bytes a block) and the integer lanes' SUM allreduce."""
    b = 4 * comm.ceil_div(n, options.block) + _pbit_lane_bytes(options.bits, n)
    return b, b


def build_averages(options: DiLoCoOptions, numels: Sequence[int], ctx: ExchangeContext
                   ) -> list[Exchange]:
    """One average per fragment (an exchange holds error feedback sized for its vector), over the
    ranks of ctx.group (the replicate axis), booking bytes into ctx.stats."""
    out: list[Exchange] = []
    for _ in numels:
        ws = _wire_scheme(options.wire)
        if options.wire == "pbit_mean":
            out.append(PBitMeanExchange(options, ctx))
        elif ws is None:
            out.append(E3M0Exchange(options.block, ctx))
        else:
            out.append(ws[0].build(options.wire_options(), ctx))
    return out


def wire_bytes(options: DiLoCoOptions, P: int, n: int) -> tuple[int, int]:
    """Exact (sent, received) bytes of one average of n elements on one rank of P (CommStats' rule)."""
    if P <= 1:
        return 0, 0
    ws = _wire_scheme(options.wire)
    if options.wire == "pbit_mean":
        return _pbit_mean_bytes(options, P, n)
    if ws is None:
        return e3m0_bytes(n, P, options.block)
    return ws[0].bytes_per_call(options.wire_options(), P, n, rank=0)


def wire_seconds(options: DiLoCoOptions, P: int, n: int, alpha: float, beta: float) -> float:
    """Alpha-beta seconds of one average of n elements over P ranks (comm.cost_model)."""
    if P <= 1 or n == 0:
        return 0.0
    ws = _wire_scheme(options.wire)
    if options.wire == "pbit_mean":
        return (cost_model.allreduce_time(P, 32 * comm.ceil_div(n, options.block), alpha, beta)
                + cost_model.direct_allreduce(P, n, options.bits, alpha, beta))
    if ws is None:
        w = e3m0_chunk_bytes(e3m0_layout(n, P, options.block), options.block)
        return cost_model.all_to_all_time(P, 8 * P * w, alpha, beta) + cost_model.all_gather_time(P, 8 * P * w,
                                                                                                alpha, beta)
    return ws[0].predict(options.wire_options(), P, n, alpha, beta)


def _shorter_cycle(o: DiLoCoOptions, max_steps: int) -> str:
    """The fix for a run too short for an outer step: the smallest inner_steps from max_steps // 10 up that
    the options accept (fragments <= inner_steps, overlap_steps < inner_steps, ...) and that gives every
    fragment an outer step, with how many fragment 0 gets; else how long the run must be."""
    for H in range(max(1, max_steps // 10), max_steps + 1):
        c = dataclasses.replace(o, inner_steps=H)
        if c.problems():
            continue
        offs = c.offsets()
        if max(offs) + c.overlap_steps <= max_steps:
            outer = (max_steps - offs[0] - c.overlap_steps) // H + 1
            return (f"set {o.key('inner_steps')} well below train.max_steps (e.g. {H}: {outer} outer step"
                    f"{'s' if outer != 1 else ''}) or train longer")
    least = min(max(1, o.fragments, o.overlap_steps + 1), o.inner_steps)
    c = dataclasses.replace(o, inner_steps=least)
    need = max(c.offsets()) + c.overlap_steps if not c.problems() else o.inner_steps + o.overlap_steps
    return (f"train longer: with {o.key('fragments')}={o.fragments} and {o.key('overlap_steps')}={o.overlap_steps} "
            f"a run needs at least {need} steps for an outer step of every fragment")


@dataclass(frozen=True)
class CycleBytes:
    """Bytes one rank sends / receives over one cycle of H inner steps (every fragment once)."""
    sent: int
    recv: int
    per_inner_step: float
    """sent / H: the average the per-step schemes are compared with."""
    peak_step: int
    """The most bytes sent after one inner step (one fragment's average: what Streaming DiLoCo lowers)."""


def cycle_bytes(options: DiLoCoOptions, P: int, numels: Sequence[int]) -> CycleBytes:
    per = [wire_bytes(options, P, n) for n in numels]
    sent, recv = sum(s for s, _ in per), sum(r for _, r in per)
    return CycleBytes(sent, recv, sent / options.inner_steps, max((s for s, _ in per), default=0))


def cycle_seconds(options: DiLoCoOptions, P: int, numels: Sequence[int], alpha: float, beta: float) -> float:
    """Alpha-beta seconds of one cycle's averages: all exposed when the exchanges run when started;
    with background_averages the overlap_steps inner steps after each send hide part of it."""
    return sum(wire_seconds(options, P, n, alpha, beta) for n in numels)


# ---- the registry entry ------------------------------------------------------------------------
@dataclass
class DiLoCoSchemeOptions(SchemeOptions):
    """comm.mode=diloco's options: one sub-section, comm.diloco (its keys: DiLoCoOptions)."""

    diloco: DiLoCoOptions = field(default_factory=DiLoCoOptions)
    """DiLoCo / Streaming DiLoCo keys, under comm.diloco: inner_steps (H), outer_lr, outer_momentum,
    nesterov, fragments (F), overlap_steps (tau), alpha, wire (fp32, bf16, loco, sign, e3m0,
    pbit_mean), block, bits, quantizer, clip (docs/diloco.md)."""

    def __post_init__(self) -> None:
        if isinstance(self.diloco, dict):  # options handed as a plain mapping (build_optimizer's comm_options)
            unknown = sorted(set(self.diloco) - set(DiLoCoOptions.field_names()))
            if unknown:
                raise ValueError(f"comm.diloco.{unknown[0]}: unknown key; valid keys: "
                                 f"{', '.join(DiLoCoOptions.field_names())}")
            self.diloco = DiLoCoOptions(**self.diloco)

    def problems(self, world_size: int | None = None) -> list[str]:
        if not isinstance(self.diloco, DiLoCoOptions):
            return [f"comm.diloco: expected a mapping of {', '.join(DiLoCoOptions.field_names())}"]
        return self.diloco.problems(world_size)

    def run_problems(self, max_steps: int, *, blocks: int | None = None) -> list[str]:
        """A run too short for an outer step: the workers would train apart throughout and meet once, in
        the final average (with comm.diloco.final_average), which is not DiLoCo; more fragments than the
        model has blocks (given `blocks`: the config check reports it with the others, before a launch)."""
        o = self.diloco
        if not isinstance(o, DiLoCoOptions) or o.problems():
            return []  # reported by problems()
        p = o.problems(blocks=blocks) if blocks is not None else []
        first = min(o.offsets()) + o.overlap_steps
        if max_steps < first:
            what = (f"the first fragment's outer step comes after step {first}" if o.fragments > 1 or o.overlap_steps
                    else f"the first outer step comes after step {first}")
            p += [f"{o.key('inner_steps')}: {o.inner_steps} with train.max_steps={max_steps}: {what}, so the "
                    f"workers would train apart for the whole run and meet only in the final average; "
                    f"{_shorter_cycle(o, max_steps)}"]
        return p

    def notes(self) -> list[str]:
        o = self.diloco
        if isinstance(o, DiLoCoOptions) and o.overlap_steps > 0 and o.alpha == 0:
            return [f"{o.key('alpha')}: 0 with {o.key('overlap_steps')}={o.overlap_steps}: at each fragment's outer "
                    f"step a worker adopts the global parameters, discarding its {o.overlap_steps} inner step(s) "
                    f"taken while the average was in flight (Streaming DiLoCo mixes them back with alpha 0.5, as "
                    f"configs/variants/streaming_diloco.yaml does)"]
        return []

    def as_dict(self) -> dict[str, Any]:
        return {"diloco": self.diloco.as_dict()}


class OuterExchange(Exchange):
    """The per-step exchange of a local-update run: nothing crosses the replicate axis (a worker's
    gradient is its own mean). The strategy attaches the outer loop (`outer`, optim/diloco.py
    OuterLoop) after building it; its state (global parameters, outer momentum, averages in
    flight, the wire's error feedback, this rank's local parameters) rides in the optimizer's
    checkpoint as this exchange's state, per rank."""

    def __init__(self, options: DiLoCoSchemeOptions, ctx: ExchangeContext) -> None:
        self.options, self.ctx = options, ctx
        self.outer: Any = None

    def __call__(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return x

    def state_dict(self) -> dict:
        return self.outer.state_dict() if self.outer is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.outer is None:
            super().load_state_dict(state)
        elif not state:
            raise ValueError("comm.mode=diloco: the checkpoint holds no outer state (global parameters, outer "
                             "momentum); it was written by another comm.mode")
        else:
            self.outer.load_state_dict(state)


def _even(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if k < n % parts else 0) for k in range(parts)]


def _mean_wire_bytes(options: DiLoCoSchemeOptions, P: int, n: int, rank: int = 0, rows: int = 1) -> tuple[int, int]:
    """Bytes per inner step, averaged over a cycle (rounded down), for n elements split evenly into
    the F fragments (the exact per-fragment numbers: cycle_bytes on the model's fragments)."""
    o = options.diloco
    cb = cycle_bytes(o, P, _even(n, o.fragments))
    return cb.sent // o.inner_steps, cb.recv // o.inner_steps


def _mean_seconds(options: DiLoCoSchemeOptions, P: int, n: int, alpha: float, beta: float, rows: int = 1) -> float:
    """Alpha-beta seconds per inner step, a cycle's exchanges (all exposed) spread over its H steps."""
    o = options.diloco
    return cycle_seconds(o, P, _even(n, o.fragments), alpha, beta) / o.inner_steps


def strided_assignment(block_sizes: Sequence[int], rest_sizes: Sequence[int], fragments: int) -> tuple[list[int], list[int]]:
    """Streaming DiLoCo's strided pattern as indices: block i goes to fragment i % F; each element
    count of `rest` (embeddings, final norm, head), in order, to the fragment with the fewest
    elements so far (the first such on a tie). Returns (fragment of each block, fragment of each
    rest entry); optim.diloco.strided_fragments applies it to tensors, fragment_numels to sizes."""
    F = fragments
    if F < 1 or F > len(block_sizes):
        raise ValueError(f"comm.diloco.fragments: {F} fragments but the model has {len(block_sizes)} blocks; "
                         f"use 1 to {len(block_sizes)}")
    of_block = [i % F for i in range(len(block_sizes))]
    sizes = [0] * F
    for i, n in enumerate(block_sizes):
        sizes[of_block[i]] += n
    of_rest = []
    for n in rest_sizes:
        k = min(range(F), key=lambda j: (sizes[j], j))
        of_rest.append(k)
        sizes[k] += n
    return of_block, of_rest


def fragment_numels(options: DiLoCoOptions, params: Sequence[tuple[str, int]]) -> list[int]:
    """Elements per fragment of a model whose parameters are `params`, (layer, numel) in the model's
    order (layer "block.<i>" inside transformer block i, "" outside): strided_assignment's rule on
    sizes; a model without blocks is one block, as OuterLoop.for_optimizer has it."""
    blocks: dict[int, int] = {}
    rest: list[int] = []
    for layer, n in params:
        if str(layer).startswith("block."):
            i = int(str(layer).split(".", 1)[1])
            blocks[i] = blocks.get(i, 0) + n
        else:
            rest.append(n)
    ordered = [blocks[i] for i in sorted(blocks)]
    if not ordered:
        ordered, rest = [sum(rest)], []
    options.check(blocks=len(ordered))
    of_block, of_rest = strided_assignment(ordered, rest, options.fragments)
    sizes = [0] * options.fragments
    for k, n in zip([*of_block, *of_rest], [*ordered, *rest]):
        sizes[k] += n
    return sizes


def predict_cycle(options: DiLoCoOptions, P: int, numels: Sequence[int], alpha: float, beta: float, *,
                  step_compute_s: float = 0.0, background: bool = False) -> LocalPrediction:
    """DiLoCo's communication per inner step over P workers (the replicate axis) for fragments of
    `numels` elements, from wire_seconds / cycle_bytes per fragment. An exchange that runs when it
    is started is exposed whole; with `background` (optim.diloco.background_averages, which the
    trainer uses whenever overlap_steps > 0) the overlap_steps inner steps of `step_compute_s` each
    that follow a send hide up to that much of it. The cycle's exchanges are divided over its
    inner_steps steps, so the per-step schemes (optimizer.predict_comm_seconds) and DiLoCo rank on
    one axis."""
    options.check(world_size=P)
    H = options.inner_steps
    wire = [wire_seconds(options, P, n, alpha, beta) for n in numels]
    hidden = options.overlap_steps * step_compute_s if background else 0.0
    exposed = sum(max(0.0, w - hidden) for w in wire)
    cb = cycle_bytes(options, P, numels)
    return LocalPrediction(cycle_steps=H, comm_s=exposed / H, cycle_comm_s=exposed, wire_s=sum(wire),
                           bytes_per_step=cb.per_inner_step, peak_step_bytes=cb.peak_step, cycle_bytes=cb.sent)


def _predict_local(options: DiLoCoSchemeOptions, P: int, params: Sequence[tuple[str, int]], alpha: float,
                   beta: float, step_compute_s: float, background: bool) -> LocalPrediction:
    """The registry's predict_cycle: predict_cycle on the model's strided fragments (fragment_numels)."""
    o = options.diloco
    return predict_cycle(o, P, fragment_numels(o, params), alpha, beta, step_compute_s=step_compute_s,
                         background=background)


def _cycle_steps(options: DiLoCoSchemeOptions) -> int:
    """H: every fragment's average is sent once in any comm.diloco.inner_steps consecutive inner steps."""
    return options.diloco.inner_steps


def in_flight(o: DiLoCoOptions) -> int:
    """The most fragment averages in flight at once: fragment k's is from its send after step
    o_k + mH until its outer step tau steps later, so with tau > H / F several overlap."""
    if not o.overlap_steps:
        return 0
    H, offs = o.inner_steps, o.offsets()
    return max(sum(1 for ok in offs if (t - ok) % H < o.overlap_steps) for t in range(H))


def _state_bytes(options: DiLoCoSchemeOptions, P: int, n: int) -> int:
    """fp32 global parameters and outer momentum (8 n); each average in flight when exchanges overlap
    inner steps (`in_flight` of them at most), its fp32 pseudo-gradient and its fp32 result (8 bytes per
    element of a fragment: an upper bound, the fp32 wire averages in place); and the wire's own error
    feedback (loco, sign)."""
    o = options.diloco
    own = 8 * n + 8 * comm.ceil_div(n, o.fragments) * in_flight(o)
    ws = _wire_scheme(o.wire)
    if ws is not None and ws[0].state_bytes is not None:
        own += ws[0].state_bytes(o.wire_options(), P, comm.ceil_div(n, o.fragments)) * o.fragments
    return own


def _buffers(options: DiLoCoSchemeOptions, P: int, n: int, layout: Sequence[tuple[str, int]] | None = None) -> int:
    """The largest fragment's average at once: its fp32 pseudo-gradient and fp32 result (8 bytes an element;
    an upper bound: the fp32 wire averages in place) and the wire's sent and received bytes for it. The
    largest fragment from the model's layout (fragment_numels: the embedding and head join one fragment),
    else the whole vector for F > 1 (an upper bound: without the layout the largest is unknown). An average
    in flight past its send is state (`_state_bytes`), not counted here."""
    o = options.diloco
    nf = max(fragment_numels(o, layout)) if layout and o.fragments > 1 else n
    return 8 * nf + sum(wire_bytes(o, P, nf))


def _model_changes(options: DiLoCoSchemeOptions, max_steps: int) -> list[int]:
    """The steps after which the global parameters (what a DiLoCo run evaluates) change: each fragment's
    outer step (tau steps after its send), and the end (the averages in flight and the final average)."""
    o = options.diloco
    return [t for t in range(1, max_steps) if o.due(t, o.overlap_steps)] + ([max_steps] if max_steps >= 1 else [])


register(LocalScheme(
    name="diloco", kind=LOCAL, result=MEAN, options=DiLoCoSchemeOptions, build=OuterExchange,
    wire_bytes=_mean_wire_bytes, predict=_mean_seconds,
    wire="nothing per step; every comm.diloco.inner_steps steps per fragment, the mean pseudo-gradient in "
         "comm.diloco.wire (fp32, bf16, loco, sign, e3m0, pbit_mean); bytes: the average per inner step",
    help="DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (2025): H local steps of any optimizer per "
         "worker, then an outer Nesterov SGD on the averaged pseudo-gradient",
    state_bytes=_state_bytes, shards=True, bucketable=False, cycle=_cycle_steps, predict_cycle=_predict_local,
    model_changes=_model_changes, buffers=_buffers))

__all__ = ["LOCAL", "LocalScheme", "PBIT_BITS", "PBIT_QUANTIZERS", "WIRES", "CycleBytes", "DiLoCoOptions", "DiLoCoSchemeOptions",
           "E3M0Exchange", "OuterExchange", "PBitMeanExchange", "build_averages", "cycle_bytes", "cycle_seconds",
           "fragment_numels", "predict_cycle", "wire_bytes", "wire_seconds"]
