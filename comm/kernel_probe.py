"""comm.kernels=auto's measurement on CPU, in a child process.

Timing the compiled candidate means importing inductor and compiling, which costs a process
60-150 MiB of RSS that it keeps (measured: torch 220 MiB; + sympy, dynamo and inductor's
compile_fx 120 MiB of imports; + the compiled code), whatever the model size. So on CPU
`comm.kernels.warmup` under auto asks a child: `python -m comm.kernel_probe` runs the same
warm-up (byte checks of every candidate, then `choose` on the run's real layout, at the parent's
thread count; `python -m comm.kernel_probe_child`, apart so that this module imports nothing of
comm.kernels) and prints the records of its choices as JSON; the parent adopts them and then
builds and checks only the candidates that won. A rank imports inductor only where a compiled
kernel was fastest. Inductor's on-disk cache makes the parent's compile of a kernel the child
compiled a cache hit.

LIONCUB_KERNEL_PROBE=0 measures in the training process instead (the child is then never
started); a child that fails is reported with its error and the measurement runs in-process; a
child killed by a signal (`ChildCrashed`) never leads to loading the native library it may have
crashed on: comm.kernels.warmup names the file and leaves native out in this process.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import torch

ENV = "LIONCUB_KERNEL_PROBE"  # "0": measure in-process; "child": set in the child itself
TIMEOUT_S = 300  # under comm.timeout_s's default (600): the other ranks wait in the agreement meanwhile


def inside() -> bool:
    """Whether this process is a probe child, or probing is switched off (measure here)."""
    return os.environ.get(ENV, "1") in ("0", "child")


def _enc(v):
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    return v


def _dec_p(v):
    return float(v) if isinstance(v, str) else v


class ChildCrashed(RuntimeError):
    """The probe child was killed by a signal (SIGBUS, SIGSEGV: a damaged library, a crashing kernel)."""

    def __init__(self, signum: int, stderr: str) -> None:
        super().__init__(f"killed by signal {signum}" + (f" ({stderr})" if stderr else ""))
        self.signum = signum


def measure(layout: list[tuple[int, int]], cfg: dict) -> list[dict] | None:
    """Run the auto measurement for `layout` and the warm-up configuration `cfg` (comm.kernels.warmup's
    keywords) in a child process; its choice records, or None (with a warning naming the error)
    when the child failed."""
    req = {"layout": layout, "threads": torch.get_num_threads(),
           "cfg": {k: [_enc(x) for x in v] if isinstance(v, (tuple, list)) else _enc(v) for k, v in cfg.items()}}
    env = dict(os.environ, **{ENV: "child"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:  # the child runs comm/kernel_probe_child.py (which imports comm.kernels: no import back from here)
        done = subprocess.run([sys.executable, "-m", "comm.kernel_probe_child"], input=json.dumps(req),
                              capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        warnings.warn(f"kernels: the auto measurement's child process failed ({e}); measuring in this "
                      f"process", stacklevel=3)
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode < 0:  # killed by a signal: what crashed it must not be loaded in this process
        raise ChildCrashed(-done.returncode, done.stderr.strip()[-500:])
    if done.returncode != 0 or not lines:
        warnings.warn(f"kernels: the auto measurement's child process exited with {done.returncode}: "
                      f"{done.stderr.strip()[-1500:]}; measuring in this process", stacklevel=3)
        return None
    try:
        records = json.loads(lines[-1])
        if not isinstance(records, list) or not all(isinstance(r, dict) and "chosen" in r for r in records):
            raise ValueError("not a list of choice records")
    except ValueError as e:  # something else wrote to stdout: measure here rather than guess
        warnings.warn(f"kernels: the auto measurement's child process answered {lines[-1][:200]!r} ({e}); "
                      f"measuring in this process", stacklevel=3)
        return None
    for rec in records:
        rec["probe"] = True  # the caller (comm.kernels.warmup) adds each record's line
    return records
