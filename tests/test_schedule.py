import math

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
