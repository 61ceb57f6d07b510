"""One logging rank fanning out to the console, metrics.jsonl and wandb.

wandb never reaches the network unless log.wandb=online and an API key is present: offline and
disabled modes set WANDB_MODE and turn off error reporting before wandb is imported.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path


def _fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class RunLogger:
    def __init__(self, out_dir: Path, enabled: bool, wandb_mode: str, project: str, run_name: str,
                 group: str, config: dict, resume: bool) -> None:
        self.enabled = enabled
        self.wandb = None
        self.file = None
        if not enabled:
            return
        self.file = open(out_dir / "metrics.jsonl", "a" if resume else "w", buffering=1)
        if wandb_mode != "disabled":
            self.wandb = self._init_wandb(out_dir, wandb_mode, project, run_name, group, config)

    @staticmethod
    def _init_wandb(out_dir, mode, project, run_name, group, config):
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        os.environ.setdefault("WANDB_SILENT", "true")
        if mode == "online" and not (os.environ.get("WANDB_API_KEY") or Path.home().joinpath(".netrc").exists()):
            print("log.wandb=online but no WANDB_API_KEY or ~/.netrc: logging offline instead "
                  f"(sync later with `wandb sync {out_dir}/wandb/offline-run-*`)", file=sys.stderr)
            mode = "offline"
        os.environ["WANDB_MODE"] = mode
        import wandb  # imported late so the environment above is in force

        return wandb.init(project=project, name=run_name, group=group or None, config=config, dir=str(out_dir),
                          mode=mode, resume="allow", id=run_name.replace("/", "_"))

    def log(self, record: dict, histograms: dict | None = None) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        if self.wandb is not None:
            payload = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            if histograms:
                import wandb

                payload.update({k: wandb.Histogram(v.float().cpu().numpy()) for k, v in histograms.items()})
            self.wandb.log(payload, step=record["step"])

    def console(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)

    def train_line(self, rec: dict, max_steps: int, elapsed: float, steps_done: int) -> str:
        eta = elapsed / max(1, steps_done) * (max_steps - rec["step"])
        comm_share = 100.0 * rec["comm_ms"] / rec["step_ms"] if rec["step_ms"] else 0.0
        return (f"step {rec['step']:>6}/{max_steps} | loss {rec['train_loss']:.4f} | lr {rec['lr']:.2e} | "
                f"{rec['tokens_per_s']:,.0f} tok/s | {rec['step_ms']:.0f} ms/step "
                f"(comm {comm_share:.0f}%) | {rec['comm_bytes'] / 2**20:.2f} MiB/step | ETA {_fmt_time(eta)}")

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


class Timer:
    """Wall-clock sections; on CUDA it synchronises so kernels are attributed to the right section."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()
