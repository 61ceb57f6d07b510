"""The optimizer base that owns communication (in the style of modded-nanogpt's distributed
optimizers: the collective happens inside `step()`; there is no DDP wrapper).

A `CommOptimizer` holds:
- the flat layout (Lion Cub App. D.2): every trainable parameter's gradient is a view of ONE flat
  buffer per dtype (in the model's parameter order), so a gradient-sync exchange is a single
  collective and backward accumulates in place; and a role-ordered layout (`FlatLayout`) in
  which every role (embedding, head, attn, mlp, norm) is one contiguous slice, with views by
  parameter and by role, for update-sync vectors (Lion Cub's c_local), momentum sync and
  diagnostics;
- the sync scheme chosen by `comm.mode` (optim.sync): for a GRADIENT scheme, `step()` exchanges
  the flat gradient before the update; for an UPDATE scheme the subclass's `_update` calls
  `self.exchange` on its own vector;
- gradient clipping (global norm after a gradient exchange; each rank's local norm for update
  sync, where no gradient crosses the network);
- hooks after the update: diagnostics (on request, measured BEFORE a momentum sync of the same
  step) and momentum synchronisation of selected roles on a schedule (Lion Cub §5).

`step(diagnose=False)` returns a `StepReport`: seconds and bytes by phase (grad_sync,
update_sync, momentum_sync, diag), the diagnostics and histograms. Nothing is communicated
through attributes set from outside or a process-wide stats object.

Subclasses implement `_update(step) -> dict | None` (the local math and, for update sync, the
exchange) and, where per-rank state exists, `momentum_of(param)` and `_diagnostics(out)`.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

import comm
from comm import Clock, CommStats, cost_model
from comm import kernels as _kernels

from . import overlap as _overlap
from . import sync
from .diagnostics import momentum_spread
from .options import choice, common_problems

PHASES = ("grad_sync", "update_sync", "momentum_sync", "diag", "guard", "overlapped")
COMM_PHASES = ("grad_sync", "update_sync", "momentum_sync")  # what the step's comm time and bytes count


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


@dataclass
class Entry:
    """One trainable parameter in the role-ordered layout."""

    group: int
    role: str
    name: str
    layer: str
    param: torch.nn.Parameter
    offset: int
    numel: int

    @property
    def rows(self) -> int:
        return self.param.shape[0] if self.param.ndim >= 2 else 1


class FlatLayout:
    """Trainable parameters ordered by role (roles in order of first appearance among the
    groups, group order within a role), so every role is one contiguous slice of a flat vector;
    or, given `order` (a list of parameters: buckets, optim.overlap), in that order."""

    def __init__(self, param_groups: list[dict], order: list[torch.nn.Parameter] | None = None) -> None:
        roles_order: dict[str, int] = {}
        raw = []
        for gi, g in enumerate(param_groups):
            role = g.get("role", "all")
            roles_order.setdefault(role, len(roles_order))
            names = g.get("names") or [f"group{gi}.{k}" for k in range(len(g["params"]))]
            layers = g.get("layers") or [""] * len(g["params"])
            for p, name, layer in zip(g["params"], names, layers):
                if p.requires_grad:
                    raw.append((gi, role, name, layer, p))
        if order is None:
            raw.sort(key=lambda e: roles_order[e[1]])  # stable: group order within a role
        else:
            pos = {id(p): k for k, p in enumerate(order)}
            raw.sort(key=lambda e: pos.get(id(e[4]), len(pos)))
        self.entries: list[Entry] = []
        off = 0
        for gi, role, name, layer, p in raw:
            self.entries.append(Entry(gi, role, name, layer, p, off, p.numel()))
            off += p.numel()
        self.numel = off
        self.by_role: dict[str, list[Entry]] = {}
        for e in self.entries:
            self.by_role.setdefault(e.role, []).append(e)
        self.per_group: dict[int, list[int]] = {}
        for k, e in enumerate(self.entries):
            self.per_group.setdefault(e.group, []).append(k)
        dtypes = {e.param.dtype for e in self.entries}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.device = self.entries[0].param.device if self.entries else torch.device("cpu")

    @property
    def roles(self) -> list[str]:
        return list(self.by_role)

    @property
    def segments(self) -> list[tuple[int, int]]:
        return [(e.offset, e.numel) for e in self.entries]

    def views(self, flat: torch.Tensor, idx: Iterable[int]) -> list[torch.Tensor]:
        """Views of `flat` shaped like the parameters of entries `idx`."""
        return [flat[self.entries[k].offset:self.entries[k].offset + self.entries[k].numel]
                .view_as(self.entries[k].param) for k in idx]

    def params(self, idx: Iterable[int]) -> list[torch.nn.Parameter]:
        return [self.entries[k].param for k in idx]

    def new_flat(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)


def attach_flat_grads(params: list[torch.nn.Parameter]) -> dict[torch.dtype, torch.Tensor]:
    """Point every parameter's .grad at a slice of one zeroed flat buffer per dtype (in the given
    order), so backward accumulates in place and a gradient exchange is one collective."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    buffers = {}
    for dtype, ps in by_dtype.items():
        flat = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=ps[0].device)
        off = 0
        for p in ps:
            p.grad = flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        buffers[dtype] = flat
    return buffers


@dataclass
class MomentumSync:
    """Lion Cub §5: mean-allreduce (fp32, one flat buffer) the momenta of the selected roles after
    the momentum update of every step t with t % every == 0 and start <= t (<= stop unless 0)."""

    every: int = 0
    layers: list = field(default_factory=lambda: ["all"])
    start: int = 0
    stop: int = 0

    def due(self, t: int) -> bool:
        if self.every <= 0 or t < self.start or (self.stop and t > self.stop):
            return False
        return t % self.every == 0

    def selects(self, role: str) -> bool:
        return "all" in self.layers or role in self.layers


class CommOptimizer(torch.optim.Optimizer):
    """Base of every optimizer of the project; see the module docstring."""

    optim_name: str | None = None
    """The registry entry (`optim.name`) that builds this class: an optimizer built directly, not
    through build_optimizer, is checked against that entry's `accepts` (the rule's one home)."""

    def __init__(self, param_groups: Iterable, defaults: dict, *, scheme: str | sync.SyncScheme = "fp32",
                 scheme_options: sync.SchemeOptions | dict | None = None, group=None, grad_clip: float = 0.0,
                 momentum_sync: MomentumSync | dict | None = None,
                 param_order: list[torch.nn.Parameter] | None = None, kernels: str = "eager",
                 fine_timing: bool = True, bucket_mb: float = 0.0, overlap: bool = False,
                 shard_group=None) -> None:
        super().__init__(param_groups, defaults)
        # hybrid sharding (trainer/parallel.py): the parameters are this rank's local shards,
        # `group` the replicate group; per-tensor reductions (norms, the guard) also sum over the
        # shard group, which holds the other shards
        self.shard_group = shard_group
        self.scheme = sync.get(scheme) if isinstance(scheme, str) else scheme
        if scheme_options is None or isinstance(scheme_options, dict):
            scheme_options = self.scheme.options(**(scheme_options or {}))
        self.scheme_options = scheme_options
        self.group = group
        self.world_size, self.rank = comm.world(group)
        if isinstance(momentum_sync, dict):
            momentum_sync = MomentumSync(**momentum_sync)
        every = momentum_sync.every if momentum_sync is not None else 0
        # the registries' rules, not restated by any constructor: the entry's accepts, the common
        # optim.* keys of `defaults`, and the scheme's own run_problems
        problems = self._registry_problems() + common_problems(
            lr=defaults.get("lr"), betas=defaults.get("betas"), eps=defaults.get("eps"),
            weight_decay=defaults.get("weight_decay"), grad_clip=grad_clip, beta1=defaults.get("beta"))
        problems += self.scheme.run_problems(
            self.scheme_options, self.world_size, bucket_mb=bucket_mb, overlap=overlap, grad_clip=grad_clip,
            momentum_sync_every=every, shard_size=comm.world(shard_group)[0] if shard_group is not None else 1)
        if problems:
            raise ValueError("; ".join(problems))
        self.layout = FlatLayout(self.param_groups)
        if not self.layout.entries:
            raise ValueError("the optimizer got no trainable parameter")
        trainable = {id(e.param) for e in self.layout.entries}
        order = [p for p in (param_order or []) if id(p) in trainable]
        if len(order) != len(trainable):  # no (complete) model order given: role order
            order = [e.param for e in self.layout.entries]
        self._check_buckets(bucket_mb)
        self.bucket_bytes, self.overlap = bucket_mb * 2 ** 20, overlap
        if self.bucket_bytes > 0 and self.scheme.kind == sync.UPDATE:
            # the update-sync vector in bucket order, so every bucket is one contiguous part
            self.layout = FlatLayout(self.param_groups, [p for b in _overlap.plan(order, self.bucket_bytes) for p in b])
        problems = []
        choice(problems, "comm.kernels", kernels, _kernels.IMPLS)
        if problems:
            raise ValueError(problems[0])
        self.kernels = kernels
        self.stats = {phase: CommStats(timing=fine_timing) for phase in PHASES}
        self.grad_buffers = attach_flat_grads(self._grad_order(order))
        self._grad_views = {id(p): p.grad for p in order}
        self.grad_clip = float(grad_clip)
        self.momentum_sync = momentum_sync if momentum_sync is not None and momentum_sync.every > 0 else None
        if self.momentum_sync is not None:
            if not any(self.momentum_sync.selects(r) for r in self.layout.roles):
                raise ValueError(f"comm.momentum_sync.layers={self.momentum_sync.layers} selects no parameter; roles "
                                 f"present: {self.layout.roles} (a head tied to the embedding has role 'embedding')")
        device = self.layout.device
        self.clock = Clock(device)
        # independent random stream per rank, reproducible from the run's seed
        seed = (torch.initial_seed() * 1_000_003 + 7919 * (self.rank + 1)) % (2 ** 63 - 1)
        phase = "grad_sync" if self.scheme.kind == sync.GRADIENT else "update_sync"
        self.ctx = sync.ExchangeContext(
            world_size=self.world_size, rank=self.rank, group=group, stats=self.stats[phase],
            segments=self.layout.segments, rows=[e.rows for e in self.layout.entries], device=device, seed=seed,
            kernels=kernels)
        self.exchange = self.scheme.build(self.scheme_options, self.ctx)
        self._step = 0
        self._bucket_results = None
        self._buckets = self._make_buckets(order) if self.bucket_bytes > 0 else None

    # ---- buckets and overlap (optim/overlap.py) -----------------------------------------------------
    bucketed = "gradient"
    """Which vector this optimizer can exchange in buckets: "gradient" (the base's gradient
    exchange), "update" (the subclass's own vector: `_bucket_vector`), or None (not at all)."""

    def _registry_problems(self) -> list[str]:
        if self.optim_name is None:
            return []
        from .registry import compatibility_problem  # the registry imports the optimizers' modules

        problem = compatibility_problem(self.optim_name, self.scheme.name, self.scheme_options)
        return [problem] if problem else []

    def _check_buckets(self, bucket_mb: float) -> None:
        """The optimizer's side of buckets (the scheme's, `bucketable`, is in its run_problems)."""
        if bucket_mb <= 0:
            return
        wants = "gradient" if self.scheme.kind == sync.GRADIENT else "update"
        if self.bucketed != wants:
            raise ValueError(f"comm.bucket_mb / comm.overlap: {type(self).__name__} on comm.mode={self.scheme.name} "
                             f"cannot exchange its vector in buckets; set comm.bucket_mb=0 and comm.overlap=false")

    def _make_buckets(self, order: list[torch.nn.Parameter]) -> _overlap.Overlap:
        if self.scheme.kind == sync.GRADIENT:
            buckets = []
            for dtype, buf in self.grad_buffers.items():
                ps, base = [p for p in order if p.dtype == dtype], buf.data_ptr()
                for run in _overlap.plan(ps, self.bucket_bytes):
                    offs = [(p.grad.data_ptr() - base) // p.grad.element_size() for p in run]
                    lo, hi = min(offs), max(o + p.numel() for o, p in zip(offs, run))
                    b = _overlap.Bucket(len(buckets), run, lo, hi)
                    b.extra["buf"] = buf
                    buckets.append(b)
        else:
            buckets, off = [], 0
            for run in _overlap.plan(order, self.bucket_bytes):
                n = sum(p.numel() for p in run)
                buckets.append(_overlap.Bucket(len(buckets), run, off, off + n))
                off += n
        for b in buckets:  # bucket b's part of the exchange: its own segments, and the overlap's stats
            b.extra["rows"] = sum(p.shape[0] if p.ndim >= 2 else 1 for p in b.params)  # once, not every step
            part = self.ctx.restrict(b.lo, b.hi) if self.scheme.kind == sync.UPDATE else self.ctx
            b.extra["ctx"] = part
            b.extra["ctx_bg"] = dataclasses.replace(part, stats=_overlap_stats(self))
        return _overlap.Overlap(buckets, self._launch_bucket, self._book_bucket, self.ctx.stats, self.clock,
                                self.overlap)

    def expect_backward(self, final: bool = True) -> None:
        """Call before each backward of a step: `final` on the last micro-batch of the accumulation
        (with comm.overlap, buckets are launched during that backward only)."""
        if self._buckets is not None:
            self._buckets.expect_backward(final, self._step + 1)

    def _launch_bucket(self, b: _overlap.Bucket, step: int):
        if self.scheme.kind == sync.GRADIENT:
            view = b.extra["buf"][b.lo:b.hi]
            if self.overlap:
                return self.exchange.start(view, step)
            return _overlap.Done(self.exchange(view, step))
        vec = self._bucket_vector(b)
        if self.overlap:
            return self._buckets.submit(self.exchange, vec, step, b.extra["ctx_bg"])
        return _overlap.Done(self.exchange(vec, step, b.extra["ctx"]))

    def _book_bucket(self, b: _overlap.Bucket) -> tuple[str, int, int]:
        sent, recv = self.scheme.bytes_per_call(self.scheme_options, self.world_size, b.hi - b.lo, self.rank,
                                                b.extra["rows"])
        return f"{self.scheme.name}[bucket {b.index}]", sent, recv

    def _bucket_vector(self, b: _overlap.Bucket) -> torch.Tensor:  # pragma: no cover - interface
        """The vector of bucket b to exchange (update-sync optimizers with bucketed = "update")."""
        raise NotImplementedError

    # ---- what subclasses implement ------------------------------------------------------------
    def _update(self, step: int) -> dict | None:  # pragma: no cover - interface
        """Apply one update to the parameters (after gradient sync and clipping); return what
        `_diagnostics` needs, or None."""
        raise NotImplementedError

    def momentum_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The momentum tensor that momentum sync and the spread diagnostic use (None: none)."""
        return None

    def _grad_order(self, order: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """The order of the flat gradient buffer (default: the model's). A subclass that exchanges
        only some gradients may put them first so they form one contiguous slice."""
        return order

    def _exchange_gradients(self, step: int) -> None:
        """Before clipping and the update: a GRADIENT scheme averages every flat gradient buffer
        (one collective each, or one per bucket). Subclasses that exchange only part of the
        gradient override this."""
        if self.scheme.kind == sync.GRADIENT and self._buckets is not None:
            if self._bucket_results is None:  # overlap drained them at the start of the step
                self._buckets.finish(step)
        elif self.scheme.kind == sync.GRADIENT:
            for buf in self.grad_buffers.values():
                self.exchange(buf, step)

    def warmup(self) -> float:
        """Compile the fused kernels this optimizer and its exchange use (comm.kernels), before the
        first timed step; returns the seconds spent (0 when nothing is compiled)."""
        if self.kernels == "eager":
            return 0.0
        return self._warmup_own_kernels() + self.exchange.warmup()

    def kernel_choices(self) -> list[str]:
        """One line per kernel that comm.kernels=auto timed in warm-up: the candidate it keeps."""
        return [c["line"] for c in _kernels.auto_choices()]

    def _warmup_own_kernels(self) -> float:
        """Compile the optimizer's own fused passes (a subclass that has some); seconds spent."""
        return 0.0

    def _diagnostics(self, out: dict | None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """Scheme-specific diagnostics of this step (update sync); default none."""
        return {}, {}

    # ---- the step -------------------------------------------------------------------------------
    @property
    def steps_done(self) -> int:
        return self._step

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffers (the .grad views stay; set_to_none is ignored)."""
        for buf in self.grad_buffers.values():
            buf.zero_()

    def _adopt_grads(self) -> None:
        """A .grad replaced from outside (assigned, or set to None) is copied back into its view."""
        for e in self.layout.entries:
            view = self._grad_views[id(e.param)]
            g = e.param.grad
            if g is view:
                continue
            if g is None:
                view.zero_()  # no gradient this step counts as 0: the flat collective is the same on every rank
            else:
                view.copy_(g)
            e.param.grad = view

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, diagnose: bool = False,
             loss_finite: bool | None = None, stop: bool = False) -> StepReport:
        """One step. With `loss_finite` given (the divergence guard), every rank first checks its
        loss and local gradient for NaN / inf and all ranks agree (one tiny collective, the "guard"
        phase); if any rank found one, nothing is exchanged or updated and the report says so.
        `stop` (this rank wants to stop, e.g. on a signal) rides on the same collective: the
        report's `stop` is true on every rank when it was true on any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = self.clock.now()
        for s in self.stats.values():
            s.begin_step()
        self._adopt_grads()
        # overlap: wait for the buckets in flight before any other collective of the step (a
        # background exchange must never interleave with the main thread's collectives)
        self._bucket_results = self._buckets.finish(self._step + 1) if self._buckets is not None and self.overlap \
            else None
        nonfinite, stopping = self._guard(loss_finite, stop) if loss_finite is not None else (False, stop)
        if nonfinite:
            report = StepReport(step=self._step, loss=loss, nonfinite=True, stop=stopping)
            report.seconds = self.clock.now() - t0
            report.phases = {phase: s.step_summary() for phase, s in self.stats.items()}
            return report
        self._step += 1
        t = self._step
        self._exchange_gradients(t)
        grad_norms = self._grad_norms()
        if self.grad_clip > 0:
            self._clip_()
        out = self._update(t)
        report = StepReport(step=t, loss=loss, grad_norms=grad_norms, stop=stopping)
        due = self.momentum_sync is not None and self.momentum_sync.due(t)
        if diagnose:
            report.diag_seconds += self._run_diagnostics(report, out, after_sync=False)
        if due:
            self._sync_momenta()
            if diagnose:
                report.diag_seconds += self._run_diagnostics(report, None, after_sync=True)
        report.seconds = self.clock.now() - t0 - report.diag_seconds
        report.phases = {phase: s.step_summary() for phase, s in self.stats.items()}
        return report

    def _guard(self, loss_finite: bool, stop: bool) -> tuple[bool, bool]:
        """(any rank saw a non-finite loss or gradient, any rank asked to stop): one SUM-allreduce of
        one int32 with two lanes, the non-finite count in bits 0-15 and the stop count above (P <
        2^15 ranks, so neither lane overflows)."""
        bufs = list(self.grad_buffers.values())
        local_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b, dtype=torch.float32)
                                                           for b in bufs]))
        bad = torch.logical_not(torch.isfinite(local_norm)) | (not loss_finite)
        word = bad.reshape(1).to(torch.int32) + (1 << 16 if stop else 0)
        if self.shard_group is not None:  # hybrid sharding: first over the other shards (counts add up)
            word = comm.allreduce_packed_(word, group=self.shard_group, stats=self.stats["guard"], name="guard_shards")
        word = comm.allreduce_packed_(word, group=self.group, stats=self.stats["guard"], name="guard")
        v = int(word.item())
        return bool(v & 0xFFFF), bool(v >> 16)

    def _grad_norm(self, bufs: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of the gradient (fp32): of the flat buffers, summed over the shard group when the
        parameters are shards (both replicas' groups then hold the same whole gradient's norm)."""
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b, dtype=torch.float32) for b in bufs]))
        if self.shard_group is None:
            return norm
        sq = norm.square()
        torch.distributed.all_reduce(sq, group=self.shard_group)
        return sq.sqrt()

    @property
    def grad_norm_roles(self) -> list[str]:
        return self.layout.roles

    def _grad_norms(self) -> torch.Tensor:
        """Per-role and global L2 norms of the gradient (fp32, on the device, no host sync); the global
        one is torch.nn.utils.clip_grad_norm_'s total norm of the same gradients."""
        grads = [self._grad_views[id(e.param)] for e in self.layout.entries]
        sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square()  # one norm per tensor
        if getattr(self, "_role_index", None) is None:  # built once: the layout is fixed
            self._role_index = torch.tensor([self.layout.roles.index(e.role) for e in self.layout.entries],
                                            device=sq.device)
        roles = torch.zeros(len(self.layout.roles), device=sq.device).index_add_(0, self._role_index, sq)
        if self.shard_group is not None:  # hybrid sharding: add the other shards' squares (whole tensors' norms)
            torch.distributed.all_reduce(roles, group=self.shard_group)
        return torch.cat([roles, roles.sum()[None]]).sqrt()

    def _clip_(self) -> None:
        bufs = list(self.grad_buffers.values())
        norm = self._grad_norm(bufs)
        scale = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
        for b in bufs:
            b.mul_(scale.to(b.dtype))

    # ---- hooks: diagnostics and momentum sync ---------------------------------------------------------
    def _momenta(self, select: Callable[[str], bool] = lambda role: True) -> list[tuple[Entry, torch.Tensor]]:
        out = []
        for e in self.layout.entries:
            if select(e.role):
                m = self.momentum_of(e.param)
                if m is not None:
                    out.append((e, m))
        return out

    def _run_diagnostics(self, report: StepReport, out: dict | None, after_sync: bool) -> float:
        stats = self.stats["diag"]
        t0 = self.clock.now()
        if not after_sync:
            d, h = self._diagnostics(out)
            report.diagnostics.update(d)
            report.histograms.update(h)
        if self.scheme.kind == sync.UPDATE:
            moms = self._momenta()
            if moms:
                prefix = "diag/momentum_spread_after_sync" if after_sync else "diag/momentum_spread"
                report.diagnostics.update(momentum_spread(moms, world_size=self.world_size, group=self.group,
                                                          stats=stats, prefix=prefix, shard_group=self.shard_group))
        return self.clock.now() - t0

    def _sync_momenta(self) -> None:
        moms = [m for _, m in self._momenta(self.momentum_sync.selects)]
        if not moms:
            return
        flat = torch.cat([m.reshape(-1).to(torch.float32) for m in moms])
        flat = comm.allreduce_mean(flat, wire_dtype=torch.float32, group=self.group,
                                   stats=self.stats["momentum_sync"])
        torch._foreach_copy_(moms, [v.view_as(m) for v, m in zip(flat.split([m.numel() for m in moms]), moms)])

    # ---- state --------------------------------------------------------------------------------------------
    def _comm_state(self) -> dict:
        return {"step": self._step, "exchange": self.exchange.state_dict(), "rank": self.rank,
                "world_size": self.world_size, "scheme": self.scheme.name}

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["comm"] = self._comm_state()
        return sd

    def _load_comm_state(self, extra: dict | None) -> None:
        if extra is None:
            raise ValueError(f"{type(self).__name__}.load_state_dict: no 'comm' entry (step counter, exchange "
                             "state); was this saved by a different optimizer?")
        if extra["world_size"] != self.world_size:
            raise ValueError(f"optimizer state was saved with {extra['world_size']} ranks, now {self.world_size}; "
                             "resume with the same world size")
        self._step = int(extra["step"])
        self.exchange.load_state_dict(extra["exchange"])

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("comm", None)
        super().load_state_dict(state_dict)
        self._load_comm_state(extra)

    def load_resharded(self, states: list[dict]) -> None:
        """Load the optimizer states every rank of a run with another world size saved. Replicated
        state (equal on every old rank: gradient sync, Dion's Q, step counters) is kept as is;
        per-rank floating state (update sync: momenta) is averaged over the old ranks, which is
        exactly one momentum synchronisation; the exchange remaps its own state
        (Exchange.reshard_state) or refuses."""
        if not states:
            raise ValueError("load_resharded: no saved states")
        comm_states = [s.get("comm") or {} for s in states]
        merged = _average_states([{k: v for k, v in s.items() if k != "comm"} for s in states])
        merged["comm"] = {**comm_states[0], "world_size": self.world_size, "rank": self.rank,
                          "exchange": self.exchange.reshard_state([c.get("exchange") or {} for c in comm_states])}
        self.load_state_dict(merged)

    # ---- what crosses the network: exact bytes and the alpha-beta prediction ------------------------
    def _exchanged(self) -> list[tuple[str, int, int]]:
        """(phase, elements, rows) of every call of the scheme's exchange in one step (rows: for
        mask_zero_updates' flags): the flat gradient buffers (or their buckets) for gradient sync,
        the update vector (or its buckets) for update sync. Optimizers with other exchanges override."""
        if self._buckets is not None:
            return [("grad_sync" if self.scheme.kind == sync.GRADIENT else "update_sync", b.hi - b.lo,
                     b.extra["rows"]) for b in self._buckets.buckets]
        if self.scheme.kind == sync.GRADIENT:
            return [("grad_sync", buf.numel(), 1) for buf in self.grad_buffers.values()]
        return [("update_sync", self.layout.numel, sum(e.rows for e in self.layout.entries))]

    def _extra_calls(self) -> list[tuple[str, int, int]]:
        """(phase, elements, bits) of collectives outside the scheme (e.g. Dion's clipping norm);
        momentum sync and the divergence guard's 4-byte agreement are not counted here."""
        return []

    def wire_bytes_per_step(self, world_size: int | None = None, rank: int | None = None) -> dict[str, tuple[int, int]]:
        """Payload bytes (sent, received) a rank hands to collectives in one step, by phase, as
        comm.CommStats books them (diagnostics, momentum sync and the guard excluded; 0 at one rank).
        world_size and rank default to this optimizer's (pass others to predict another run)."""
        P = self.world_size if world_size is None else world_size
        rank = self.rank if rank is None else rank
        out: dict[str, tuple[int, int]] = {}
        for phase, n, rows in self._exchanged():
            s, r = self.scheme.bytes_per_call(self.scheme_options, P, n, rank=rank, rows=rows)
            a, b = out.get(phase, (0, 0))
            out[phase] = (a + s, b + r)
        if P > 1:
            for phase, n, bits in self._extra_calls():
                a, b = out.get(phase, (0, 0))
                out[phase] = (a + n * bits // 8, b + n * bits // 8)
        return out

    def predict_comm_seconds(self, alpha: float, beta: float, world_size: int | None = None) -> float:
        """Alpha-beta prediction of one step's communication (the scheme's own model per exchange,
        the ring allreduce for side collectives); alpha in s per message, beta in s per bit."""
        P = self.world_size if world_size is None else world_size
        if P <= 1:
            return 0.0
        t = sum(self.scheme.predict(self.scheme_options, P, n, alpha, beta, rows=rows)
                for _, n, rows in self._exchanged() if n)
        return t + sum(cost_model.ring_allreduce(P, n, bits, alpha, beta) for _, n, bits in self._extra_calls())

    def describe(self) -> str:
        """One line for the run banner: optimizer, scheme and its options."""
        opts = ", ".join(f"{k}={v}" for k, v in self.scheme_options.as_dict().items())
        return f"{type(self).__name__} | comm {self.scheme.name} ({self.scheme.kind} sync{'; ' + opts if opts else ''})"


def _overlap_stats(opt: "CommOptimizer") -> CommStats:
    """The CommStats that background exchanges book into (their seconds overlap compute)."""
    return opt.stats[_overlap.BACKGROUND]


def _average_states(states: list[Any]) -> Any:
    """Leafwise: floating tensors that differ across `states` -> their mean (an fp32 sum in rank
    order, divided by the count, as a mean-allreduce does); anything equal everywhere, and every
    non-floating leaf, -> the first state's."""
    first = states[0]
    if isinstance(first, torch.Tensor):
        if first.is_floating_point() and not all(torch.equal(first, s) for s in states[1:]):
            total = torch.zeros_like(first, dtype=torch.float32)
            for s in states:
                total += s.to(torch.float32)
            return total.div_(len(states)).to(first.dtype)
        return first
    if isinstance(first, dict):
        return {k: _average_states([s[k] for s in states]) if all(isinstance(s, dict) and k in s for s in states)
                else v for k, v in first.items()}
    if isinstance(first, list) and all(isinstance(s, list) and len(s) == len(first) for s in states):
        return [_average_states([s[i] for s in states]) for i in range(len(first))]
    return first


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the raw bytes of `tensors` in order (bit-identity checks across ranks)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


__all__ = ["COMM_PHASES", "CommOptimizer", "Entry", "FlatLayout", "MomentumSync", "PHASES", "StepReport",
           "attach_flat_grads", "digest"]
