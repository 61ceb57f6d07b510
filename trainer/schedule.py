"""Learning-rate schedules: linear warmup, then cosine decay or constant."""
from __future__ import annotations

import math


def lr_at(step: int, base_lr: float, max_steps: int, warmup_steps: int = 0, schedule: str = "cosine",
          min_lr_ratio: float = 0.1) -> float:
    """LR for optimizer step `step` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    min_lr = base_lr * min_lr_ratio
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
