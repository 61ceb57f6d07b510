"""The Trainer: builds model, data and optimizer from a Config and runs the loop.

One step (docs/architecture.md, "One training step"): every rank draws its own micro-batches and
accumulates local gradients into the optimizer's flat buffer (Lion Cub App. D.2); the optimizer's
`step()` does whatever crosses the network (optim.sync) and returns a StepReport. The trainer
never knows which scheme runs. No DDP wrapper.
"""
from __future__ import annotations

import contextlib
import math
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import data
from comm import Clock
from data.loader import MixLoader, ShardLoader
from model import GPT, resolve_config
from optim import build_optimizer, shard_dims
from optim.base import digest

from . import automode, parallel, state
from .state import DivergenceError
from .checkpoint import find_resumable
from .config import AUTO_MODE, Config, ConfigError, validate, warmup_steps
from .dist import DistInfo
from .evaluation import Evaluator
from .logger import RunLogger, banner, window_record
from .param_groups import param_groups
from .rundir import RunDirError, prepare_run_dir, run_id
from .schedule import lr_at

__all__ = ["DivergenceError", "RunDirError", "Trainer", "run"]
class Trainer:
    def __init__(self, cfg: Config, info: DistInfo) -> None:
        validate(cfg, world_size=info.world_size)
        self.cfg, self.info, self.device = cfg, info, info.device
        self.out_dir = Path(cfg.train.out_dir)
        self.ckpt_root = self.out_dir / "ckpt"
        # everything that can fail on bad config or data is built before the run directory is touched
        self.data_dir = data.resolve_dataset(cfg.data.dataset, cfg.data.cache_dir or None) if info.is_main else None
        if info.world_size > 1:  # rank 0 prepares the built-in corpus once; the others wait for it
            box = [str(self.data_dir) if self.data_dir else None]
            dist.broadcast_object_list(box, src=0)
            self.data_dir = Path(box[0])
        self.mix_dirs = resolve_mix(cfg, info, self.data_dir) if cfg.data.mix else None
        # the model's vocabulary follows the dataset's tokenizer (GPT-2 for the built-in corpus)
        vocab = data.dataset_vocab_size(self.data_dir)
        source = init_source(cfg, vocab) if cfg.model.init_from else None  # fills cfg.model's shape keys
        self.auto_decision = None
        if cfg.comm.mode == AUTO_MODE:  # measured before the seed below, so model init is unchanged
            cfg, self.auto_decision = automode.resolve(cfg, info, self.data_dir, self._say)
            validate(cfg, world_size=info.world_size)
            self.cfg = cfg
        torch.manual_seed(cfg.train.seed)  # same init on every rank
        self.model_config = resolve_config(vars(cfg.model), vocab_size=vocab)
        self.model = GPT(self.model_config).to(self.device)
        if source is not None:
            self.model.load_state_dict(source.model.state_dict())  # cast to the model's dtype, exact in fp32
            del source
        self.model.activation_checkpointing = cfg.model.activation_checkpointing
        o, c = cfg.optim, cfg.comm
        # hybrid sharding (trainer/parallel.py): the optimizer sees local shards and the replicate group
        self.parallel = parallel.make_mesh(cfg.parallel.shard_size, info.world_size, self.device)
        groups, order = param_groups(self.model, o), list(self.model.parameters())
        if self.parallel.sharded:  # each parameter on the dimension its optimizer asks for (Dion: its Q side)
            parallel.shard_model(self.model, self.parallel,
                                 shard_dims(o.name, o.options, groups, self.parallel.shard_size))
            self.aliases = parallel.local_aliases(self.model)
            groups = parallel.localize_groups(param_groups(self.model, o), self.aliases)
            order = [self.aliases[id(p)] for p in self.model.parameters()]
        try:
            self.optimizer = build_optimizer(
                o.name, groups, betas=tuple(o.betas), eps=o.eps, comm_mode=c.mode,
                comm_options=c.options, optim_options=o.options, grad_clip=o.grad_clip,
                momentum_sync=vars(c.momentum_sync), param_order=order,
                kernels=kernel_impl(c.kernels), fine_timing=c.fine_timing, bucket_mb=c.bucket_mb,
                overlap=c.overlap, group=self.parallel.replicate_group, shard_group=self.parallel.shard_group,
                shard_dims=parallel.local_dims(self.model, self.aliases) if self.parallel.sharded else None)
        except ValueError as e:  # an option combination validate() does not know about
            raise ConfigError(f"optim/comm: {e}") from None
        if self.parallel.sharded:
            parallel.route_grads(self.model, self.aliases)

        d = cfg.data
        if self.mix_dirs:
            self.loader = MixLoader([(name, self.mix_dirs[name], w) for name, w in d.mix.items()], "train",
                                    d.batch_size, d.seq_len, info.rank, info.world_size, cfg.train.seed,
                                    vocab_size=self.model_config.vocab_size, order=d.order)
        else:
            self.loader = ShardLoader(self.data_dir, "train", d.batch_size, d.seq_len, info.rank, info.world_size,
                                      cfg.train.seed, vocab_size=self.model_config.vocab_size, order=d.order)
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
        self._stop_signal, self._signals = None, 0  # set by a signal handler (fit)
        self.skipped_in_row, self.last_skipped = 0, -1  # train.on_nonfinite=skip_step's consecutive count
        self.lock = prepare_run_dir(self.out_dir, cfg.train.resume, cfg.to_dict(), info)
        try:
            found = find_resumable(self.ckpt_root, info.rank, info.world_size, self._say) \
                if cfg.train.resume == "auto" else None
            if found is not None:
                self._say(state.load(self, *found))
                if self.schedule_steps != cfg.train.max_steps:
                    self._say(schedule_note(self.schedule_steps, cfg.train.max_steps))
            if info.is_main:  # only now: a config that fails while building leaves no run directory behind
                (self.out_dir / "config.yaml").write_text(cfg.dump())
                if self.auto_decision is not None:
                    automode.write_decision(self.out_dir, self.auto_decision)
            self.logger = RunLogger(self.out_dir, info.is_main, cfg.log.wandb, cfg.log.project,
                                    cfg.log.run_name or self.out_dir.name, cfg.log.group, cfg.to_dict(),
                                    run_id=run_id(self.out_dir))
        except BaseException:
            self.release()
            raise
        if self.auto_decision is not None:
            d = self.auto_decision
            self.logger.log({"step": self.step, "event": "auto_mode", "variant": d["variant"], "mode": d["mode"],
                             "source": d["source"], "predicted_step_ms": 1e3 * d["predicted_step_s"],
                             "table": d.get("table")})
        if found is not None:
            self.logger.log({"step": self.step, "event": "resume", "checkpoint": str(found[0]),
                             "world_size": info.world_size})

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
                                     stop=self._stop_signal is not None)
        self.step += 1
        return {"loss": loss_val, "lr": lr, "step_s": t1 - t0 + report.seconds, "data_s": data_s,
                "fwdbwd_s": t1 - t0 - data_s, "comm_s": report.comm_s, "coll_s": report.coll_s,
                "pack_s": report.pack_s, "opt_s": max(0.0, report.seconds - report.comm_s),
                "bytes_sent": report.bytes_sent, "bytes_recv": report.bytes_recv, "report": report,
                "grad_norms": report.grad_norms,
                "shard_bytes": shard_stats.totals()["bytes_sent"] - shard_before if shard_stats is not None else 0}

    def compile_model(self) -> float:
        """Compile the model's training forward and backward on a batch of zeros, before any timed
        step, so the compile time is reported apart and never lands in a step's timing. The gradients
        are returned by autograd.grad, not accumulated: no .grad, optimizer state or backward hook (a
        comm.overlap bucket) sees them, and the parameters are untouched. Returns seconds."""
        d = self.cfg.data
        x = torch.zeros(d.batch_size, d.seq_len, dtype=torch.long, device=self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.model.train()
        t0 = time.perf_counter()
        with self.autocast:
            _, loss = self.forward(x, torch.zeros_like(x))  # x and y distinct: aliasing would be another graph
        torch.autograd.grad(loss, params)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def param_digests(self) -> list[str]:
        """sha256 of this rank's parameters, gathered from every rank (the invariant: all equal)."""
        out = [None] * self.info.world_size
        params = (p for _, p in sorted(self.model.named_parameters()))
        if self.parallel.sharded:  # the whole tensors (gathered in the shard group): equal iff the replicas are
            parallel.reshard(self.model)
            params = [p.full_tensor() for p in params]
        dist.all_gather_object(out, digest(params))
        return out

    def save(self) -> Path:
        return state.save(self)

    # ------------------------------------------------------------------ loop
    def _on_signal(self, signum, _frame) -> None:
        self._signals += 1
        if signum == signal.SIGINT and self._signals > 1:  # a second Ctrl-C: leave at once
            raise KeyboardInterrupt
        if self._stop_signal is None:  # os.write: safe inside a handler (print could re-enter buffered I/O)
            more = "; Ctrl-C again to leave at once without one" if signum == signal.SIGINT else ""
            os.write(2, f"rank {self.info.rank}: signal {signum} received: checkpointing at the end of this "
                        f"step, then stopping{more}\n".encode())
        self._stop_signal = signum

    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.logger.console(banner(self))
        compile_s = self.optimizer.warmup()  # compiled kernels: paid here, never inside a timed step
        if compile_s:
            self.logger.console(f"kernels: {self.optimizer.kernels}, warmed up (built or compiled, checked against "
                                f"the reference{', timed' if self.optimizer.kernels == 'auto' else ''}) in "
                                f"{compile_s:.1f} s")
            choices = self.optimizer.kernel_choices()
            for line in choices:
                self.logger.console(f"kernels: auto chose {line}")
            self.logger.log({"step": self.step, "event": "kernels", "compile_s": compile_s, "choices": choices})
        if self.step >= t.max_steps:  # resumed a finished run: its final eval and checkpoint exist
            self.logger.console(f"run {self.out_dir} is already complete at step {self.step} "
                                f"(train.max_steps={t.max_steps}); raise train.max_steps to train further")
            return {"step": self.step, "stopped": False, "already_complete": True}
        if cfg.train.compile:
            model_s = self.compile_model()
            self.logger.console(f"model: torch.compile paid in {model_s:.1f} s before the first timed step")
            self.logger.log({"step": self.step, "event": "compile", "compile_s": model_s})
        if cfg.model.init_from and self.step == 0:  # the starting point's val loss, e.g. the export's own
            self._eval_and_log()
        window: list[dict] = []
        start, steps_at_start = time.perf_counter(), self.step
        while self.step < t.max_steps:
            diagnose = bool(cfg.diag.every) and (self.step + 1) % cfg.diag.every == 0
            r = self.train_step(diagnose)
            if r["report"].nonfinite:
                state.on_nonfinite(self, r)
                continue
            self.train_time += r["step_s"]
            self.tokens_seen += self.tokens_per_step
            window.append(r)
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                self._log_window(window, start, steps_at_start)
                window = []
            rep = r["report"]
            if rep.diagnostics:
                self.logger.log({"step": self.step, **rep.diagnostics, "diag/seconds": rep.diag_seconds},
                                histograms=rep.histograms if cfg.diag.histograms else None)
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                self._eval_and_log()
            saved = bool(t.ckpt_every) and self.step % t.ckpt_every == 0 and self.step < t.max_steps
            if saved:
                path = self.save()
            if self.step >= t.max_steps:
                break  # the normal finish below: final eval, parameter check, checkpoint
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
                    f"signal {self._stop_signal}" if self._stop_signal is not None else "a signal on another rank")
                self.logger.console(f"stopping ({why}) at step {self.step}; checkpoint {path}; "
                                    f"continue with train.resume=auto")
                return {"step": self.step, "stopped": True}
        if window:
            self._log_window(window, start, steps_at_start)
        last_eval = self._eval_and_log()
        digests = self.param_digests()
        self.logger.log({"step": self.step, "param_sha256": digests, "params_identical": len(set(digests)) == 1})
        if len(set(digests)) != 1:
            raise RuntimeError(f"parameters differ across ranks after step {self.step}: {digests}")
        path = self.save()
        self.logger.console(f"done: {self.step} steps, val loss {last_eval:.4f}, parameters bit-identical on "
                            f"{self.info.world_size} rank(s), checkpoint {path}")
        return {"step": self.step, "val_loss": last_eval, "stopped": False}

    def _eval_and_log(self) -> float:
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


def resolve_mix(cfg: Config, info: DistInfo, val_dir: Path) -> dict[str, Path]:
    """data.mix's sources as directories (rank 0 prepares the built-in corpus, the others wait); all
    must share the validation set's vocabulary."""
    names = list(cfg.data.mix)
    dirs = [str(data.resolve_dataset(n, cfg.data.cache_dir or None)) for n in names] if info.is_main else None
    if info.world_size > 1:
        box = [dirs]
        dist.broadcast_object_list(box, src=0)
        dirs = box[0]
    out = {n: Path(p) for n, p in zip(names, dirs)}
    want = data.dataset_vocab_size(val_dir)
    other = {n: data.dataset_vocab_size(p) for n, p in out.items() if data.dataset_vocab_size(p) != want}
    if other:
        raise ConfigError(f"data.mix: {other} have another vocabulary than data.dataset={cfg.data.dataset} ({want}); "
                          f"mix datasets prepared with one tokenizer")
    return out


def init_source(cfg: Config, vocab_size: int | None):
    """The model of model.init_from (model.load_model: run, checkpoint or HF Llama directory), after
    filling cfg.model's architecture keys from it; a key set to something else, or a vocabulary that
    is not the dataset tokenizer's, is a ConfigError."""
    from model import PRESETS, load_model, pad_vocab
    from model.presets import SHAPE_KEYS

    m = cfg.model
    try:
        loaded = load_model(m.init_from)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"model.init_from: {e}") from None
    src = loaded.model.config
    problems = []
    want = pad_vocab(vocab_size) if vocab_size else PRESETS[m.preset].vocab_size  # None: GPT-2's, as resolve_config
    if src.vocab_size != want:
        problems.append(f"model.init_from: {m.init_from} has a vocabulary of {src.vocab_size} ids but the dataset's "
                        f"tokenizer gives {want}; train on data prepared with the model's tokenizer")
    for key in SHAPE_KEYS:
        mine = getattr(m, key)
        if mine and mine != getattr(src, key):
            problems.append(f"model.{key}: {mine}, but model.init_from={m.init_from} has {getattr(src, key)}; "
                            f"remove model.{key} (the architecture is the source's)")
        else:
            setattr(m, key, getattr(src, key))
    if m.tie_embeddings is not None and m.tie_embeddings != src.tie_embeddings:
        problems.append(f"model.tie_embeddings: {m.tie_embeddings}, but model.init_from has {src.tie_embeddings}")
    m.tie_embeddings, m.pos_emb = src.tie_embeddings, src.pos_emb
    if cfg.data.seq_len > src.block_size:
        problems.append(f"data.seq_len: {cfg.data.seq_len} exceeds model.init_from's block size {src.block_size}")
    if problems:
        raise ConfigError("\n".join(problems))
    return loaded


def schedule_note(horizon: int, max_steps: int) -> str:
    """The console line of a resumed run whose train.max_steps differs from its schedule's horizon."""
    what = (f"the lr stays at the schedule's final value from step {horizon} to {max_steps}" if max_steps > horizon
            else f"the run stops at step {max_steps}, before the schedule's decay ends")
    return (f"schedule: train.max_steps={max_steps} but this run's lr schedule ends at step {horizon} (kept from the "
            f"run's start); {what}. Set optim.schedule_steps={max_steps} to stretch the schedule to the new length")


def kernel_impl(setting: str) -> str:
    """comm.kernels, with $LIONCUB_KERNELS deciding what "auto" means (e.g. eager in the tests)."""
    env = os.environ.get("LIONCUB_KERNELS", "")
    return env if setting == "auto" and env in ("compiled", "eager", "native") else setting


def run(cfg: Config, info: DistInfo) -> dict:
    trainer = Trainer(cfg, info)
    try:
        return trainer.fit()
    except data.DataError as e:  # found mid-run (a shard the run reached): the run directory stays resumable
        raise data.DataError(f"{e}. The run stopped at step {trainer.step}; {trainer.out_dir} keeps its checkpoints: "
                             f"fix the data, then rerun with train.resume=auto to continue from the last one") from None
    finally:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):  # a dying run must die on a signal
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        trainer.logger.close()
        trainer.release()
        _write_peak_rss()


PEAK_RSS_ENV = "LIONCUB_PEAK_RSS_FILE"


def _write_peak_rss() -> None:
    """With $LIONCUB_PEAK_RSS_FILE set (bench.step_breakdown sets it per rank), write this process's own
    peak RSS there as JSON: a launcher's RUSAGE_CHILDREN is the largest process of the rank's tree,
    which includes children such as comm.kernels=auto's warm-up probe."""
    path = os.environ.get(PEAK_RSS_ENV)
    if path:
        from .logger import peak_rss_gib

        with open(path, "w") as f:
            json.dump({"self_max_rss_mib": peak_rss_gib() * 1024}, f)
