"""optim.base.StateMean / average_states: the mean of per-rank optimizer states read one at a time (a resume
on another world size, trainer/state.py RankStates) is the list form's mean, bit for bit, and keeps its rules
where the states' structure differs: a key some state lacks, a list of another length or a value of another
type keeps the first state's value (no error), however late in the fold the difference shows."""
from __future__ import annotations

import pytest
import torch

from optim.base import StateMean, average_states


def _sum_mean(xs: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:  # fp32, in rank order, divided by the count: a mean-allreduce's
        total += x.to(torch.float32)
    return total.div_(len(xs)).to(xs[0].dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fold_is_the_rank_order_fp32_mean(dtype):
    gen = torch.Generator().manual_seed(0)
    same = torch.randn(5, generator=gen).to(dtype)
    states = [{"exp_avg": torch.randn(4, 3, generator=gen).to(dtype), "Q": same.clone(), "step": torch.tensor(7),
               "inner": [{"v": torch.randn(2, generator=gen).to(dtype)}], "lr": 0.1} for _ in range(5)]
    states[1]["exp_avg"] = states[0]["exp_avg"].clone()  # equal to the first, then different: summed in order
    out = average_states(iter(states))
    assert torch.equal(out["exp_avg"], _sum_mean([s["exp_avg"] for s in states]))
    assert torch.equal(out["inner"][0]["v"], _sum_mean([s["inner"][0]["v"] for s in states]))
    assert out["Q"] is states[0]["Q"] and out["step"] is states[0]["step"] and out["lr"] == 0.1  # equal everywhere
    mean = StateMean()
    with pytest.raises(ValueError, match="no states"):
        mean.result()


def test_a_structure_that_differs_keeps_the_first_value_however_late_it_shows():
    a = torch.ones(2)
    # the second state cannot be combined with the first, the third drops the key or changes the list: the
    # first's value, as when the whole list is looked at before descending
    assert average_states(iter([{"m": a}, {"m": 3}, {}]))["m"] is a
    assert average_states(iter([{"m": a}, {"m": torch.ones(3)}, {}]))["m"] is a
    assert average_states(iter([[a], [torch.ones(3)], [a, a]]))[0] is a
    # where the position is averaged in the end, the conflict is an error the resume reports (not a traceback)
    with pytest.raises(TypeError):
        average_states(iter([{"m": a}, {"m": 3}]))
    with pytest.raises(RuntimeError):
        average_states(iter([{"m": a}, {"m": torch.ones(3)}]))
