"""comm.kernels=auto's measurement on CPU, in a child process.

Timing the compiled candidate means importing inductor and compiling, which costs a process
60-150 MiB of RSS that it keeps (measured: torch 220 MiB; + sympy, dynamo and inductor's
compile_fx 120 MiB of imports; + the compiled code), whatever the model size. So on CPU
`comm.kernels.warmup` under auto asks a child: `python -m comm.kernel_probe` runs the same
warm-up (byte checks of every candidate, then `choose` on the run's real layout, at the parent's
thread count) and prints the records of its choices as JSON; the parent adopts them and then
builds and checks only the candidates that won. A rank imports inductor only where a compiled
kernel was fastest. Inductor's on-disk cache makes the parent's compile of a kernel the child
compiled a cache hit.

LIONCUB_KERNEL_PROBE=0 measures in the training process instead (the child is then never
started); a child that fails is reported with its error and the measurement runs in-process.
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


def measure(layout: list[tuple[int, int]], cfg: dict) -> list[dict] | None:
    """Run the auto measurement for `layout` and the warm-up configuration `cfg` (comm.kernels.warmup's
    keywords) in a child process; its choice records, or None (with a warning naming the error)
    when the child failed."""
    req = {"layout": layout, "threads": torch.get_num_threads(),
           "cfg": {k: [_enc(x) for x in v] if isinstance(v, (tuple, list)) else _enc(v) for k, v in cfg.items()}}
    env = dict(os.environ, **{ENV: "child"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        done = subprocess.run([sys.executable, "-m", "comm.kernel_probe"], input=json.dumps(req),
                              capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        warnings.warn(f"kernels: the auto measurement's child process failed ({e}); measuring in this "
                      f"process", stacklevel=3)
        return None
    lines = done.stdout.strip().splitlines()
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
    from .kernels import _choice_line

    for rec in records:
        rec["probe"] = True
        rec["line"] = _choice_line(rec)
    return records


def _main(argv: list[str] | None = None) -> None:
    import argparse

    argparse.ArgumentParser(
        prog="python -m comm.kernel_probe",
        description="comm.kernels=auto's CPU measurement, run by comm.kernels.warmup as a child process: reads "
                    "the request (layout, warm-up configuration, thread count) as JSON on stdin and prints the "
                    "choice records as JSON.").parse_args(argv)
    req = json.loads(sys.stdin.read())
    torch.set_num_threads(int(req["threads"]))
    from comm import kernels

    cfg = dict(req["cfg"])
    cfg["p"] = tuple(_dec_p(v) for v in cfg["p"])
    cfg["sign_dtypes"] = tuple(getattr(torch, d) for d in cfg["sign_dtypes"])
    for k in ("bits", "levels", "rounding", "world_sizes"):
        cfg[k] = tuple(cfg[k])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kernels.warmup("cpu", impl="auto", layout=[tuple(x) for x in req["layout"]], **cfg)
    print(json.dumps(kernels.auto_choices()))


if __name__ == "__main__":
    _main()
