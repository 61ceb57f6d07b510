"""DiLoCo and Streaming DiLoCo: the outer loop of a local-update method, apart from any trainer.

DiLoCo (Douillard et al. 2023, Alg. 1): every worker starts from the global parameters theta,
runs H inner steps of its own optimizer on its own data with no cross-worker traffic, then the
workers average the pseudo-gradient (outer gradient) Delta_i = theta - theta_i (global minus local)
and an outer SGD with Nesterov momentum applies the average to theta:

    m     <- mu * m + Delta               (Delta = mean_i Delta_i, outer momentum mu)
    u     =  Delta + mu * m   (nesterov)  or  m  (heavy ball; u = Delta when mu = 0)
    theta <- theta - outer_lr * u
    theta_i <- theta                      (every worker restarts from the new global parameters)

(torch.optim.SGD(nesterov=True, dampening=0) with `Delta` as the gradient does the same; the paper
uses H = 500, outer_lr 0.7, mu 0.9.)

Streaming DiLoCo (Douillard et al. 2025): the parameters split into F fragments, fragment k made of
the transformer blocks k, k + F, k + 2F, ... (the paper's strided pattern; the parameters outside the
blocks join the fragment that is smallest at that point, so the largest fragment, which sets the
peak bytes of a step, stays as small as it can). Fragment k is synchronised every H inner steps,
at its own offset o_k = floor((k + 1) H / F) (distinct when F <= H, so one fragment crosses the
wire per step at most; fragment F - 1 keeps DiLoCo's schedule). Its pseudo-gradient is sent after
inner step t (t >= o_k, t = o_k mod H), the workers go on with the next tau = `overlap_steps` inner
steps while it crosses the wire, and after step t + tau the outer step above runs on that fragment's
global parameters and the local parameters merge with the result:

    theta_i <- alpha * theta_i + (1 - alpha) * theta       (alpha = `alpha`; 0 = adopt theta)

alpha weighs the worker's own parameters, which went on for tau steps; 0 discards those steps,
DiLoCo's reset (we follow torchft's fragment_update_alpha for the convention). F = 1, tau = 0,
alpha = 0 is DiLoCo exactly (tests/optim/test_diloco.py).

The average crosses the wire through a pluggable callable `average(x, step) -> mean of x over the
workers` (an optim.sync Exchange, or anything with that signature; an object with
`start(x, step) -> handle` whose `handle.wait()` returns the mean is started and waited for
separately, which a single-process simulation of the workers uses). `build_averages` makes one per
fragment for the wire formats of `WIRES`: fp32 and bf16 (ring allreduce), loco (LoCo's 4-bit with
moving-average error feedback, errors in 8 bits), sign (1 bit per element with a mean |x| scale per
block and worker / server error feedback: the scaled_sign compressor of comm.ef_compressed_allreduce),
e3m0 (the paper's 4-bit float, comm.e3m0), pbit_mean (Lion Cub's packed integer lanes, App. F.1,
carrying a mean: every rank quantizes with one scale per block agreed by a MAX allreduce, eq. 1,
and the exact integer lane sum times that scale / P is the mean). Sign votes (onebit, ps,
hierarchical, pbit) do not carry a real-valued average and are refused. A registry exchange runs
when it is started (the overlap is then exact in the numerics but hides no wall time);
`background_averages` runs them on a background thread, so the tau inner steps hide them.

One `DiLoCo` object per worker (rank of the replicate axis). The caller runs the inner step, then
`send()` (starts the exchanges due at this step), then `receive()` (finishes the exchanges due at
this step and applies their outer steps); `after_inner_step()` does both. Outer state (global
parameters, momentum, pending averages, the wires' error feedback) round-trips through
`state_dict()` / `load_state_dict()` between steps, so a resume is exact mid-inner-phase, mid-overlap
and at an outer step. docs/diloco.md says how it will plug into the sync-scheme registry
(`comm.mode=diloco`); that integration is not done.
"""
from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

import comm
from comm import cost_model
from comm.packing import lane_max
from comm.e3m0 import e3m0_allreduce_mean, e3m0_bytes, e3m0_chunk_bytes, e3m0_layout
from comm.quantize import segment_lp_means

from . import sync
from .options import Options

WIRES = ("fp32", "bf16", "loco", "sign", "e3m0", "pbit_mean")
"""Wire formats of the pseudo-gradient average: each gives an estimate of the real-valued mean."""
PBIT_QUANTIZERS = {"linf": math.inf, "l1": 1.0}
PBIT_BITS = (4, 8, 16)


def _wire_scheme(wire: str) -> tuple[sync.SyncScheme, sync.SchemeOptions] | None:
    """The registry scheme and options a wire runs on (None: e3m0 and pbit_mean, which are ours only)."""
    if wire in ("fp32", "bf16"):
        s = sync.get(wire)
        return s, s.default_options()
    if wire == "loco":
        s = sync.get("loco")
        return s, s.options()
    if wire == "sign":
        s = sync.get("compressed")
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
            known = {s.name: s for s in sync.schemes()}
            if self.wire in known and known[self.wire].result != sync.MEAN:
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

    def wire_options(self) -> sync.SchemeOptions | None:
        ws = _wire_scheme(self.wire)
        if ws is None:
            return None
        scheme, opts = ws
        if "block" in type(opts).field_names():
            opts = dataclasses.replace(opts, block=self.block)
        return opts


# ---- fragments --------------------------------------------------------------------------------
def strided_fragments(blocks: Sequence[Sequence[torch.Tensor]], rest: Sequence[torch.Tensor],
                      fragments: int) -> list[list[torch.Tensor]]:
    """Fragment k = blocks k, k + F, k + 2F, ... (Streaming DiLoCo's strided pattern); each tensor
    of `rest` (embeddings, final norm, head), in order, joins the fragment with the fewest elements
    so far (the first such on a tie). Fragments keep the model's order inside them."""
    if fragments < 1 or fragments > len(blocks):
        raise ValueError(f"comm.diloco.fragments: {fragments} fragments but the model has {len(blocks)} blocks; "
                         f"use 1 to {len(blocks)}")
    out: list[list[torch.Tensor]] = [[] for _ in range(fragments)]
    for i, block in enumerate(blocks):
        out[i % fragments].extend(block)
    sizes = [sum(t.numel() for t in f) for f in out]
    for t in rest:
        k = min(range(fragments), key=lambda j: (sizes[j], j))
        out[k].append(t)
        sizes[k] += t.numel()
    return out


# ---- wires ------------------------------------------------------------------------------------
Average = Callable[[torch.Tensor, int], torch.Tensor]
"""average(x, step) -> the mean of x over the workers (an optim.sync Exchange fits)."""


class E3M0Exchange(sync.Exchange):
    """The E3M0 4-bit float mean of comm.e3m0 as an Exchange (stateless: no error feedback)."""

    def __init__(self, block: int, ctx: sync.ExchangeContext) -> None:
        self.block, self.ctx = block, ctx

    def __call__(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return e3m0_allreduce_mean(x, self.block, group=self.ctx.group, stats=self.ctx.stats)


def _pbit_lane_bytes(bits: int, n: int) -> int:
    """Bytes of n values in `bits`-wide lanes as comm.int_allreduce sends them (16-bit: two per int32)."""
    return 4 * comm.ceil_div(n, 2) if bits == 16 else comm.ceil_div(n * bits, 8)


class PBitMeanExchange(sync.Exchange):
    """A real mean through Lion Cub's integer lanes (App. F.1): per block of `block` elements,
    M = M_p of the block (eq. 1; linf or l1), the ranks agree on the largest M (one fp32 MAX
    allreduce of the block scales), each quantizes q = clamp(round(L / (clip * M) * x), -L, L)
    (round half to even) with L = comm.max_levels(P, bits), comm.int_allreduce sums the q exactly,
    and the mean is sum * (clip * M / L) / P, identical on every rank. Stateless (no error
    feedback): with linf and clip 1 nothing saturates and the error is at most half a level per
    rank, clip * M / (2L)."""

    def __init__(self, options: DiLoCoOptions, ctx: sync.ExchangeContext) -> None:
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


def build_averages(options: DiLoCoOptions, numels: Sequence[int], ctx: sync.ExchangeContext
                   ) -> list[sync.Exchange]:
    """One average per fragment (an exchange holds error feedback sized for its vector), over the
    ranks of ctx.group (the replicate axis), booking bytes into ctx.stats."""
    out: list[sync.Exchange] = []
    for _ in numels:
        ws = _wire_scheme(options.wire)
        if options.wire == "pbit_mean":
            out.append(PBitMeanExchange(options, ctx))
        elif ws is None:
            out.append(E3M0Exchange(options.block, ctx))
        else:
            out.append(ws[0].build(options.wire_options(), ctx))
    return out


class BackgroundAverage:
    """An average run on a background thread, so the exchange overlaps the next inner steps in wall
    time too: `start` hands it to the thread and returns; `wait` blocks until it is done. Every
    fragment's BackgroundAverage of one worker shares one thread (`background_averages`), so the
    exchanges run in the order they were started, the same on every rank. The group they use must
    see no collective from another thread meanwhile: give the averages a group of their own (the
    replicate group under hybrid sharding; a copy of the world group at parallel.shard_size = 1,
    dist.new_group), and a CommStats the main thread does not book into while one is in flight."""

    def __init__(self, inner: Average, pool: ThreadPoolExecutor) -> None:
        self.inner, self.pool = inner, pool

    def start(self, x: torch.Tensor, step: int) -> "Future":
        return Future(self.pool.submit(self.inner, x, step))

    def state_dict(self) -> dict:
        return self.inner.state_dict() if hasattr(self.inner, "state_dict") else {}

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self.inner, "load_state_dict"):
            self.inner.load_state_dict(state)


class Future:
    """A started background average; `wait()` returns its result (an exception raised by the
    exchange is raised here, in the caller's thread)."""

    def __init__(self, fut) -> None:
        self.fut = fut

    def wait(self) -> torch.Tensor:
        return self.fut.result()


def background_averages(averages: Sequence[Average]) -> list[BackgroundAverage]:
    """Wrap one worker's averages (one per fragment) to run on one shared background thread."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-average")
    return [BackgroundAverage(a, pool) for a in averages]


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


# ---- diagnostics -------------------------------------------------------------------------------
def worker_drift(deltas: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Spread of the workers' pseudo-gradients of one fragment (the list holds every worker's):
    `spread` = sqrt(mean_i ||Delta_i - mean||^2) / ||mean|| and the cosine of each to their mean."""
    D = torch.stack([d.reshape(-1).to(torch.float64) for d in deltas])
    mean = D.mean(0)
    mn = mean.norm()
    spread = ((D - mean).pow(2).sum(1).mean().sqrt() / mn).item() if mn > 0 else math.inf
    cos = [(torch.dot(d, mean) / (d.norm() * mn)).item() if d.norm() > 0 and mn > 0 else 0.0 for d in D]
    return {"spread": spread, "cosine": cos}


# ---- the outer loop -----------------------------------------------------------------------------
class _Done:
    """A finished average (a blocking exchange, or one restored from a checkpoint)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def wait(self) -> torch.Tensor:
        return self.x


class DiLoCo:
    """The outer state and schedule of one worker (module docstring).

    fragments: the worker's parameter tensors per fragment (the model's own, updated in place at
    each outer step; F = 1: one list of every parameter). averages: one per fragment. Every worker
    must start from the same parameters: the global parameters are a fp32 copy of them."""

    def __init__(self, fragments: Sequence[Sequence[torch.Tensor]], options: DiLoCoOptions,
                 averages: Sequence[Average]) -> None:
        options.check()
        if len(fragments) != options.fragments:
            raise ValueError(f"comm.diloco.fragments: {options.fragments} but {len(fragments)} parameter "
                             f"fragments were given; build them with strided_fragments")
        if len(averages) != len(fragments):
            raise ValueError(f"DiLoCo: {len(averages)} averages for {len(fragments)} fragments; give one per "
                             f"fragment (build_averages)")
        self.o = options
        self.local = [list(f) for f in fragments]
        self.averages = list(averages)
        self.offsets = options.offsets()
        with torch.no_grad():
            self.glob = [self._flat(k) for k in range(len(self.local))]
        self.momentum = [torch.zeros_like(g) for g in self.glob]
        self.syncs = [0] * len(self.local)      # outer steps applied per fragment
        self.step = 0                           # inner steps completed
        self.pending: dict[int, Any] = {}       # fragment -> started average
        self._sent = False

    @property
    def numels(self) -> list[int]:
        return [g.numel() for g in self.glob]

    def _flat(self, k: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.local[k]])

    def _due(self, t: int, delay: int) -> list[int]:
        H = self.o.inner_steps
        return [k for k, o in enumerate(self.offsets) if t - delay >= o and (t - delay - o) % H == 0]

    def sends_at(self, t: int) -> list[int]:
        """Fragments whose pseudo-gradient is sent after inner step t."""
        return self._due(t, 0)

    def receives_at(self, t: int) -> list[int]:
        """Fragments whose outer step is applied after inner step t."""
        return self._due(t, self.o.overlap_steps)

    @torch.no_grad()
    def send(self) -> list[int]:
        """After an inner step: count it, and start the average of the pseudo-gradient (global minus
        local) of every fragment due now. Returns those fragments."""
        if self._sent:
            raise RuntimeError("DiLoCo.send: called twice without receive(); call receive() after each send()")
        self.step += 1
        self._sent = True
        due = self.sends_at(self.step)
        for k in due:
            if k in self.pending:
                raise RuntimeError(f"DiLoCo: fragment {k}'s previous average was never applied")
            delta = self.glob[k] - self._flat(k)    # the exchange may average it in place
            avg = self.averages[k]
            start = getattr(avg, "start", None)
            self.pending[k] = start(delta, self.syncs[k]) if start is not None else _Done(avg(delta, self.syncs[k]))
        return due

    @torch.no_grad()
    def receive(self) -> list[int]:
        """Finish the averages due after this inner step and apply their outer steps (the outer SGD
        on the global parameters, then the merge into the local ones). Returns those fragments."""
        if not self._sent:
            raise RuntimeError("DiLoCo.receive: call send() first (once per inner step)")
        self._sent = False
        due = self.receives_at(self.step)
        for k in due:
            self._outer_step(k, self.pending.pop(k).wait())
        return due

    @torch.no_grad()
    def finish(self) -> list[int]:
        """Apply every average still in flight (training ends within tau steps of a send): their
        outer steps and merges run now. Returns those fragments."""
        if self._sent:
            raise RuntimeError("DiLoCo.finish: called between send() and receive(); call receive() first")
        done = sorted(self.pending)
        for k in done:
            self._outer_step(k, self.pending.pop(k).wait())
        return done

    def after_inner_step(self) -> list[int]:
        """send() then receive(): the call of a real (one process per worker) run."""
        self.send()
        return self.receive()

    def _outer_step(self, k: int, delta: torch.Tensor) -> None:
        o, g = self.o, self.glob[k]
        delta = delta.to(torch.float32).reshape(-1)
        if delta.numel() != g.numel():
            raise RuntimeError(f"DiLoCo: the average of fragment {k} has {delta.numel()} elements, expected "
                               f"{g.numel()}")
        if o.outer_momentum > 0:
            m = self.momentum[k]
            m.mul_(o.outer_momentum).add_(delta)
            update = delta.add(m, alpha=o.outer_momentum) if o.nesterov else m
        else:
            update = delta
        g.add_(update, alpha=-o.outer_lr)
        off = 0
        for p in self.local[k]:
            n = p.numel()
            new = g[off:off + n].view(p.shape)
            if o.alpha == 0:
                p.copy_(new)
            else:
                p.copy_(p.to(torch.float32).mul(o.alpha).add_(new, alpha=1.0 - o.alpha))
            off += n
        self.syncs[k] += 1

    # ---- checkpoint ------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        o = self.o
        return {"inner_steps": o.inner_steps, "fragments": o.fragments, "overlap_steps": o.overlap_steps,
                "wire": o.wire, "block": o.block, "numels": self.numels}

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """The outer state between inner steps: global parameters, momentum, per-fragment sync
        counts, the averages in flight (finished now: their result does not depend on when it is
        waited for) and each average's own state (error feedback)."""
        if self._sent:
            raise RuntimeError("DiLoCo.state_dict: called between send() and receive(); save after receive()")
        for k in list(self.pending):
            self.pending[k] = _Done(self.pending[k].wait())
        return {
            "config": self._identity(), "step": self.step, "syncs": list(self.syncs),
            "global": [g.clone() for g in self.glob], "momentum": [m.clone() for m in self.momentum],
            "pending": {k: h.wait().clone() for k, h in self.pending.items()},
            "averages": [a.state_dict() if hasattr(a, "state_dict") else {} for a in self.averages],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, mine = state["config"], self._identity()
        for key in ("inner_steps", "fragments", "overlap_steps", "wire", "block"):
            if saved[key] != mine[key]:
                raise ValueError(f"comm.diloco.{key}: the checkpoint was saved with {saved[key]!r}, this run has "
                                 f"{mine[key]!r}; resume with the same value")
        if list(saved["numels"]) != mine["numels"]:
            raise ValueError(f"DiLoCo: the checkpoint's fragments hold {list(saved['numels'])} elements, this "
                             f"model's {mine['numels']}; resume with the same model and comm.diloco.fragments")
        self.step = int(state["step"])
        self.syncs = [int(s) for s in state["syncs"]]
        for dst, src in zip(self.glob, state["global"]):
            dst.copy_(src)
        for dst, src in zip(self.momentum, state["momentum"]):
            dst.copy_(src)
        self.pending = {int(k): _Done(v.clone()) for k, v in state["pending"].items()}
        for a, s in zip(self.averages, state["averages"]):
            if hasattr(a, "load_state_dict"):
                a.load_state_dict(s)
            elif s:
                raise ValueError(f"DiLoCo: the checkpoint holds average state {sorted(s)} but this wire keeps none")
        self._sent = False
