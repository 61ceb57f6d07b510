import math

import pytest

from trainer.schedule import lr_at


def test_warmup_then_cosine_to_min():
    lrs = [lr_at(s, 1.0, 100, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1) for s in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0  # linear warmup reaches the peak on its last step
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # monotone decay afterwards
    assert math.isclose(lrs[10], 1.0) and math.isclose(lrs[55], 0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(lr_at(100, 1.0, 100, 10, "cosine", 0.1), 0.1)


def test_constant_schedule():
    assert [lr_at(s, 3e-4, 50, 0, "constant") for s in (0, 25, 49)] == [3e-4] * 3
    assert lr_at(1, 3e-4, 50, 4, "constant") == 3e-4 * 2 / 4


def _wsd_reference(step, base, horizon, warmup, decay_fraction, shape, min_ratio):
    """WSD written out independently: warmup, peak, then the last round(f * N) steps decay."""
    if step < warmup:
        return base * (step + 1) / warmup
    n_decay = max(1, round(decay_fraction * horizon))
    if step < horizon - n_decay:
        return base
    p = min(1.0, (step - (horizon - n_decay)) / n_decay)
    f = {"linear": 1 - p, "cosine": (1 + math.cos(math.pi * p)) / 2, "sqrt": 1 - math.sqrt(p)}[shape]
    return base * min_ratio + (base - base * min_ratio) * f


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd_follows_its_formula(shape):
    base, N, W = 2e-3, 100, 5
    lrs = [lr_at(s, base, N, W, "wsd", 0.0, decay_fraction=0.3, decay_shape=shape) for s in range(N + 5)]
    ref = [_wsd_reference(s, base, N, W, 0.3, shape, 0.0) for s in range(N + 5)]
    assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15) for a, b in zip(lrs, ref))
    assert lrs[W:70] == [base] * (70 - W)  # stable phase: exactly the peak until the last 30 steps
    assert lrs[70] == base and lrs[71] < base and lrs[N] == 0.0 and lrs[N + 4] == 0.0
    assert all(a >= b for a, b in zip(lrs[70:], lrs[71:]))
    # the shapes differ mid-decay: linear 1 - p, sqrt 1 - sqrt(p) lower, cosine higher in the first half
    mid = lr_at(75, 1.0, N, W, "wsd", 0.0, decay_fraction=0.3, decay_shape=shape)
    assert math.isclose(mid, {"linear": 1 - 5 / 30, "cosine": (1 + math.cos(math.pi / 6)) / 2,
                              "sqrt": 1 - math.sqrt(5 / 30)}[shape])


def test_linear_decay_to_zero():
    lrs = [lr_at(s, 1.0, 50, 10, "linear", 0.0) for s in range(51)]
    assert lrs[9] == 1.0 and lrs[10] == 1.0 and math.isclose(lrs[30], 0.5) and lrs[50] == 0.0
    assert math.isclose(lr_at(30, 1.0, 50, 10, "linear", 0.2), 0.2 + 0.8 * 0.5)


def test_unknown_schedule_and_shape_are_errors():
    with pytest.raises(ValueError, match="schedule 'step'"):
        lr_at(10, 1.0, 50, 0, "step")
    with pytest.raises(ValueError, match="decay shape 'exp'"):
        lr_at(49, 1.0, 50, 0, "wsd", decay_shape="exp")
