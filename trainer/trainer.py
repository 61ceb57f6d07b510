"""The Trainer: builds model, data, optimizer and run directory from a Config and runs the loop.

One step (DESIGN.md "One training step"): every rank draws its own micro-batches and accumulates
local gradients into ONE flat buffer (Lion Cub App. D.2); gradient-sync modes mean-allreduce that
buffer in one collective, update-sync optimizers communicate inside `step()`. No DDP wrapper.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import comm
import data
from data.loader import ShardLoader, val_batch_count, val_batches
from model import GPT, get_preset, param_roles
from optim import build_optimizer

from .checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import GRADIENT_SYNC_MODES, Config, ConfigError, validate
from .dist import DistInfo, all_agree, mean_over_ranks
from .logger import RunLogger, Timer
from .schedule import lr_at

# Dense bf16 peak FLOP/s for the MFU estimate (vendor datasheets).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "A10": 125e12, "L4": 121e12, "V100": 125e12}


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (exists, or nothing to resume)."""


class Trainer:
    def __init__(self, cfg: Config, info: DistInfo) -> None:
        validate(cfg, world_size=info.world_size)
        self.cfg, self.info = cfg, info
        self.device = info.device
        self.out_dir = Path(cfg.train.out_dir)
        self.ckpt_root = self.out_dir / "ckpt"
        resume_from = self._prepare_run_dir()

        torch.manual_seed(cfg.train.seed)  # same init on every rank
        mcfg = cfg.model
        overrides = {"pos_emb": mcfg.pos_emb}
        if mcfg.tie_embeddings is not None:
            overrides["tie_embeddings"] = mcfg.tie_embeddings
        if mcfg.block_size:
            overrides["block_size"] = mcfg.block_size
        self.model_config = get_preset(mcfg.preset, **overrides)
        self.model = GPT(self.model_config).to(self.device)
        self._flat_grads = self._attach_flat_grads()
        self.param_groups = self._param_groups()
        c = cfg.comm
        try:
            self.optimizer = self._build_optimizer()
        except ValueError as e:  # an option combination validate() does not know about
            raise ConfigError(f"optim/comm: {e}") from None
        self.gradient_sync = c.mode in GRADIENT_SYNC_MODES
        self.wire_dtype = torch.bfloat16 if c.mode == "bf16" else torch.float32
        self.stats = comm.default_stats()

        self.data_dir = data.resolve_dataset(cfg.data.dataset, cfg.data.cache_dir or None) \
            if info.is_main else None
        if info.world_size > 1:  # rank 0 prepares the built-in corpus once; the others wait for it
            box = [str(self.data_dir) if self.data_dir else None]
            dist.broadcast_object_list(box, src=0)
            self.data_dir = Path(box[0])
        d = cfg.data
        self.loader = ShardLoader(self.data_dir, "train", d.batch_size, d.seq_len, info.rank, info.world_size,
                                  cfg.train.seed)
        available = val_batch_count(self.data_dir, d.batch_size, d.seq_len, info.world_size)
        if available < 1:
            raise RunDirError(f"the val split of {self.data_dir} holds less than one global batch of "
                              f"{info.world_size} x {d.batch_size} x {d.seq_len} tokens; lower data.batch_size "
                              f"or data.seq_len, or prepare more val data")
        self.eval_steps = min(cfg.train.eval_steps, available)  # never reuse val tokens within one eval
        self.tokens_per_step = d.batch_size * d.seq_len * d.grad_accum * info.world_size
        self.flops_per_token = self.model.flops_per_token(d.seq_len)
        self.peak_flops = self._peak_flops()
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                         if self.device.type == "cuda" and cfg.train.dtype == "bfloat16" else contextlib.nullcontext())
        self.forward = torch.compile(self.model) if cfg.train.compile else self.model
        self.timer = Timer(self.device)

        self.step = 0
        self.train_time = 0.0  # seconds spent in timed train steps, for loss-vs-wall-clock plots
        if resume_from is not None:
            self._load(resume_from)
        if info.is_main:  # only now: a config that fails while building leaves no run directory behind
            (self.out_dir / "config.yaml").write_text(cfg.dump())
        self.logger = RunLogger(self.out_dir, info.is_main, cfg.log.wandb, cfg.log.project,
                                cfg.log.run_name or self.out_dir.name, cfg.log.group, cfg.to_dict(),
                                resume=resume_from is not None)
        self._stop_signal = None

    # ------------------------------------------------------------------ setup
    # keys a resumed run may change; anything else must match the checkpoint's config
    RESUMABLE_KEYS = ("train.max_steps", "train.stop_after", "train.resume", "train.eval_every",
                      "train.eval_steps", "train.ckpt_every", "train.keep_ckpts", "train.log_every",
                      "train.out_dir", "train.device", "data.cache_dir", "comm.timeout_s", "log.", "diag.")

    def _prepare_run_dir(self) -> Path | None:
        """Refuse, replace or resume the run directory (rank 0 decides, every rank agrees)."""
        t = self.cfg.train
        problem, resume_path = "", None
        if self.info.is_main:
            exists = self.out_dir.exists() and any(self.out_dir.iterdir())
            looks_like_run = any((self.out_dir / n).exists() for n in ("config.yaml", "metrics.jsonl", "ckpt"))
            if exists and t.resume == "never":
                problem = (f"run directory {self.out_dir} already exists and is not empty; pass "
                           f"train.resume=auto to continue it, train.resume=overwrite to replace it, "
                           f"or choose another train.out_dir")
            elif exists and t.resume == "overwrite" and not looks_like_run:
                problem = (f"train.resume=overwrite refuses to delete {self.out_dir}: it holds no config.yaml, "
                           f"metrics.jsonl or ckpt/, so it does not look like a run directory")
            elif exists and t.resume == "overwrite":
                shutil.rmtree(self.out_dir)
            elif t.resume == "auto":
                problem = self._resume_problem()
            if not problem:
                self.out_dir.mkdir(parents=True, exist_ok=True)
        if all_agree(bool(problem), self.device):
            raise RunDirError(problem or f"rank 0 refused the run directory {self.out_dir}")
        if t.resume == "auto":
            resume_path = latest_checkpoint(self.ckpt_root)
        return resume_path

    def _resume_problem(self) -> str:
        """Why the latest checkpoint cannot be resumed with this config ("" if it can or none exists)."""
        steps = list(self.ckpt_root.glob("step_*")) if self.ckpt_root.is_dir() else []
        path = latest_checkpoint(self.ckpt_root)
        if path is None:
            return (f"{self.ckpt_root} holds step directories but no loadable checkpoint; inspect it, or pass "
                    f"train.resume=overwrite to start over") if steps else ""
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("world_size") != self.info.world_size:
            return (f"checkpoint {path} was written by {meta.get('world_size')} ranks, this run has "
                    f"{self.info.world_size}; per-rank optimizer state needs the same world size")
        old, new = _flatten(meta.get("config", {})), _flatten(self.cfg.to_dict())
        changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                   if old.get(k) != new.get(k) and not k.startswith(self.RESUMABLE_KEYS)]
        if changed:
            return (f"train.resume=auto: this config differs from checkpoint {path} in keys a resumed run cannot "
                    f"change: {'; '.join(changed)}. Restore them, or start a new run (another train.out_dir)")
        return ""

    def _attach_flat_grads(self) -> dict[torch.dtype, torch.Tensor]:
        """Point every parameter's .grad at a slice of one flat buffer per dtype, so a gradient
        allreduce is a single collective and backward accumulates in place."""
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in self.model.parameters():
            by_dtype.setdefault(p.dtype, []).append(p)
        buffers = {}
        for dtype, params in by_dtype.items():
            flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=self.device)
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            buffers[dtype] = flat
        return buffers

    def _param_groups(self) -> list[dict]:
        """One group per role: weight decay only on >= 2-D weights; lr multipliers for embedding,
        head and scalars (Lion Cub App. F.3)."""
        o = self.cfg.optim
        mult = {"embedding": o.embedding_lr_mult, "head": o.head_lr_mult, "attn": 1.0, "mlp": 1.0,
                "norm": o.scalar_lr_mult}
        roles = param_roles(self.model)
        named = dict(self.model.named_parameters())
        groups = []
        for role in ("embedding", "head", "attn", "mlp", "norm"):
            names = [n for n, r in roles.items() if r == role]
            if not names:
                continue
            params = [named[n] for n in names]
            wd = o.weight_decay if all(p.ndim >= 2 for p in params) else 0.0
            groups.append({"params": params, "names": names, "role": role, "lr_mult": mult[role],
                           "lr": o.lr * mult[role], "weight_decay": wd})
        seen = [id(p) for g in groups for p in g["params"]]
        assert len(seen) == len(set(seen)) == len(named), "every parameter must be in exactly one group"
        return groups

    def _build_optimizer(self):
        o, c = self.cfg.optim, self.cfg.comm
        return build_optimizer(
            o.name, self.param_groups, betas=tuple(o.betas), eps=o.eps, comm_mode=c.mode,
            comm_options=dict(bits=c.bits, quantizer=c.quantizer, p=c.p,
                              levels=None if c.levels < 0 else c.levels, clip=c.clip,
                              rounding=c.rounding, tie_break=c.tie_break, ps_aggregate=c.ps_aggregate,
                              ps_topology=c.ps_topology, node_size=c.node_size,
                              mask_zero_updates=c.mask_zero_updates,
                              momentum_sync=vars(c.momentum_sync) if c.momentum_sync.every else None))

    def _peak_flops(self) -> float | None:
        if self.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        return next((v for k, v in PEAK_FLOPS.items() if k in name), None)

    # ------------------------------------------------------------------ one step
    def set_lr(self) -> float:
        o = self.cfg.optim
        lr = lr_at(self.step, o.lr, self.cfg.train.max_steps, o.warmup_steps, o.schedule, o.min_lr_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g["lr_mult"]
        return lr

    def train_step(self, diagnose: bool = False) -> dict:
        """One optimizer step on every rank; returns this rank's timings and local loss."""
        cfg = self.cfg
        lr = self.set_lr()
        self.model.train()
        self.stats.begin_step()
        t0 = self.timer.now()
        data_s, loss_sum = 0.0, torch.zeros((), device=self.device)
        for buf in self._flat_grads.values():
            buf.zero_()
        for _ in range(cfg.data.grad_accum):
            td = time.perf_counter()
            x, y = self.loader.next_batch()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            data_s += time.perf_counter() - td
            with self.autocast:
                _, loss = self.forward(x, y)
            (loss / cfg.data.grad_accum).backward()
            loss_sum += loss.detach()
        t1 = self.timer.now()
        if self.gradient_sync and self.info.world_size > 1:
            for buf in self._flat_grads.values():
                comm.allreduce_mean(buf, wire_dtype=self.wire_dtype, inplace=True)
        if cfg.optim.grad_clip > 0:  # global norm after sync; local norm for update-sync optimizers
            norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(b, dtype=torch.float32) for b in self._flat_grads.values()]))
            scale = torch.clamp(cfg.optim.grad_clip / (norm + 1e-6), max=1.0)
            for buf in self._flat_grads.values():
                buf.mul_(scale.to(buf.dtype))
        self.optimizer.diagnose_next_step = diagnose
        self.optimizer.step()
        t2 = self.timer.now()
        self.step += 1
        diag = dict(getattr(self.optimizer, "last_diagnostics", None) or {}) if diagnose else {}
        s = self.stats.step_summary()
        step_s = t2 - t0 - diag.get("diag/seconds", 0.0)
        comm_s = s["coll_s"] + s["pack_s"]
        return {"loss": (loss_sum / cfg.data.grad_accum).item(), "lr": lr, "step_s": step_s,
                "data_s": data_s, "fwdbwd_s": t1 - t0 - data_s, "comm_s": comm_s, "coll_s": s["coll_s"],
                "pack_s": s["pack_s"], "opt_s": max(0.0, step_s - (t1 - t0) - comm_s),
                "bytes_sent": s["bytes_sent"], "bytes_recv": s["bytes_recv"], "diag": diag}

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total, n = 0.0, 0
        for x, y in val_batches(self.data_dir, self.cfg.data.batch_size, self.cfg.data.seq_len, self.info.rank,
                                self.info.world_size, self.eval_steps):
            x, y = x.to(self.device), y.to(self.device)
            with self.autocast:
                _, loss = self.forward(x, y)
            total += loss.item()
            n += 1
        return mean_over_ranks([total / max(n, 1)], self.device)[0]

    def param_digests(self) -> list[str]:
        """sha256 of this rank's parameters, gathered from every rank (the invariant: all equal)."""
        h = hashlib.sha256()
        for _, p in sorted(self.model.named_parameters()):
            h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        out = [None] * self.info.world_size
        dist.all_gather_object(out, h.hexdigest())
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        rank_state = {"optimizer": self.optimizer.state_dict(), "loader": self.loader.state_dict(),
                      "rng": rng_state(), "step": self.step, "train_time": self.train_time}
        meta = {"step": self.step, "world_size": self.info.world_size, "config": self.cfg.to_dict(),
                "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        return save_checkpoint(self.ckpt_root, self.step, self.model.state_dict(), rank_state, meta,
                               self.info.rank, self.cfg.train.keep_ckpts)

    def _load(self, path: Path) -> None:
        model_state, rank_state, meta = load_checkpoint(path, self.info.rank, self.info.world_size)
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(rank_state["optimizer"])
        self.loader.load_state_dict(rank_state["loader"])
        set_rng_state(rank_state["rng"])
        self.step = rank_state["step"]
        self.train_time = rank_state.get("train_time", 0.0)
        if self.info.is_main:  # drop log records written after this checkpoint by the interrupted run
            log = self.out_dir / "metrics.jsonl"
            if log.exists():
                keep = [ln for ln in log.read_text().splitlines()
                        if ln.strip() and json.loads(ln).get("step", 0) <= self.step]
                log.write_text("".join(ln + "\n" for ln in keep))
        if self.info.is_main:
            print(f"resumed from {path} at step {self.step}", flush=True)

    # ------------------------------------------------------------------ loop
    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum

    def fit(self) -> dict:
        cfg, info = self.cfg, self.info
        t = cfg.train
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)
        self.logger.console(self._banner())
        if self.step >= t.max_steps:  # resumed a finished run: its final eval and checkpoint exist
            self.logger.console(f"run {self.out_dir} is already complete at step {self.step} "
                                f"(train.max_steps={t.max_steps}); raise train.max_steps to train further")
            return {"step": self.step, "stopped": False, "already_complete": True}
        window: list[dict] = []
        start, steps_at_start = time.perf_counter(), self.step
        last_eval = None
        while self.step < t.max_steps:
            diagnose = bool(cfg.diag.every) and (self.step + 1) % cfg.diag.every == 0
            r = self.train_step(diagnose)
            self.train_time += r["step_s"]
            window.append(r)
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                self._log_window(window, start, steps_at_start)
                window = []
            if r["diag"]:
                hist = getattr(self.optimizer, "last_histograms", None) if cfg.diag.histograms else None
                self.logger.log({"step": self.step, **r["diag"]}, histograms=hist)
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                last_eval = self._eval_and_log()
            saved = bool(t.ckpt_every) and self.step % t.ckpt_every == 0 and self.step < t.max_steps
            if saved:
                path = self.save()
            if self.step >= t.max_steps:
                break  # the normal finish below: final eval, parameter check, checkpoint
            stop_after = t.stop_after and self.step - steps_at_start >= t.stop_after
            # signals reach ranks at different moments: agree (a tiny collective) on log steps only
            signalled = self.step % t.log_every == 0 and all_agree(self._stop_signal is not None, self.device)
            if signalled or stop_after:
                if window:
                    self._log_window(window, start, steps_at_start)
                if not saved:
                    path = self.save()
                why = "train.stop_after" if stop_after else f"signal {self._stop_signal}"
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
        val = self.evaluate()
        self.logger.log({"step": self.step, "val_loss": val, "train_time_s": self.train_time})
        self.logger.console(f"step {self.step:>6} | val loss {val:.4f}")
        return val

    def _log_window(self, window: list[dict], start: float, steps_at_start: int) -> None:
        n = len(window)
        keys = ["loss", "step_s", "data_s", "fwdbwd_s", "comm_s", "coll_s", "pack_s", "opt_s",
                "bytes_sent", "bytes_recv"]
        local = [sum(r[k] for r in window) / n for k in keys]
        # rank means (timings: ranks wait for each other in collectives, so means are representative)
        m = dict(zip(keys, mean_over_ranks(local, self.device)))
        rec = {"step": self.step, "train_loss": m["loss"], "lr": window[-1]["lr"],
               "step_ms": 1e3 * m["step_s"], "comm_ms": 1e3 * m["comm_s"], "comm_bytes": int(m["bytes_sent"]),
               "comm_bytes_recv": int(m["bytes_recv"]), "data_ms": 1e3 * m["data_s"],
               "fwdbwd_ms": 1e3 * m["fwdbwd_s"], "coll_ms": 1e3 * m["coll_s"], "pack_ms": 1e3 * m["pack_s"],
               "opt_ms": 1e3 * m["opt_s"], "tokens_per_s": self.tokens_per_step / max(m["step_s"], 1e-9),
               "train_time_s": self.train_time}
        if self.device.type == "cuda":
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            if self.peak_flops:
                rec["mfu"] = self.flops_per_token * rec["tokens_per_s"] / (self.peak_flops * self.info.world_size)
        self.logger.log(rec)
        elapsed = time.perf_counter() - start
        self.logger.console(self.logger.train_line(rec, self.cfg.train.max_steps, elapsed,
                                                   self.step - steps_at_start))

    def _banner(self) -> str:
        import platform

        import numpy

        c = self.cfg
        return "\n".join([
            f"run {self.out_dir} | python {platform.python_version()} torch {torch.__version__} "
            f"numpy {numpy.__version__} | {platform.node()} {platform.machine()} | {self.info.backend} "
            f"world {self.info.world_size} on {self.device}",
            f"model {c.model.preset}: {self.model.num_params() / 1e6:.2f}M params "
            f"({self.model.num_params(non_embedding=True) / 1e6:.2f}M non-embedding), "
            f"{self.flops_per_token / 1e6:.1f} MFLOP/token",
            f"optim {c.optim.name} lr {c.optim.lr} | comm {c.comm.mode}"
            + (f" {c.comm.bits}-bit {c.comm.quantizer}" if c.comm.mode == "pbit" else "")
            + f" | data {self.data_dir} | {self.tokens_per_step:,} tokens/step | {c.train.max_steps} steps"
            + f" | eval {self.eval_steps} batches" + (f" (val split holds {self.eval_steps}, asked "
                                                      f"{c.train.eval_steps})" if self.eval_steps < c.train.eval_steps else ""),
        ])


def run(cfg: Config, info: DistInfo) -> dict:
    trainer = Trainer(cfg, info)
    try:
        return trainer.fit()
    finally:
        trainer.logger.close()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
