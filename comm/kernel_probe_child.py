"""The child process of comm.kernels=auto's CPU measurement (comm/kernel_probe.py starts it as
`python -m comm.kernel_probe_child`): reads the request (layout, warm-up configuration, thread
count) as JSON on stdin, runs comm.kernels.warmup's measurement here and prints the choice records
as JSON. Kept apart from comm/kernel_probe.py, which comm.kernels imports, so that no import runs
back from kernel_probe to kernels."""
from __future__ import annotations

import json
import sys
import warnings

import torch

from . import kernels
from .kernel_probe import _dec_p


def main(argv: list[str] | None = None) -> None:
    import argparse

    argparse.ArgumentParser(
        prog="python -m comm.kernel_probe_child",
        description="comm.kernels=auto's CPU measurement, run by comm.kernels.warmup as a child process: reads "
                    "the request (layout, warm-up configuration, thread count) as JSON on stdin and prints the "
                    "choice records as JSON.").parse_args(argv)
    req = json.loads(sys.stdin.read())
    torch.set_num_threads(int(req["threads"]))
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
    main()
