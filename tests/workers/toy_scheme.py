"""A synchronisation scheme defined here only (not in the project): "sign of the mean of signs".

Every rank sends sign(c_i) as fp32 through a mean-allreduce and applies sign(mean_i sign(c_i)).
It is registered at import, then the debug model is trained with `comm.mode=toy_signmean` through
the ordinary config path and trainer, in one process group. Rank 0 writes the run's metrics path.
This proves a new mode needs one module with its options, exchange, byte formula and prediction,
and one registry entry: nothing in the trainer, the config or the optimizer changes.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import comm  # noqa: E402
from comm import cost_model  # noqa: E402
from optim import sync  # noqa: E402


@dataclass
class ToyOptions(sync.SchemeOptions):
    toy_scale: float = 1.0
    """Multiplies the applied sign (a toy option, to show that options reach the exchange)."""

    def problems(self, world_size=None):
        return [] if self.toy_scale > 0 else [f"{self.key('toy_scale')}: {self.toy_scale} must be > 0"]


class SignOfMeanOfSigns(sync.Exchange):
    def __init__(self, opts: ToyOptions, ctx: sync.ExchangeContext) -> None:
        self.opts, self.ctx = opts, ctx

    def __call__(self, c: torch.Tensor, step: int) -> torch.Tensor:
        mean = comm.allreduce_mean(torch.sign(c), wire_dtype=torch.float32, group=self.ctx.group, stats=self.ctx.stats)
        return torch.sign(mean) * self.opts.toy_scale


TOY = sync.SyncScheme(
    name="toy_signmean", kind=sync.UPDATE, result=sync.SIGN, options=ToyOptions,
    build=lambda o, ctx: SignOfMeanOfSigns(o, ctx),
    wire_bytes=lambda o, P, n, rank, rows: (4 * n, 4 * n),
    predict=lambda o, P, n, a, b, rows=1: cost_model.ring_allreduce(P, n, 32, a, b),
    wire="fp32 signs, mean-allreduced (a test scheme)", help="sign of the mean of signs (test only)")


def main(out_dir: str) -> None:
    sync.register(TOY)
    from trainer.config import load_config
    from trainer.dist import init_distributed, shutdown
    from trainer.trainer import run

    info = init_distributed("cpu")
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "model.preset=debug", "data.batch_size=4", "data.seq_len=64", "train.max_steps=12", "train.log_every=1",
        "train.eval_every=0", "train.eval_steps=2", "optim.lr=3e-3", "optim.warmup_steps=0",
        "comm.mode=toy_signmean", "comm.toy_scale=1.0", f"train.out_dir={out_dir}"])
    assert cfg.comm.toy_scale == 1.0 and "toy_scale" in cfg.to_dict()["comm"]
    run(cfg, info)
    shutdown()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main(sys.argv[1])
    exit_cleanly()
