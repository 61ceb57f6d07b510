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
`background_averages` runs them on a background thread, so the tau inner steps hide them (on CUDA
on a side stream of their own, `CudaSideStream`, so the GPU does not queue the inner steps behind them).

One `DiLoCo` object per worker (rank of the replicate axis). The caller runs the inner step, then
`send()` (starts the exchanges due at this step), then `receive()` (finishes the exchanges due at
this step and applies their outer steps); `after_inner_step()` does both. Outer state (global
parameters, momentum, pending averages, the wires' error feedback) round-trips through
`state_dict()` / `load_state_dict()` between steps, so a resume is exact mid-inner-phase, mid-overlap
and at an outer step. `OuterLoop` (optim/outer_loop.py) binds one to a run's optimizer: comm.mode=diloco (the registry
entry, its options and byte formulas: optim/sync/diloco.py; docs/diloco.md); on diagnostic steps
it reports the workers' drift (`worker_drift`'s numbers from four scalars per worker and an exact
mean: `drift_scalars`, `drift_from_scalars`), and inside `global_params()` the model holds the
global parameters (evaluation, and the model a checkpoint writes) while `state_dict()` still
gives this rank's local ones.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch


from . import sync
from .sync.diloco import (LOCAL, PBIT_BITS, PBIT_QUANTIZERS, WIRES, CycleBytes, DiLoCoOptions, DiLoCoSchemeOptions,
                          E3M0Exchange, OuterExchange, PBitMeanExchange, build_averages, cycle_bytes, cycle_seconds,
                          strided_assignment, wire_bytes, wire_seconds)


# ---- fragments --------------------------------------------------------------------------------
def strided_fragments(blocks: Sequence[Sequence[torch.Tensor]], rest: Sequence[torch.Tensor],
                      fragments: int) -> list[list[torch.Tensor]]:
    """Fragment k = blocks k, k + F, k + 2F, ... (Streaming DiLoCo's strided pattern); each tensor
    of `rest` (embeddings, final norm, head), in order, joins the fragment with the fewest elements
    so far (the first such on a tie). Fragments keep the model's order inside them."""
    of_block, of_rest = strided_assignment([sum(t.numel() for t in b) for b in blocks], [t.numel() for t in rest],
                                           fragments)
    out: list[list[torch.Tensor]] = [[] for _ in range(fragments)]
    for block, k in zip(blocks, of_block):
        out[k].extend(block)
    for t, k in zip(rest, of_rest):
        out[k].append(t)
    return out


# ---- wires ------------------------------------------------------------------------------------
Average = Callable[[torch.Tensor, int], torch.Tensor]
"""average(x, step) -> the mean of x over the workers (an optim.sync Exchange fits)."""


class CudaSideStream:
    """The CUDA stream one worker's background averages run on. Without it they would run on the
    background thread's current stream, the device's default stream, which is the main thread's too:
    every kernel of an average (the wire's encode and decode) and every collective's wait (NCCL makes
    the calling thread's current stream wait for the collective) would sit in the stream the inner
    steps use, and the GPU would run those steps only after the exchange, hiding nothing (the host
    thread would not block, so `Future.waited` would not show it). On the side stream the average
    first waits for the work that produced its input on the caller's stream (`handoff`), and the
    caller's stream waits for the average only where its result is used (`join`, at the outer step).
    The caching allocator is told about both cross-stream uses (record_stream), so neither tensor's
    memory is reused before the other stream is done with it."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)

    def handoff(self, x: torch.Tensor):
        """In the caller's thread, at start: an event after the caller's work on x so far."""
        ready = torch.cuda.current_stream(x.device).record_event()
        x.record_stream(self.stream)
        return ready

    def run(self, ready, fn: Callable[[], torch.Tensor]):
        """In the background thread: fn() on the side stream after `ready`; (result, event when done)."""
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            y = fn()
            return y, self.stream.record_event()

    def join(self, y: torch.Tensor, done) -> torch.Tensor:
        """In the caller's thread, at wait: the caller's stream waits for the average; y is usable there."""
        here = torch.cuda.current_stream(y.device)
        here.wait_event(done)
        y.record_stream(here)
        return y


class BackgroundAverage:
    """An average run on a background thread, so the exchange overlaps the next inner steps in wall
    time too: `start` hands it to the thread and returns; `wait` blocks until it is done. Every
    fragment's BackgroundAverage of one worker shares one thread (`background_averages`), so the
    exchanges run in the order they were started, the same on every rank. The group they use must
    see no collective from another thread meanwhile: give the averages a group of their own (the
    replicate group under hybrid sharding; a copy of the world group at parallel.shard_size = 1,
    dist.new_group), and a CommStats the main thread does not book into while one is in flight.
    `side`: on CUDA, the worker's `CudaSideStream` (None on CPU)."""

    def __init__(self, inner: Average, pool: ThreadPoolExecutor, side: CudaSideStream | None = None) -> None:
        self.inner, self.pool, self.side = inner, pool, side

    def start(self, x: torch.Tensor, step: int) -> "Future":
        if self.side is None:
            return Future(self.pool.submit(self.inner, x, step))
        side, ready = self.side, self.side.handoff(x)
        return Future(self.pool.submit(side.run, ready, lambda: self.inner(x, step)), side)

    def state_dict(self) -> dict:
        return self.inner.state_dict() if hasattr(self.inner, "state_dict") else {}

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self.inner, "load_state_dict"):
            self.inner.load_state_dict(state)


class Future:
    """A started background average; `wait()` returns its result (an exception raised by the
    exchange is raised here, in the caller's thread). `waited`: the seconds the caller's thread was
    blocked in `wait()`, the part of the exchange the overlapped inner steps did not hide (on CUDA
    the host part only: the GPU's wait for the side stream is inside the step's device time)."""

    def __init__(self, fut, side: CudaSideStream | None = None) -> None:
        self.fut, self.side = fut, side
        self.waited = 0.0

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            out = self.fut.result()
        finally:
            self.waited += time.perf_counter() - t0
        return out if self.side is None else self.side.join(*out)


def background_averages(averages: Sequence[Average], device: torch.device | None = None) -> list[BackgroundAverage]:
    """Wrap one worker's averages (one per fragment) to run on one shared background thread (on a CUDA
    `device`, on one side stream: CudaSideStream)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-average")
    side = CudaSideStream(device) if device is not None and torch.device(device).type == "cuda" else None
    return [BackgroundAverage(a, pool, side) for a in averages]


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


def drift_scalars(delta: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """One worker's share of `worker_drift`, from its own pseudo-gradient and the exact mean of all
    of them: float64 [||Delta_i||^2, Delta_i . mean, ||Delta_i - mean||^2, ||mean||^2] (fp32 products
    summed in float64; the deviation is summed directly, not as ||Delta_i||^2 - ||mean||^2, whose
    difference cancels when the workers agree). Sums over parts: a worker holding its fragment in
    shards adds its shards' scalars."""
    d, m = delta.reshape(-1).to(torch.float32), mean.reshape(-1).to(torch.float32)
    f64 = torch.float64
    return torch.stack([d.square().sum(dtype=f64), (d * m).sum(dtype=f64), (d - m).square().sum(dtype=f64),
                        m.square().sum(dtype=f64)])


def drift_from_scalars(scalars: torch.Tensor) -> dict[str, Any]:
    """`worker_drift` from every worker's `drift_scalars` (one row per worker): spread =
    sqrt(mean_i ||Delta_i - mean||^2) / ||mean|| and cosine_i = Delta_i . mean / (||Delta_i|| ||mean||),
    with worker_drift's conventions (spread inf, cosines 0 when the mean is 0)."""
    rows = scalars.to(torch.float64).reshape(-1, 4).cpu().tolist()
    mn = math.sqrt(rows[0][3])
    spread = math.sqrt(sum(r[2] for r in rows) / len(rows)) / mn if mn > 0 else math.inf
    cos = [r[1] / (math.sqrt(r[0]) * mn) if r[0] > 0 and mn > 0 else 0.0 for r in rows]
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
        self.waited: dict[int, float] = {}      # fragment -> seconds its applied averages were waited for (popped when booked)
        self._sent = False
        self._final: list[int] = []             # fragments whose final average finish_send() started
        # fragments whose average finish_send() applied ahead of its outer step (training ended within tau
        # steps of the send): a run extended past its end (train.max_steps raised, resume=auto) skips that
        # outer step, as its average is already in the parameters
        self.drained: set[int] = set()

    @property
    def numels(self) -> list[int]:
        return [g.numel() for g in self.glob]

    def _flat(self, k: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.local[k]])

    def _due(self, t: int, delay: int) -> list[int]:
        return self.o.due(t, delay)

    def sends_at(self, t: int) -> list[int]:
        """Fragments whose pseudo-gradient is sent after inner step t."""
        return self._due(t, 0)

    def receives_at(self, t: int) -> list[int]:
        """Fragments whose outer step is applied after inner step t."""
        return self._due(t, self.o.overlap_steps)

    @torch.no_grad()
    def send(self, observe: Callable[[int, torch.Tensor], None] | None = None) -> list[int]:
        """After an inner step: count it, and start the average of the pseudo-gradient (global minus
        local) of every fragment due now. Returns those fragments. `observe(k, delta)`, when given,
        sees each fragment's pseudo-gradient before its average starts (it must not change it)."""
        if self._sent:
            raise RuntimeError("DiLoCo.send: called twice without receive(); call receive() after each send()")
        self.step += 1
        self._sent = True
        due = self.sends_at(self.step)
        for k in due:
            if k in self.pending:
                raise RuntimeError(f"DiLoCo: fragment {k}'s previous average was never applied")
            delta = self.glob[k] - self._flat(k)    # the exchange may average it in place
            if observe is not None:
                observe(k, delta)
            self._start(k, delta)
        return due

    def _start(self, k: int, delta: torch.Tensor) -> None:
        """Start fragment k's average of `delta`; pending until _collect(k)."""
        avg = self.averages[k]
        # a registry Exchange is called whole, so it books its own bytes (its `start` leaves the
        # booking to the caller: buckets); a background or simulated average is started
        start = None if isinstance(avg, sync.Exchange) else getattr(avg, "start", None)
        self.pending[k] = start(delta, self.syncs[k]) if start is not None else _Done(avg(delta, self.syncs[k]))

    def last_send(self, k: int) -> int:
        """The inner step after which fragment k's pseudo-gradient was last sent (0: never yet)."""
        o, t = self.offsets[k], self.step
        return 0 if t < o else t - (t - o) % self.o.inner_steps

    @torch.no_grad()
    def receive(self) -> list[int]:
        """Finish the averages due after this inner step and apply their outer steps (the outer SGD
        on the global parameters, then the merge into the local ones). Returns those fragments."""
        if not self._sent:
            raise RuntimeError("DiLoCo.receive: call send() first (once per inner step)")
        self._sent = False
        due = self.receives_at(self.step)
        applied = []
        for k in due:
            if k not in self.pending and k in self.drained:
                self.drained.discard(k)  # applied when the run this one extends ended
                continue
            self._outer_step(k, self._collect(k))
            applied.append(k)
        return applied

    def _collect(self, k: int) -> torch.Tensor:
        """Fragment k's average, waited for; the seconds the wait blocked go to `waited[k]` (0 for an
        average that ran when it was started, or that a checkpoint already waited for)."""
        handle = self.pending.pop(k)
        mean = handle.wait()
        self.waited[k] = self.waited.get(k, 0.0) + getattr(handle, "waited", 0.0)
        return mean

    @torch.no_grad()
    def finish(self) -> list[int]:
        """The end of training: finish_send() then finish_receive() (the call of a real run). Returns
        the fragments whose averages ran here, each once, sorted."""
        done = self.finish_send()
        self.finish_receive()
        return done

    @torch.no_grad()
    def finish_send(self) -> list[int]:
        """The end of training, first half. Apply every average still in flight (training ends within
        tau steps of a send): their outer steps and merges run now. Then, with `final_average`, every
        fragment that trained since its last send starts the average of those steps' pseudo-gradient
        (finish_receive applies it). Returns the fragments of both, each once, sorted."""
        if self._sent:
            raise RuntimeError("DiLoCo.finish: called between send() and receive(); call receive() first")
        done = sorted(self.pending)
        for k in done:
            self._outer_step(k, self._collect(k))
        self.drained |= set(done)
        self._final = [k for k in range(len(self.local)) if self.o.final_average and self.last_send(k) < self.step]
        for k in self._final:
            self._start(k, self.glob[k] - self._flat(k))
        return sorted({*done, *self._final})

    @torch.no_grad()
    def finish_receive(self) -> None:
        """The end of training, second half: each final average's fragment takes the workers' mean
        (global minus the averaged pseudo-gradient: no outer lr, no momentum; the outer step is tuned
        for whole inner phases, and extrapolating its momentum on the last, partial one would move the
        final model where no worker went). Without final_average those steps are dropped."""
        for k in self._final:
            self.glob[k].sub_(self._collect(k).to(torch.float32).reshape(-1))
            self._write(k, self.glob[k])
            self.syncs[k] += 1
        self._final = []

    def after_inner_step(self, observe: Callable[[int, torch.Tensor], None] | None = None) -> list[int]:
        """send() then receive(): the call of a real (one process per worker) run."""
        self.send(observe)
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
        if o.alpha == 0:
            self._write(k, g)
        else:
            self._write(k, self._flat(k).mul_(o.alpha).add_(g, alpha=1.0 - o.alpha))
        self.syncs[k] += 1

    def _write(self, k: int, flat: torch.Tensor) -> None:
        """Copy a flat fp32 vector into fragment k's parameter tensors (in their dtype)."""
        off = 0
        for p in self.local[k]:
            n = p.numel()
            p.copy_(flat[off:off + n].view(p.shape))
            off += n

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
            "drained": sorted(self.drained),
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
        self.drained = {int(k) for k in state.get("drained", ())}  # absent from checkpoints of older versions
        for a, s in zip(self.averages, state["averages"]):
            if hasattr(a, "load_state_dict"):
                a.load_state_dict(s)
            elif s:
                raise ValueError(f"DiLoCo: the checkpoint holds average state {sorted(s)} but this wire keeps none")
        self._sent = False
