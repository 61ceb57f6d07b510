"""The Trainer: builds model, data and optimizer from a Config and runs the loop.

One step (docs/architecture.md, "One training step"): every rank draws its own micro-batches and
accumulates local gradients into the optimizer's flat buffer (Lion Cub App. D.2); the optimizer's
`step()` does whatever crosses the network (optim.sync) and returns a StepReport. The trainer
never knows which scheme runs. No DDP wrapper.
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch

import data
from comm import Clock

from . import automode, parallel, signals, state
from .config import AUTO_MODE, Config, ConfigError, validate, warmup_steps
from .dist import DistInfo
from .evaluation import Evaluator
from .inputs import init_source, initial_model, resolve_data, train_loader
from .logger import banner, window_record
from .optimizer import build_run_optimizer
from .profiling import StepHooks
from .rundir import RunDirError, check_run_dir, prepare_run_dir
from .schedule import lr_at, schedule_note
from .state import DIVERGED_EVENT, DivergenceError
from .warmup import compile_model, warm_up_kernels

__all__ = ["DivergenceError", "RunDirError", "Trainer", "run", "schedule_note"]


class Trainer:
    def __init__(self, cfg: Config, info: DistInfo) -> None:
        validate(cfg, world_size=info.world_size)
        self.cfg, self.info, self.device = cfg, info, info.device
        self.out_dir = Path(cfg.train.out_dir)
        self.ckpt_root = self.out_dir / "ckpt"
        # everything that can fail on bad config or data is built before the run directory is touched
        self.data_dir, self.mix_dirs = resolve_data(cfg, info)
        # the model's vocabulary follows the dataset's tokenizer (GPT-2 for the built-in corpus)
        vocab = data.dataset_vocab_size(self.data_dir)
        source = init_source(cfg, vocab) if cfg.model.init_from else None  # fills cfg.model's shape keys
        self.auto_decision = None
        # a directory the run will refuse is refused now, not after comm.mode=auto's measurements (read only)
        check_run_dir(self.out_dir, cfg.train.resume, info)
        if cfg.comm.mode == AUTO_MODE:  # measured before the seed below, so model init is unchanged
            cfg, self.auto_decision = automode.resolve(cfg, info, self.data_dir, self._say)
            validate(cfg, world_size=info.world_size)
            self.cfg = cfg
        self.model_config, self.model = initial_model(cfg, vocab, source, self.device)
        del source
        # hybrid sharding (trainer/parallel.py): the optimizer sees local shards and the replicate group
        self.parallel = parallel.make_mesh(cfg.parallel.shard_size, info.world_size, self.device)
        groups, order, self.aliases, dims = parallel.place(self.model, self.parallel, cfg.optim)
        try:
            self.optimizer = build_run_optimizer(cfg, groups, order, group=self.parallel.replicate_group,
                                                 shard_group=self.parallel.shard_group, shard_dims=dims)
        except ValueError as e:  # an option combination validate() does not know about
            raise ConfigError(f"optim/comm: {e}") from None
        if self.parallel.sharded:
            parallel.route_grads(self.model, self.aliases)

        d = cfg.data
        self.loader = train_loader(cfg, info, self.data_dir, self.mix_dirs, self.model_config.vocab_size)
        self.tokens_per_step = d.batch_size * d.seq_len * d.grad_accum * info.world_size
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                         if self.device.type == "cuda" and cfg.train.dtype == "bfloat16" else contextlib.nullcontext())
        self.evaluator = Evaluator(cfg, info, self.data_dir, self.model_config.vocab_size, self.autocast)
        self.forward = torch.compile(self.model) if cfg.train.compile else self.model
        self.clock = Clock(self.device)

        self.step, self.train_time = 0, 0.0  # train_time: seconds in timed steps (loss vs wall-clock)
        self.tokens_seen = 0  # tokens of the steps applied, all ranks (trainer/state.py keeps it on resume)
        # the lr schedule's horizon: a resumed run keeps its first one (trainer/state.py restores it)
        self.schedule_steps = cfg.optim.schedule_steps or cfg.train.max_steps
        self.skip_batches: set[int] = set()  # steps whose batches a rollback skips
        self.rollbacks = 0
        self.signals = signals.StopSignals(info.rank)  # its stop flag is set by a signal handler (fit installs it)
        self.skipped_in_row, self.last_skipped = 0, -1  # train.on_nonfinite=skip_step's consecutive count
        self.lock = prepare_run_dir(self.out_dir, cfg.train.resume, cfg.to_dict(), info)
        # resumes from the last checkpoint (train.resume=auto), writes config.yaml; releases the lock if it fails
        self.logger = state.open_run(self)

    def _say(self, msg: str) -> None:
        if self.info.is_main:
            print(msg, flush=True)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    # ------------------------------------------------------------------ one step
    def set_lr(self) -> float:
        o, horizon = self.cfg.optim, self.schedule_steps
        lr = lr_at(self.step, o.lr, horizon, warmup_steps(o, horizon), o.schedule, o.min_lr_ratio, o.decay_fraction,
                   o.decay_shape)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g["lr_mult"]
        return lr

    def train_step(self, diagnose: bool = False) -> dict:
        """One optimizer step on every rank; returns this rank's timings and local loss."""
        accum = self.cfg.data.grad_accum
        lr = self.set_lr()
        self.model.train()
        t0 = self.clock.now()
        data_s, loss_sum = 0.0, torch.zeros((), device=self.device)
        self.optimizer.zero_grad()
        if self.step + 1 in self.skip_batches:  # a rollback found this step's batches non-finite
            for _ in range(accum):
                self.loader.next_batch()
        for i in range(accum):
            self.optimizer.expect_backward(final=i == accum - 1)
            td = time.perf_counter()
            x, y = self.loader.next_batch()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            data_s += time.perf_counter() - td
            with self.autocast:
                _, loss = self.forward(x, y)
            (loss / accum).backward()
            loss_sum += loss.detach()
        t1 = self.clock.now()
        loss_val = (loss_sum / accum).item()
        # the matrix optimizers' collectives inside the shard group (optim/muon.py shard_stats)
        shard_stats = getattr(self.optimizer, "shard_stats", None)
        shard_before = shard_stats.totals()["bytes_sent"] if shard_stats is not None else 0
        report = self.optimizer.step(diagnose=diagnose, loss_finite=math.isfinite(loss_val),
                                     stop=self.signals.signum is not None)
        self.step += 1
        return {"loss": loss_val, "lr": lr, "step_s": t1 - t0 + report.seconds, "data_s": data_s,
                "fwdbwd_s": t1 - t0 - data_s, "comm_s": report.comm_s, "coll_s": report.coll_s,
                "pack_s": report.pack_s, "opt_s": max(0.0, report.seconds - report.comm_s),
                "bytes_sent": report.bytes_sent, "bytes_recv": report.bytes_recv, "report": report,
                "grad_norms": report.grad_norms,
                "shard_bytes": shard_stats.totals()["bytes_sent"] - shard_before if shard_stats is not None else 0}

    def save(self) -> Path:
        # the checkpoint's model is the one the run reports (a local-update scheme's global
        # parameters, between outer steps too); each rank's own local ones ride in its optimizer state
        with self.optimizer.strategy.evaluation(self.optimizer):
            return state.save(self)

    # ------------------------------------------------------------------ loop
    def _on_signal(self, signum, frame) -> None:
        """What a stop signal does (trainer/signals.py); a test calls it to signal one rank only."""
        self.signals.handle(signum, frame)

    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        self.signals.install()
        self.logger.console(banner(self))
        self.hooks = StepHooks(cfg, self.info, self.out_dir, self.device, self.logger.console)  # train.profile, memory_snapshot
        warm_up_kernels(self.optimizer, self.logger, self.step)  # compiled kernels: paid here, never inside a timed step
        if self.step >= t.max_steps:  # resumed a finished run: its final eval and checkpoint exist
            self.logger.console(f"run {self.out_dir} is already complete at step {self.step} "
                                f"(train.max_steps={t.max_steps}); raise train.max_steps to train further")
            return {"step": self.step, "stopped": False, "already_complete": True}
        if cfg.train.compile:
            model_s = compile_model(self.model, self.forward, cfg.data.batch_size, cfg.data.seq_len, self.autocast,
                                    self.device, evaluation=t.eval_steps > 0)
            self.logger.console(f"model: torch.compile paid in {model_s:.1f} s before the first timed step")
            self.logger.log({"step": self.step, "event": "compile", "compile_s": model_s})
        if cfg.model.init_from and self.step == 0:  # the starting point's val loss, e.g. the export's own
            self._eval_and_log()
        window: list[dict] = []
        diag_silent = False
        start, steps_at_start = time.perf_counter(), self.step
        while self.step < t.max_steps:
            diagnose = bool(cfg.diag.every) and (self.step + 1) % cfg.diag.every == 0
            self.hooks.before_step(self.step + 1)
            r = self.train_step(diagnose)
            self.hooks.after_step(self.step)
            if r["report"].nonfinite:
                bad = self.step
                try:
                    state.on_nonfinite(self, r)
                except DivergenceError:
                    # the run's last record says why it stopped: a launcher (torchrun exits 1 when a worker
                    # exits 3) does not pass the exit code on, and a study must count the run as diverged
                    self.logger.log({"step": bad, "event": DIVERGED_EVENT})
                    raise
                continue
            self.train_time += r["step_s"]
            self.tokens_seen += self.tokens_per_step
            window.append(r)
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                self._log_window(window, start, steps_at_start)
                window = []
            rep = r["report"]
            if diagnose and not rep.diagnostics and not diag_silent:  # said once, not left to an empty chart
                diag_silent = True
                self.logger.console(
                    f"note: diag.every={cfg.diag.every}: optim.name={cfg.optim.name} with comm.mode={cfg.comm.mode} "
                    f"at {self.info.world_size} rank(s) computes no diagnostics (docs/running.md, Diagnostics: which "
                    f"optimizers and modes have them); nothing is logged for them")
            if rep.diagnostics:
                self.logger.log({"step": self.step, **rep.diagnostics, "diag/seconds": rep.diag_seconds},
                                histograms=rep.histograms if cfg.diag.histograms else None)
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                self._eval_and_log()
            saved = bool(t.ckpt_every) and self.step % t.ckpt_every == 0 and self.step < t.max_steps
            if saved:
                path = self.save()
            if self.step >= t.max_steps:
                break  # the normal finish after the loop (state.finish): final eval, parameter check, checkpoint
            stop_after = t.stop_after and self.step - steps_at_start >= t.stop_after
            # signals reach ranks at different moments: the stop flag rides on the step's guard
            # collective, so every rank acts on it at the same step, whatever train.log_every is
            signalled = r["report"].stop
            if signalled or stop_after:
                if window:
                    self._log_window(window, start, steps_at_start)
                if not saved:
                    path = self.save()
                why = "train.stop_after" if stop_after else (
                    f"signal {self.signals.signum}" if self.signals.signum is not None else "a signal on another rank")
                self.logger.console(f"stopping ({why}) at step {self.step}; checkpoint {path}; "
                                    f"continue with train.resume=auto")
                return {"step": self.step, "stopped": True}
        if window:
            self._log_window(window, start, steps_at_start)
        return state.finish(self)

    def _eval_and_log(self) -> float:
        # the parameters the run reports (a local-update scheme's global ones, equal on every replica)
        with self.optimizer.strategy.evaluation(self.optimizer):
            val = self.evaluator.val_loss(self.model, self.forward)
            mc = self.evaluator.multiple_choice(self.model)
            if self.parallel.sharded:
                parallel.reshard(self.model)
        self.logger.log({"step": self.step, "val_loss": val, **mc, "train_time_s": self.train_time})
        self.logger.console(f"step {self.step:>6} | val loss {val:.4f}"
                            + (f" | mc acc {mc['mc_acc']:.4f} acc_norm {mc['mc_acc_norm']:.4f} ({mc['mc_items']} items)"
                               if mc else ""))
        return val

    def _log_window(self, window: list[dict], start: float, steps_at_start: int) -> None:
        rec = window_record(self, window)
        self.logger.log(rec)
        self.logger.console(self.logger.train_line(rec, self.cfg.train.max_steps, time.perf_counter() - start,
                                                   self.step - steps_at_start))


def run(cfg: Config, info: DistInfo) -> dict:
    trainer = Trainer(cfg, info)
    try:
        return trainer.fit()
    except data.DataError as e:  # found mid-run (a shard the run reached): the run directory stays resumable
        raise data.DataError(f"{e}. The run stopped at step {trainer.step}; {trainer.out_dir} keeps its checkpoints: "
                             f"fix the data, then rerun with train.resume=auto to continue from the last one") from None
    finally:
        signals.restore_defaults()  # a dying run must die on a signal
        if getattr(trainer, "hooks", None) is not None:  # set in fit(); a traced step range is written out
            trainer.hooks.close(trainer.step)
        trainer.logger.close()
        trainer.release()

