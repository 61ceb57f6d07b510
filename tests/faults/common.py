"""Helpers of the fault-injection suite: a tiny run, damaged and crafted checkpoint files."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.dist import ROOT

TINY = ["model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.eval_steps=1", "train.log_every=1",
        "log.wandb=disabled", "optim.warmup_steps=0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}


def run1(out: Path, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """train.py on one process (the tiny debug model)."""
    return subprocess.run([sys.executable, "train.py", "configs/default.yaml", *TINY, f"train.out_dir={out}",
                           *overrides], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


def cli(module: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m module args` from the repository root."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


class _Payload:
    """Unpickling this calls open(sentinel, "w"): a file appears iff the loader ran code."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return open, (self.sentinel, "w")


def _reseal(ckpt: Path, name: str) -> None:
    """Record `name`'s current sha256 in meta.json, as anyone who can write the file can."""
    import hashlib

    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / "meta.json").write_text(json.dumps(meta))


def craft(ckpt: Path, name: str, sentinel: Path) -> None:
    """Replace checkpoint file `name` by a torch.save'd dict holding a code payload, and reseal."""
    buf = io.BytesIO()
    torch.save({"transformer.wte.weight": torch.zeros(2, 2), "optimizer": _Payload(sentinel)}, buf)
    (ckpt / name).write_bytes(buf.getvalue())
    _reseal(ckpt, name)


def garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def poison_model(ckpt: Path) -> None:
    """A model.pt whose embedding holds NaN, written and resealed like a genuine one."""
    sd = torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)
    sd["transformer.wte.weight"][0, :8] = float("nan")
    torch.save(sd, ckpt / "model.pt")
    _reseal(ckpt, "model.pt")


def fit_until_divergence(trainer) -> dict:
    """trainer.fit()'s result, with a DivergenceError kept as result["error"] (None when it ends well);
    the logger is closed and the run lock released either way (for in-process fault workers)."""
    from trainer.trainer import DivergenceError

    result = {"error": None}
    try:
        result.update(trainer.fit())
    except DivergenceError as e:
        result["error"] = str(e)
    finally:
        trainer.logger.close()
        trainer.release()
    return result
