"""train.profile and train.memory_snapshot: what the trainer calls around each step on every rank.

- train.profile=STEPS ("5-7", "5,9", 6 or [5, 6]; steps as logged, the first step is 1) traces
  those steps with torch.profiler (CPU, and CUDA kernels on CUDA) and writes one Chrome trace per
  rank and run of consecutive steps: <out_dir>/profile/rank<R>.steps_<a>-<b>.pt.trace.json. Open it
  in chrome://tracing or Perfetto, or point TensorBoard's profiler plugin at <out_dir>/profile
  (the *.pt.trace.json names are that plugin's). Each step is a "ProfilerStep#N" range.
- train.memory_snapshot=N records the CUDA caching allocator's history from the first step and
  writes <out_dir>/memory/rank<R>.pickle after step N (or when the run ends sooner): drag it into
  https://pytorch.org/memory_viz. CUDA only: with train.device=cpu it is a config error; with
  train.device=auto on a machine without CUDA one warning says nothing is written.

Use (trainer/trainer.py fit): `hooks = StepHooks(cfg, info, out_dir, device, say)`, then
`hooks.before_step(step + 1)` and `hooks.after_step(step)` around each train step and
`hooks.close()` when the loop ends (also on errors).
"""
from __future__ import annotations

import sys
from pathlib import Path

PROFILE_DIR = "profile"
MEMORY_DIR = "memory"
MEMORY_ENTRIES = 200_000  # allocator events kept (a ring buffer): minutes of a large model's steps


def parse_steps(spec) -> set[int]:
    """train.profile as a set of step numbers; ValueError naming the problem."""
    if spec in ("", None, 0, False, []):
        return set()
    items = spec if isinstance(spec, list) else [spec]
    steps: set[int] = set()
    for item in items:
        if isinstance(item, bool):
            raise ValueError(f"{item!r} is not a step")
        if isinstance(item, int):
            parts = [str(item)]
        elif isinstance(item, str):
            parts = [p.strip() for p in item.split(",") if p.strip()]
        else:
            raise ValueError(f"{item!r} is not a step or range")
        for part in parts:
            lo, sep, hi = part.partition("-")
            try:
                a, b = int(lo), int(hi) if sep else int(lo)
            except ValueError:
                raise ValueError(f"{part!r} is not a step (N) or range (A-B)") from None
            if a < 1 or b < a:
                raise ValueError(f"{part!r}: steps start at 1 and a range A-B needs A <= B")
            steps.update(range(a, b + 1))
    return steps


def config_problems(cfg) -> list[str]:
    """The config checks of train.profile, train.memory_snapshot and log.tensorboard."""
    p, t = [], cfg.train
    try:
        steps = parse_steps(t.profile)
    except ValueError as e:
        p.append(f"train.profile: {e}; give steps such as 5-7, \"5,9\" or [5, 6] (empty = off)")
    else:
        if steps and max(steps) > t.max_steps:
            p.append(f"train.profile: step {max(steps)} is past train.max_steps={t.max_steps}")
    if isinstance(t.memory_snapshot, bool) or t.memory_snapshot < 0:
        p.append(f"train.memory_snapshot: {t.memory_snapshot!r}; give the step after which to write the snapshot "
                 f"(0 = off)")
    elif t.memory_snapshot and t.device == "cpu":
        p.append("train.memory_snapshot: records the CUDA allocator, but train.device=cpu; set it to 0 (on CPU "
                 "metrics.jsonl has peak_rss_gib)")
    if getattr(cfg.log, "tensorboard", False):
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            p.append("log.tensorboard=true needs the tensorboard package: pip install -e '.[tensorboard]' "
                     "(or set log.tensorboard=false)")
    return p


class StepHooks:
    """The profiler and the memory snapshot of one rank (does nothing when both are off)."""

    def __init__(self, cfg, info, out_dir: Path, device, say=print) -> None:
        self.rank, self.out_dir, self.device, self.say = info.rank, Path(out_dir), device, say
        self.steps = parse_steps(cfg.train.profile)
        self.snapshot_after = int(cfg.train.memory_snapshot)
        self.prof = None
        self.first = None  # the first step of the traced range in progress
        self.step_range = None
        self.recording = False
        if self.snapshot_after:
            import torch

            if device.type != "cuda" or not torch.cuda.is_available():
                print(f"warning (rank {self.rank}): train.memory_snapshot={self.snapshot_after} records CUDA memory, "
                      f"but this run is on {device.type}; no snapshot is written (peak_rss_gib in metrics.jsonl is "
                      f"the CPU's peak)", file=sys.stderr, flush=True)
                self.snapshot_after = 0
            else:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
                self.recording = True

    def before_step(self, step: int) -> None:
        """Call before the train step that becomes step `step`."""
        if step not in self.steps:
            return
        import torch

        if self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True, profile_memory=True)
            self.prof.start()
            self.first = step
        self.step_range = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.step_range.__enter__()

    def after_step(self, step: int) -> None:
        """Call after the train step that made step `step` (also a skipped, non-finite one)."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
            if step + 1 not in self.steps:
                self._write_trace(step)
        if self.recording and step >= self.snapshot_after:
            self._write_snapshot(step)

    def _write_trace(self, last: int) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.stop()
        d = self.out_dir / PROFILE_DIR
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"rank{self.rank}.steps_{self.first}-{last}.pt.trace.json"
        self.prof.export_chrome_trace(str(path))
        self.prof, self.first = None, None
        if self.rank == 0:
            self.say(f"profile: steps {path.name.split('steps_')[1].split('.')[0]} traced on every rank: "
                     f"{d}/rank*.steps_*.pt.trace.json (chrome://tracing, Perfetto, or tensorboard --logdir {d})")

    def _write_snapshot(self, step: int) -> None:
        import torch

        d = self.out_dir / MEMORY_DIR
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
        if self.rank == 0:
            self.say(f"memory: CUDA allocator history of steps 1-{step} written to {d}/rank*.pickle "
                     f"(open it in https://pytorch.org/memory_viz)")

    def close(self, step: int | None = None) -> None:
        """The run ended (normally, on a signal or an error): finish what is in progress."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        if self.prof is not None:
            self._write_trace(step if step is not None else self.first)
        if self.recording:
            self._write_snapshot(step if step is not None else self.snapshot_after)
