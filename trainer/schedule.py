"""Learning-rate schedules: linear warmup, then cosine, linear, warmup-stable-decay (WSD) or constant.

Every decaying schedule ends at min_lr = min_lr_ratio * base_lr at step `horizon` (min_lr_ratio 0:
to zero) and stays there past it. WSD (Hu et al., MiniCPM §4; Hägele et al., "Scaling Laws and
Compute-Optimal Training Beyond Fixed Training Durations") holds the peak rate after warmup and
decays only over the last `decay_fraction` of the horizon, with a shape: linear (1 - p), cosine
((1 + cos(pi p)) / 2) or sqrt (1 - sqrt(p)), p the progress through the decay in [0, 1].

The horizon is the run's first train.max_steps, stored in its checkpoints: a resumed run keeps
its schedule when train.max_steps changes (optim.schedule_steps sets another one explicitly).
"""
from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "wsd", "constant")
DECAY_SHAPES = ("linear", "cosine", "sqrt")


def decay_steps(horizon: int, decay_fraction: float) -> int:
    """Steps of WSD's final decay: decay_fraction of the horizon, rounded, at least 1."""
    return max(1, round(decay_fraction * horizon))


def _shape(p: float, shape: str) -> float:
    """The decay factor from 1 (p = 0) to 0 (p = 1)."""
    if shape == "linear":
        return 1.0 - p
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    if shape == "sqrt":
        return 1.0 - math.sqrt(p)
    raise ValueError(f"decay shape {shape!r}; choose one of {', '.join(DECAY_SHAPES)}")


def lr_at(step: int, base_lr: float, max_steps: int, warmup_steps: int = 0, schedule: str = "cosine",
          min_lr_ratio: float = 0.1, decay_fraction: float = 0.2, decay_shape: str = "linear") -> float:
    """LR for optimizer step `step` (0-based); `max_steps` is the schedule's horizon."""
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    min_lr = base_lr * min_lr_ratio
    if schedule == "wsd":
        n_decay = decay_steps(max_steps, decay_fraction)
        start = max_steps - n_decay
        if step < start:
            return base_lr
        return min_lr + (base_lr - min_lr) * _shape(min(1.0, (step - start) / n_decay), decay_shape)
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return min_lr + (base_lr - min_lr) * _shape(progress, "linear")
    if schedule == "cosine":  # this exact expression: the golden digests depend on its rounding
        return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def schedule_note(horizon: int, max_steps: int) -> str:
    """The console line of a resumed run whose train.max_steps differs from its schedule's horizon."""
    what = (f"the lr stays at the schedule's final value from step {horizon} to {max_steps}" if max_steps > horizon
            else f"the run stops at step {max_steps}, before the schedule's decay ends")
    return (f"schedule: train.max_steps={max_steps} but this run's lr schedule ends at step {horizon} (kept from the "
            f"run's start); {what}. Set optim.schedule_steps={max_steps} to stretch the schedule to the new length")
