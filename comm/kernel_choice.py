"""comm.kernels' auto choice arithmetic: timing one call, picking the fastest within TIE, and
merging the ranks' picks."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call: CUDA events on a GPU (no host sync inside the span), the host
    clock on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


# Ties within TIE of the fastest go to the candidate that costs the process least: eager (nothing),
# native (a small C library, built once per host), compiled (inductor's imports and compiled code,
# and seconds of compiling). Two runs' timings of one kernel spread by about this much on a shared
# machine (docs/results/fast_path/kernels_simplified.md), so closer candidates are not told apart.
TIE = 0.10


COST_ORDER = ("eager", "native", "compiled")


def fastest(ms: dict[str, float]) -> str:
    """The candidate auto keeps from times `ms`: the fastest, except that one within TIE of
    it that comes earlier in COST_ORDER wins the tie."""
    best = min(ms.values())
    close = [name for name in ms if ms[name] <= best * (1 + TIE)]
    return min(close, key=lambda name: (COST_ORDER.index(name) if name in COST_ORDER else len(COST_ORDER), ms[name]))


def choice_line(rec: dict) -> str:
    """One readable line for a choice record (kernel, device, n, chosen, ms, rejected, agreed)."""
    n = rec["n"]
    return (f"{rec['kernel']} on {rec['device']}{f' (n={n:,})' if n is not None else ''}: {rec['chosen']} ("
            + ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(rec["ms"].items()))
            + (f"; rejected, bytes differ: {', '.join(rec['rejected'])}" if rec["rejected"] else "")
            + (f"; agreed by {rec['agreed']} ranks" if rec.get("agreed") else "") + ")")


def merge_choices(per_rank: list[dict[str, dict]]) -> dict[str, str]:
    """The one choice per kernel that every rank of a group follows, from each rank's measurements
    ({"kernel|device": {"ms": {candidate: ms}}}, what `Kernels.agree` gathers): among the
    candidates every rank accepted (bytes equal to its reference there), the one whose slowest rank
    is fastest. A kernel some rank did not measure is left to the ranks that did."""
    keys = set().union(*per_rank) if per_rank else set()
    out = {}
    for key in sorted(keys):
        seen = [r[key]["ms"] for r in per_rank if key in r]
        if len(seen) < len(per_rank):
            continue
        ok = set.intersection(*(set(ms) for ms in seen))
        if ok:
            worst = {name: max(ms[name] for ms in seen) for name in sorted(ok)}
            out[key] = fastest(worst)
    return out
