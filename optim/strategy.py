"""How a step synchronises the replicas: one small strategy object per sync kind, chosen from the
scheme's kind (optim.sync), so the base (optim/base.py) asks the strategy instead of branching on
the kind.

- `GradientSync` (GRADIENT schemes): the flat gradient is exchanged before clipping and the
  update; every replica then holds one shared optimizer state.
- `UpdateSync` (UPDATE schemes): no gradient crosses the network; the optimizer's `_update`
  exchanges its own vector (Lion Cub's c_local); every rank keeps its own state (momenta may drift
  apart: momentum sync and the spread diagnostic apply).
- `LocalSync` (LOCAL schemes: comm.mode=diloco): local updates with an outer synchronisation every
  H steps (DiLoCo, docs/diloco.md): `shared_state = False` (the replicas drift between outer
  steps), `exchanges_own_vector = False` (the inner optimizer steps on its local gradient: the
  registry's "lion" entry then builds Lion, not Distributed Lion), `replicas_step_apart = True`
  (an optimizer's own per-step reductions over the replicas, Dion's clipping norm, stay on the
  worker), `exchange_gradients` does nothing, `bind` builds the outer loop from the optimizer's parameter groups and group,
  `after_update` counts the applied steps and runs the outer step when one is due (a step the
  divergence guard skipped never reaches it); on a diagnostics step (`diagnosed_update`) the
  fragment sent after it also reports the workers' drift; `evaluation` puts the global
  parameters in the model (evaluation and a checkpoint's model); `finish` applies the averages
  still in flight and reports their bytes.

A strategy hooks into a step at two points: `exchange_gradients` (before clipping) and
`after_update` (after the update, before momentum sync and diagnostics; `diagnosed_update` in its
place on a step that takes diagnostics), and tells the base how
to lay out and bucket the exchanged vector and what one step sends; the trainer asks it for the
parameters evaluation reports (`evaluation`) and ends it before the final evaluation (`finish`,
which returns a report of what the end sends, e.g. DiLoCo's averages still in flight, or None).
A new kind registers its own strategy with `register_strategy(cls)`; the base does not change.
"""
from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch

from . import overlap as _overlap
from . import sync
from .accounting import BACKGROUND, Call, StepReport
from .outer_loop import OuterLoop


class SyncStrategy:
    """What a sync kind does in a step; stateless here (one instance per optimizer, `bind` may
    give a subclass state of its own)."""

    kind: ClassVar[str]
    shared_state: ClassVar[bool]
    """After every step all replicas hold the same optimizer state (so momentum sync, the momentum
    spread diagnostic and averaging per-rank state on resharding have nothing to do)."""
    exchanges_own_vector: ClassVar[bool]
    """The optimizer's `_update` hands its own vector to the exchange (not the base's gradient)."""
    replicas_step_apart: ClassVar[bool] = False
    """Between synchronisations each replica steps on its own gradient and nothing of the step crosses
    the replicate axis, so an optimizer's own per-step reductions over the replicas (Dion's clipping
    norm) must stay on this replica."""

    def bind(self, opt: Any) -> None:
        """Called once at the end of the base's constructor (a strategy with state builds it here)."""

    def layout_order(self, order: list[torch.nn.Parameter], bucket_bytes: float) -> list | None:
        """The order of the flat layout (FlatLayout), or None for the parameter groups' role order."""
        return None

    def buckets(self, opt: Any, order: list[torch.nn.Parameter]) -> list[_overlap.Bucket]:
        raise NotImplementedError

    def bucket_problem(self, opt: Any) -> bool:
        """True when `opt` (its class) cannot hand this strategy its vector in buckets."""
        return not opt.bucketed

    def exchange_gradients(self, opt: Any, step: int) -> None:
        """Before clipping and the update."""

    def after_update(self, opt: Any, step: int) -> None:
        """After the update of step `step`, before momentum sync and diagnostics."""

    def diagnosed_update(self, opt: Any, step: int) -> tuple[dict[str, float], float]:
        """`after_update` on a step that takes diagnostics (step(diagnose=True)): also this kind's own
        diagnostics of the step ("diag/..." keys, collectives booked in opt.stats["diag"]) and the
        seconds they took (left out of the step's time). Default: after_update, none."""
        self.after_update(opt, step)
        return {}, 0.0

    def exchanged(self, opt: Any) -> list[Call]:
        """Every call of the scheme's exchange in one step (the byte formula and the prediction)."""
        return []

    def evaluation(self, opt: Any) -> contextlib.AbstractContextManager:
        """The parameters evaluation reports, in the model for the duration (default: as they are);
        the trainer also writes a checkpoint's model inside it. The optimizer's state_dict inside it
        is the one outside it."""
        return contextlib.nullcontext()

    def finish(self, opt: Any) -> StepReport | None:
        """The end of training, before the final evaluation, parameter check and checkpoint. A kind
        whose end sends something returns a StepReport of it (booked in the optimizer's phases like a
        step's; the trainer writes it as a record of its own, event "finish"); None: nothing is sent."""
        return None


class GradientSync(SyncStrategy):
    kind = sync.GRADIENT
    shared_state = True
    exchanges_own_vector = False

    def buckets(self, opt, order):
        return _overlap.gradient_buckets(order, opt.bucket_bytes, opt.grads.buffers)

    def exchange_gradients(self, opt, step):
        """Average every flat gradient buffer: one collective each, or one per bucket."""
        if opt._buckets is not None:
            if opt._bucket_results is None:  # overlap drained them at the start of the step
                opt._buckets.finish(step)
            return
        for buf in opt.grads.buffers.values():
            opt.exchange(buf, step)

    def exchanged(self, opt):
        if opt._buckets is not None:
            return [Call(opt.scheme.phase, b.hi - b.lo, b.rows) for b in opt._buckets.buckets]
        return [Call(opt.scheme.phase, buf.numel(), 1) for buf in opt.grads.buffers.values()]


class UpdateSync(SyncStrategy):
    kind = sync.UPDATE
    shared_state = False
    exchanges_own_vector = True

    def layout_order(self, order, bucket_bytes):
        # in buckets: the vector in bucket order, so every bucket is one contiguous part
        return _overlap.update_order(order, bucket_bytes) if bucket_bytes > 0 else None

    def buckets(self, opt, order):
        return _overlap.update_buckets(order, opt.bucket_bytes, opt.ctx, opt.stats[BACKGROUND], opt._bucket_vector)

    def bucket_problem(self, opt):
        return not opt.bucketed or not opt.cuts_own_vector

    def exchanged(self, opt):
        if opt._buckets is not None:
            return [Call(opt.scheme.phase, b.hi - b.lo, b.rows) for b in opt._buckets.buckets]
        return [Call(opt.scheme.phase, opt.layout.numel, sum(opt.layout.rows))]


class LocalSync(SyncStrategy):
    """LOCAL schemes (comm.mode=diloco): the inner optimizer steps each worker's own gradient (with
    parallel.shard_size > 1 already averaged inside the shard group by FSDP); nothing crosses the
    replicate axis per step. After every applied update the outer loop (optim/diloco.py OuterLoop)
    counts the inner step and, on its schedule, averages the pseudo-gradients and applies the
    outer step. Every worker keeps its own inner state and local parameters."""

    kind = sync.LOCAL
    shared_state = False
    exchanges_own_vector = False
    replicas_step_apart = True

    def bind(self, opt):
        self.loop = OuterLoop.for_optimizer(opt)
        opt.exchange.outer = self.loop  # its state rides in the optimizer's checkpoint

    def buckets(self, opt, order):
        raise ValueError(f"comm.bucket_mb: comm.mode={opt.scheme.name} exchanges nothing per step; "
                         f"set comm.bucket_mb=0")

    def bucket_problem(self, opt):
        return True

    def after_update(self, opt, step):
        self.loop.after_inner_step()

    def diagnosed_update(self, opt, step):
        # the workers' drift of the fragment sent after this step, if one is
        return self.loop.diagnosed_inner_step()

    def exchanged(self, opt):
        # the scheme's formula for the whole vector is its average per inner step over a cycle
        return [Call(opt.scheme.phase, sum(self.loop.outer.numels), 1)]

    def evaluation(self, opt):
        return self.loop.global_params()

    def finish(self, opt):
        # the averages still in flight (sent in the last tau steps) are waited for and applied here,
        # after the last step's report: their bytes are this report's
        t0 = opt.clock.now()
        opt.stats.begin_step()
        self.loop.finish()
        return StepReport(step=opt.steps_done, seconds=opt.clock.now() - t0, phases=opt.stats.step_summary())


_STRATEGIES: dict[str, type[SyncStrategy]] = {}


def register_strategy(cls: type[SyncStrategy], *, replace: bool = False) -> type[SyncStrategy]:
    """Make `cls` the strategy of schemes of kind `cls.kind`."""
    if cls.kind in _STRATEGIES and not replace:
        raise ValueError(f"sync kind {cls.kind!r} already has a strategy; pass replace=True to override it")
    _STRATEGIES[cls.kind] = cls
    return cls


def strategy_for(scheme: sync.SyncScheme) -> type[SyncStrategy]:
    if scheme.kind not in _STRATEGIES:
        raise ValueError(f"comm.mode={scheme.name}: no sync strategy for its kind {scheme.kind!r}; known kinds: "
                         f"{', '.join(_STRATEGIES)}")
    return _STRATEGIES[scheme.kind]


register_strategy(GradientSync)
register_strategy(UpdateSync)
register_strategy(LocalSync)

__all__ = ["GradientSync", "LocalSync", "SyncStrategy", "UpdateSync", "register_strategy", "strategy_for"]
