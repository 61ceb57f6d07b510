"""The optimizer base that owns communication (in the style of modded-nanogpt's distributed
optimizers: the collective happens inside `step()`; there is no DDP wrapper).

A `CommOptimizer` is built from the run's `RunPlan` (optim/plan.py: scheme, options, buckets,
overlap, kernels, momentum sync, clipping, world size; resolved and validated once by
optim.registry.resolve) and composes:
- the flat layout (optim/layout.py, Lion Cub App. D.2): `FlatLayout`, every trainable parameter
  once in role order (or bucket order), with views by parameter and by role, for update-sync
  vectors (Lion Cub's c_local), momentum sync and diagnostics; and `GradBuffers`, ONE flat
  gradient buffer per dtype of which every `.grad` is a view;
- the sync scheme chosen by `comm.mode` (optim.sync) and the strategy of its kind
  (optim/strategy.py): `GradientSync` exchanges the flat gradient before the update;
  under `UpdateSync` the subclass's `_update` calls `self.exchange` on its own vector; a strategy
  also has a hook after the update (`after_update`; `diagnosed_update` on a diagnostics step,
  which may add the kind's own diagnostics), so a kind that synchronises otherwise plugs in
  without a change here;
- buckets and overlap (optim/overlap.py), when `comm.bucket_mb` > 0;
- byte and time accounting (optim/accounting.py): the per-phase CommStats, the `StepReport`, and
  the step's exact bytes and alpha-beta time from what `_exchanged` / `_extra_calls` list;
- the divergence guard (optim/guard.py): one 4-byte agreement on non-finite values and stop;
- gradient clipping (global norm after a gradient exchange; each rank's local norm for update
  sync, where no gradient crosses the network) and hooks after the update: diagnostics (on
  request, measured BEFORE a momentum sync of the same step) and momentum synchronisation of
  selected roles on a schedule (Lion Cub §5).

`step(diagnose=False)` returns a `StepReport`. Nothing is communicated through attributes set
from outside or a process-wide stats object.

Subclasses implement `_update(step) -> dict | None` (the local math and, for update sync, the
exchange) and, where per-rank state exists, `momentum_of(param)` and `_diagnostics(out)`. They
configure themselves through their constructor's arguments, after `super().__init__` (which calls
no method a subclass overrides), and through the class attributes `optim_name` and `bucketed`.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, ClassVar, Iterable

import torch

import comm
from comm import Clock
from comm import kernels as _kernels
from comm import native as _native

from . import overlap as _overlap
from . import sync
from .accounting import Call, PhaseStats, SideCall, StepReport
from .accounting import predict_seconds as _predict_seconds
from .accounting import wire_bytes as _wire_bytes
from .diagnostics import momentum_spread
from .guard import Guard, Verdict
from .layout import Entry, FlatLayout, GradBuffers, model_order
from .plan import MomentumSync, RunPlan
from .registry import resolve


class CommOptimizer(torch.optim.Optimizer):
    """Base of every optimizer of the project; see the module docstring."""

    optim_name: ClassVar[str | None] = None
    """The registry entry (`optim.name`) that builds this class: an optimizer built directly, not
    through build_optimizer, is checked against that entry's `accepts` (the rule's one home)."""
    bucketed: ClassVar[bool] = True
    """Whether the vector this optimizer hands its scheme can be exchanged in buckets: the base's
    flat gradient under gradient sync; under update sync the subclass's own vector, which it then
    cuts with `_bucket_vector` (an update-sync optimizer without one cannot)."""

    def __init__(self, param_groups: Iterable, defaults: dict, *, plan: RunPlan | None = None, group=None,
                 param_order: list[torch.nn.Parameter] | None = None, shard_group=None, **settings: Any) -> None:
        """`plan`: the run's resolved settings (optim.registry.resolve; build_optimizer passes it). A
        class built directly passes the plan's keywords instead (scheme, scheme_options, grad_clip,
        momentum_sync, kernels, fine_timing, bucket_mb, overlap) and gets a plan resolved from them
        and `defaults` against its registry entry (`optim_name`)."""
        super().__init__(param_groups, defaults)
        # hybrid sharding (trainer/parallel.py): the parameters are this rank's local shards,
        # `group` the replicate group; per-tensor reductions (norms, the guard) also sum over the
        # shard group, which holds the other shards
        self.shard_group = shard_group
        self.group = group
        self.world_size, self.rank = comm.world(group)
        if plan is None:
            plan = self._plan_from(defaults, settings)
        elif settings:
            raise TypeError(f"{type(self).__name__}: pass either a plan or its settings, not both "
                            f"(got {', '.join(sorted(settings))})")
        if plan.world_size != self.world_size:
            raise ValueError(f"{type(self).__name__}: the plan was resolved for {plan.world_size} ranks, the group "
                             f"has {self.world_size}; resolve it with world_size={self.world_size}")
        self.plan = plan
        self.scheme, self.scheme_options = plan.scheme, plan.scheme_options
        self.strategy = plan.strategy()
        order = model_order(self.param_groups, param_order)
        if not order:
            raise ValueError("the optimizer got no trainable parameter")
        self.bucket_bytes, self.overlap = plan.bucket_bytes, plan.overlap
        if self.bucket_bytes > 0 and self.strategy.bucket_problem(self):  # the scheme's side is in the plan
            raise ValueError(f"comm.bucket_mb / comm.overlap: {type(self).__name__} on comm.mode={self.scheme.name} "
                             f"cannot exchange its vector in buckets; set comm.bucket_mb=0 and comm.overlap=false")
        self.layout = FlatLayout(self.param_groups, self.strategy.layout_order(order, self.bucket_bytes))
        self.kernels = plan.kernels
        why = _native.unavailable(self.layout.device) if self.kernels == "native" else None
        if why is not None:  # a fact of this device, not of the settings: only known here
            raise ValueError(f"comm.kernels=native: {why}; use comm.kernels=auto, compiled or eager")
        self.stats = PhaseStats(timing=plan.fine_timing)
        self.grads = GradBuffers(order)
        self.grad_clip = plan.grad_clip
        self.momentum_sync = plan.momentum_sync
        if self.momentum_sync is not None and not any(self.momentum_sync.selects(r) for r in self.layout.roles):
            raise ValueError(f"comm.momentum_sync.layers={list(self.momentum_sync.layers)} selects no parameter; "
                             f"roles present: {self.layout.roles} (a head tied to the embedding has role 'embedding')")
        device = self.layout.device
        # the run's wire kernels: which implementation runs each, what auto measured (one object per
        # optimizer, handed to its exchange; self.kernels stays the comm.kernels setting)
        self.kernel_set = _kernels.Kernels(self.kernels, device)
        self.clock = Clock(device)
        self.guard = Guard(group, self.stats["guard"], shard_group)
        # independent random stream per rank, reproducible from the run's seed
        seed = (torch.initial_seed() * 1_000_003 + 7919 * (self.rank + 1)) % (2 ** 63 - 1)
        self.ctx = sync.ExchangeContext(
            world_size=self.world_size, rank=self.rank, group=group, stats=self.stats[self.scheme.phase],
            segments=self.layout.segments, rows=self.layout.rows, device=device, seed=seed, kernels=self.kernel_set,
            shard_group=shard_group)
        self.exchange = self.scheme.build(self.scheme_options, self.ctx)
        self._step = 0
        self._bucket_results = None
        self._buckets: _overlap.Overlap | None = None
        if self.bucket_bytes > 0:
            self._buckets = _overlap.Overlap(self.strategy.buckets(self, order), self.exchange, self._book_bucket,
                                             self.ctx.stats, self.clock, self.overlap)
        self.strategy.bind(self)

    def _plan_from(self, defaults: dict, settings: dict) -> RunPlan:
        """The plan of a class built directly: its keywords and `defaults`, checked against its entry."""
        known = {"scheme", "scheme_options", "grad_clip", "momentum_sync", "kernels", "fine_timing", "bucket_mb",
                 "overlap"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"{type(self).__name__}: unexpected keyword argument(s) {', '.join(unknown)}")
        scheme = settings.get("scheme", "fp32")
        return resolve(self.optim_name, comm_mode=scheme, comm_options=settings.get("scheme_options"),
                       betas=defaults.get("betas"), eps=defaults.get("eps"), lr=defaults.get("lr"),
                       weight_decay=defaults.get("weight_decay"), beta1=defaults.get("beta"),
                       grad_clip=settings.get("grad_clip", 0.0), momentum_sync=settings.get("momentum_sync"),
                       world_size=self.world_size,
                       shard_size=comm.world(self.shard_group)[0] if self.shard_group is not None else 1,
                       bucket_mb=settings.get("bucket_mb", 0.0), overlap=settings.get("overlap", False),
                       kernels=settings.get("kernels", "eager"), fine_timing=settings.get("fine_timing", True),
                       shard_dims={})  # a class that asks for placements takes them as its own keyword (Muon, Dion)

    @property
    def grad_buffers(self) -> dict[torch.dtype, torch.Tensor]:
        """The flat gradient buffers, one per dtype (optim.layout.GradBuffers)."""
        return self.grads.buffers

    def _order_grads(self, order: list[torch.nn.Parameter]) -> None:
        """Lay the flat gradient buffers out in `order` instead of the model's (a subclass that
        exchanges only some gradients puts them first, so they form one contiguous slice). Called
        from a subclass's constructor, before any backward; not with gradient buckets (they are
        slices of the buffers; an update-sync optimizer's buckets cut its own vector)."""
        if self._buckets is not None and not self.strategy.exchanges_own_vector:
            raise ValueError(f"{type(self).__name__}: the gradient buffers are bucketed; they cannot be reordered")
        self.grads = GradBuffers(order)

    # ---- buckets and overlap (optim/overlap.py) -----------------------------------------------------
    @property
    def cuts_own_vector(self) -> bool:
        """This class cuts its own update vector into buckets (it overrides `_bucket_vector`)."""
        return type(self)._bucket_vector is not CommOptimizer._bucket_vector

    def expect_backward(self, final: bool = True) -> None:
        """Call before each backward of a step: `final` on the last micro-batch of the accumulation
        (with comm.overlap, buckets are launched during that backward only)."""
        if self._buckets is not None:
            self._buckets.expect_backward(final, self._step + 1)

    def _book_bucket(self, b: _overlap.Bucket) -> tuple[str, int, int]:
        sent, recv = self.scheme.bytes_per_call(self.scheme_options, self.world_size, b.hi - b.lo, self.rank, b.rows)
        return f"{self.scheme.name}[bucket {b.index}]", sent, recv

    def _bucket_vector(self, b: _overlap.UpdateBucket) -> torch.Tensor:  # pragma: no cover - interface
        """The vector of bucket b to exchange (update-sync optimizers that exchange in buckets)."""
        raise NotImplementedError

    # ---- what subclasses implement ------------------------------------------------------------
    def _update(self, step: int) -> dict | None:  # pragma: no cover - interface
        """Apply one update to the parameters (after gradient sync and clipping); return what
        `_diagnostics` needs, or None."""
        raise NotImplementedError

    def momentum_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The momentum tensor that momentum sync and the spread diagnostic use (None: none)."""
        return None

    def _exchange_gradients(self, step: int) -> None:
        """Before clipping and the update: the strategy's (optim.strategy: a gradient scheme averages
        every flat gradient buffer; under update sync the subclass exchanges its own vector in
        `_update`). Subclasses that exchange only part of the gradient override this."""
        self.strategy.exchange_gradients(self, step)

    def warmup(self) -> float:
        """Compile the fused kernels this optimizer and its exchange use (comm.kernels), before the
        first timed step; returns the seconds spent (0 when nothing is compiled)."""
        if self.kernels == "eager":
            return 0.0
        seconds = self._warmup_own_kernels() + self.exchange.warmup()
        if self.kernels == "auto":  # ranks that exchange run the same kernels
            self.kernel_set.agree(self.group)
        return seconds

    def kernel_choices(self) -> list[str]:
        """One line per kernel that comm.kernels=auto timed in warm-up: the candidate it keeps."""
        return self.kernel_set.lines()

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
        self.grads.zero_()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, diagnose: bool = False,
             loss_finite: bool | None = None, stop: bool = False) -> StepReport:
        """One step. With `loss_finite` given (the divergence guard, optim/guard.py), every rank
        first checks its loss and local gradient for NaN / inf and all ranks agree (one tiny
        collective, the "guard" phase); if any rank found one, nothing is exchanged or updated and
        the report says so. `stop` (this rank wants to stop, e.g. on a signal) rides on the same
        collective: the report's `stop` is true on every rank when it was true on any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = self.clock.now()
        self.stats.begin_step()
        self.grads.adopt()
        # overlap: wait for the buckets in flight before any other collective of the step (a
        # background exchange must never interleave with the main thread's collectives)
        self._bucket_results = self._buckets.finish(self._step + 1) if self._buckets is not None and self.overlap \
            else None
        verdict = self.guard(self.grads.local_norm(), loss_finite, stop) if loss_finite is not None \
            else Verdict(nonfinite=False, stop=stop)
        if verdict.nonfinite:
            report = StepReport(step=self._step, loss=loss, nonfinite=True, stop=verdict.stop)
            report.seconds = self.clock.now() - t0
            report.phases = self.stats.step_summary()
            return report
        self._step += 1
        t = self._step
        self._exchange_gradients(t)
        grad_norms = self._grad_norms()
        if self.grad_clip > 0:
            self._clip_(grad_norms[-1])
        out = self._update(t)
        report = StepReport(step=t, loss=loss, grad_norms=grad_norms, stop=verdict.stop)
        if diagnose:  # the strategy's own diagnostics of the step (e.g. DiLoCo's worker drift)
            kind_diag, report.diag_seconds = self.strategy.diagnosed_update(self, t)
            report.diagnostics.update(kind_diag)
        else:
            self.strategy.after_update(self, t)
        due = self.momentum_sync is not None and self.momentum_sync.due(t)
        if diagnose:
            report.diag_seconds += self._run_diagnostics(report, out, after_sync=False)
        if due:
            self._sync_momenta()
            if diagnose:
                report.diag_seconds += self._run_diagnostics(report, None, after_sync=True)
        report.seconds = self.clock.now() - t0 - report.diag_seconds
        report.phases = self.stats.step_summary()
        return report

    @property
    def grad_norm_roles(self) -> list[str]:
        return self.layout.roles

    def _grad_norms(self) -> torch.Tensor:
        """Per-role and global L2 norms of the gradient (fp32, on the device, no host sync); the global
        one is torch.nn.utils.clip_grad_norm_'s total norm of the same gradients."""
        views = self.grads.views
        grads = [views[id(e.param)] for e in self.layout.entries]
        sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square()  # one norm per tensor
        roles = torch.zeros(len(self.layout.roles), device=sq.device).index_add_(0, self.layout.role_index(), sq)
        if self.shard_group is not None:  # hybrid sharding: add the other shards' squares (whole tensors' norms)
            torch.distributed.all_reduce(roles, group=self.shard_group)
        return torch.cat([roles, roles.sum()[None]]).sqrt()

    def _clip_(self, norm: torch.Tensor) -> None:
        """Scale every gradient by min(1, grad_clip / (norm + 1e-6)); `norm` is `_grad_norms`' global
        norm (per-tensor norms summed in layout order, so it does not depend on how the gradient
        buffers are laid out, and no second pass over the gradient or shard-group reduction is
        needed). A subclass whose clipping norm is another one computes its own and ignores it."""
        scale = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
        for b in self.grads.buffers.values():
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
        if not self.strategy.shared_state:  # momenta that can drift apart: their spread
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

    def load_resharded(self, states: Iterable[dict]) -> None:
        """Load the optimizer states every rank of a run with another world size saved, in rank
        order (any iterable, read once: a generator that loads one rank's file at a time keeps
        the memory of about two states). Replicated state (equal on every old rank: gradient
        sync, Dion's Q, step counters) is kept as is; per-rank floating state (update sync:
        momenta) is averaged over the old ranks, which is exactly one momentum synchronisation;
        the exchange remaps its own state (Exchange.reshard_state) or refuses."""
        mean, exchanges, comm0, q = StateMean(), [], None, -1
        for s in states:  # not enumerate(): its reused result tuple keeps the last state alive into the next read
            q += 1
            comm = s.get("comm") or {}
            ex = comm.get("exchange") or {}
            if ex and not self.exchange.remaps_state:  # refused whatever the others hold: read no further
                raise ValueError(f"comm.mode exchange {type(self.exchange).__name__} keeps per-rank state (saved "
                                 f"rank {q}'s: {', '.join(sorted(ex))}) that cannot be remapped to another world size")
            comm0 = comm if comm0 is None else comm0
            exchanges.append(ex)  # only where it remaps them (pbit: a generator's state) or they are empty
            mean.add({k: v for k, v in s.items() if k != "comm"})
            del s, comm, ex  # not alive while the next one is read
        if comm0 is None:
            raise ValueError("load_resharded: no saved states")
        merged = mean.result()
        merged["comm"] = {**{k: v for k, v in comm0.items() if k != "exchange"}, "world_size": self.world_size,
                          "rank": self.rank, "exchange": self.exchange.reshard_state(exchanges)}
        self.load_state_dict(merged)

    # ---- what crosses the network: exact bytes and the alpha-beta prediction (optim/accounting.py) --
    def _exchanged(self) -> list[Call]:
        """Every call of the scheme's exchange in one step: the flat gradient buffers (or their
        buckets) for gradient sync, the update vector (or its buckets) for update sync. Optimizers
        with other exchanges override."""
        return self.strategy.exchanged(self)

    def _extra_calls(self) -> list[SideCall]:
        """Collectives outside the scheme (e.g. Dion's clipping norm); momentum sync and the
        divergence guard's 4-byte agreement are not counted here."""
        return []

    def wire_bytes_per_step(self, world_size: int | None = None, rank: int | None = None) -> dict[str, tuple[int, int]]:
        """Payload bytes (sent, received) a rank hands to collectives in one step, by phase, as
        comm.CommStats books them (diagnostics, momentum sync and the guard excluded; 0 at one rank).
        world_size and rank default to this optimizer's (pass others to predict another run)."""
        return _wire_bytes(self.scheme, self.scheme_options, self._exchanged(), self._extra_calls(),
                           self.world_size if world_size is None else world_size, self.rank if rank is None else rank)

    def predict_comm_seconds(self, alpha: float, beta: float, world_size: int | None = None) -> float:
        """Alpha-beta prediction of one step's communication (the scheme's own model per exchange,
        the ring allreduce for side collectives); alpha in s per message, beta in s per bit."""
        return _predict_seconds(self.scheme, self.scheme_options, self._exchanged(), self._extra_calls(),
                                self.world_size if world_size is None else world_size, alpha, beta)

    def describe(self) -> str:
        """One line for the run banner: optimizer, scheme and its options."""
        opts = ", ".join(f"{k}={v}" for k, v in self.scheme_options.as_dict().items())
        return f"{type(self).__name__} | comm {self.scheme.name} ({self.scheme.kind} sync{'; ' + opts if opts else ''})"


class StateMean:
    """`average_states` as a fold: `add` the states one at a time, in rank order, then `result()`.
    It holds the first state, a float32 running sum for each floating tensor once a state differs
    from the first there, and nothing of the others, so a resume on another world size needs the
    memory of about two states, not one per saved rank. The result is the same bits as the
    list form (the sum is taken in the same order: the first state once per state equal to it)."""

    def __init__(self) -> None:
        self._root: _MeanNode | None = None

    def add(self, state: Any) -> None:
        if self._root is None:
            self._root = _MeanNode(state)
        else:
            self._root.add(state)

    def result(self) -> Any:
        if self._root is None:
            raise ValueError("StateMean: no states added")
        return self._root.result()


class _MeanNode:
    """One position of the states' tree: dicts and lists by child, floating tensors by their sum."""

    def __init__(self, first: Any) -> None:
        self.first, self.count, self.total, self.whole = first, 1, None, False
        self.error: Exception | None = None  # raised by result() unless a parent keeps the first's value whole
        self.kids: Any = None
        if isinstance(first, dict):
            self.kids = {k: _MeanNode(v) for k, v in first.items()}
        elif isinstance(first, list):
            self.kids = [_MeanNode(v) for v in first]

    def add(self, s: Any) -> None:
        if self.whole:  # a state broke this position's structure: the first's value, whole
            return
        self.count += 1
        first = self.first
        if isinstance(first, dict):
            if not isinstance(s, dict):
                self.whole, self.kids = True, None
                return
            for k, kid in self.kids.items():
                if k in s:
                    kid.add(s[k])
                else:  # a key some state lacks: the first's value
                    kid.whole, kid.kids, kid.total = True, None, None
        elif isinstance(first, list):
            if not (isinstance(s, list) and len(s) == len(first)):
                self.whole, self.kids = True, None
                return
            for kid, v in zip(self.kids, s):
                kid.add(v)
        elif isinstance(first, torch.Tensor) and first.is_floating_point() and self.error is None:
            # a state that cannot be combined here (another shape or type) is an error only if this position
            # is averaged in the end: a later state may still make a parent keep the first's value whole
            try:
                if not isinstance(s, torch.Tensor):
                    raise TypeError(f"expected a tensor, got {type(s).__name__}")
                if self.total is None:
                    if torch.equal(first, s):
                        return
                    self.total = torch.zeros_like(first, dtype=torch.float32)
                    for _ in range(self.count - 1):  # the states before this one, all equal to the first
                        self.total += first.to(torch.float32)
                self.total += s.to(torch.float32)
            except (TypeError, RuntimeError) as e:
                self.error, self.total = e, None

    def result(self) -> Any:
        if self.whole:
            return self.first
        if self.error is not None:
            raise self.error
        if isinstance(self.first, dict):
            return {k: kid.result() for k, kid in self.kids.items()}
        if isinstance(self.first, list):
            return [kid.result() for kid in self.kids]
        if self.total is not None:
            return self.total.div_(self.count).to(self.first.dtype)
        return self.first


def average_states(states: Iterable[Any]) -> Any:
    """Leafwise: floating tensors that differ across `states` -> their mean (an fp32 sum in rank
    order, divided by the count, as a mean-allreduce does); anything equal everywhere, and every
    non-floating leaf, -> the first state's. A dict key that some state lacks, and a position whose
    type or list length differs across states, -> the first state's value. `states` may be any
    iterable, read once (StateMean)."""
    mean = StateMean()
    for s in states:
        mean.add(s)
    return mean.result()


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 of the raw bytes of `tensors` in order (bit-identity checks across ranks)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


__all__ = ["CommOptimizer", "MomentumSync", "StateMean", "average_states", "digest"]
