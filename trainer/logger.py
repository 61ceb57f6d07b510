"""One logging rank fanning out to the console, metrics.jsonl and wandb.

wandb never reaches the network unless log.wandb=online and an API key is present: offline and
disabled modes set WANDB_MODE and turn off error reporting before wandb is imported.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path


def _fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


# metrics.jsonl key -> wandb key; wandb makes one panel section per prefix before the first "/"
WANDB_KEYS = {
    "train_loss": "loss/train", "val_loss": "loss/val", "lr": "loss/lr",
    "mc_acc": "eval/mc_acc", "mc_acc_norm": "eval/mc_acc_norm", "mc_acc_per_token": "eval/mc_acc_per_token",
    "step_ms": "step_time_ms/total", "data_ms": "step_time_ms/data", "fwdbwd_ms": "step_time_ms/fwd_bwd",
    "coll_ms": "step_time_ms/collectives", "pack_ms": "step_time_ms/pack", "opt_ms": "step_time_ms/optimizer",
    "comm_ms": "comm/ms", "comm_bytes": "comm/bytes_sent", "comm_bytes_recv": "comm/bytes_recv",
    "shard_bytes": "comm/shard_bytes_sent",
    "tokens_per_s": "throughput/tokens_per_s", "mfu": "throughput/mfu", "peak_mem_gib": "memory/peak_gib",
    "train_time_s": "throughput/train_time_s", "tokens": "throughput/tokens", "peak_rss_gib": "memory/peak_rss_gib",
    "grad_norm": "grad_norm/global",
}
# the step-time breakdown as a stacked chart: each line is the running sum of the parts before it
STACK = (("data_ms", "1_data"), ("fwdbwd_ms", "2_+fwd_bwd"), ("coll_ms", "3_+collectives"),
         ("pack_ms", "4_+pack"), ("opt_ms", "5_+optimizer"))


def wandb_payload(record: dict) -> dict:
    """The wandb view of a metrics.jsonl record: panels grouped by section (loss, eval,
    step_time_ms, step_time_stacked_ms, comm, throughput, memory, diag, and one section per
    diagnostic with its per-role / per-block / per-tensor charts: diag_sign_match, ...); an event
    record's numbers (`"event": "kernels"`'s compile_s, a resume's world_size, the finish record's
    bytes) under events/<event>.<key>."""
    out = {}
    event = record.get("event")
    for k, v in record.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if isinstance(event, str):  # a one-off record (compile, kernels, resume, finish, ...): its own section,
            out[f"events/{event}.{k}"] = v   # never a top-level chart beside the training curves
        elif k.startswith("diag/"):
            _, metric, *rest = k.split("/")
            out[f"diag_{metric}/{'.'.join(rest)}" if rest and metric != "vote_table" else k] = v
        elif k.startswith("grad_norm/"):
            out[k] = v  # grad_norm/<role>: its own panel section beside grad_norm/global
        else:
            out[WANDB_KEYS.get(k, k)] = v
    if all(k in record for k, _ in STACK):
        total = 0.0
        for k, name in STACK:
            total += record[k]
            out[f"step_time_stacked_ms/{name}"] = total
    return out


# the overall diagnostics the console summarises (docs/running.md "Diagnostics"), in print order
DIAG_SUMMARY = (("diag/sign_match", "sign match", "{:.4f}"), ("diag/sign_flip", "flip", "{:.4f}"),
                ("diag/tie_rate", "tie rate", "{:.4f}"), ("diag/momentum_spread", "momentum spread", "{:.3g}"),
                ("diag/muon_update_rms", "muon update rms", "{:.3g}"), ("diag/dion_rel_error", "dion rel error",
                                                                        "{:.3g}"),
                ("diag/diloco_drift_spread", "diloco drift spread", "{:.3g}"),
                ("diag/diloco_drift_cos_min", "drift cos min", "{:.4f}"))


def diag_summary(record: dict) -> str | None:
    """The console line of a diagnostics record (overall values only; the per-role, per-block and
    per-tensor ones are in metrics.jsonl and wandb), or None when it has none of them."""
    parts = [f"{name} {fmt.format(record[key])}" for key, name, fmt in DIAG_SUMMARY
             if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool)]
    if not parts:
        return None
    seconds = record.get("diag/seconds")
    return (f"diag   {record['step']:>6} | " + " | ".join(parts)
            + (f" | {1e3 * seconds:.0f} ms" if isinstance(seconds, (int, float)) else ""))


# $WANDB_MODE spellings wandb itself accepts, mapped onto ours
_WANDB_ENV = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline",
              "disabled": "disabled"}


# settings that change how a run executes, never its numbers (timeouts, timing detail, auto mode's measuring,
# where the data cache lives, recomputing activations): the lab's curve checks skip them too
NO_NUMERICS = ("comm.timeout_s", "comm.init_timeout_s", "comm.fine_timing", "comm.auto_", "data.cache_dir",
               "model.activation_checkpointing")
# and what else does not change what a run trains (where it writes, how it logs, when it evaluates or
# checkpoints, its seed, compiling): two runs differing only in these are one arm (seeds of one method).
# Dotted prefixes ("log." is the section, "comm.auto_" every auto-mode key).
ARM_IGNORED = ("log.", "diag.", "train.seed", "train.out_dir", "train.resume", "train.stop_after",
               "train.log_every", "train.eval_every", "train.eval_steps", "train.ckpt_every", "train.keep_ckpts",
               "train.async_ckpt", "train.profile", "train.memory_snapshot", "train.mc_eval_file",
               "train.mc_eval_items", "train.on_nonfinite", "train.max_skipped_steps", "train.compile", *NO_NUMERICS)


def arm_label(config: dict, world_size: int) -> str:
    """The run's arm, `<optim.name> <comm.mode> P<world> <digest>`: the digest hashes every setting outside
    ARM_IGNORED, so the seeds of one method share the label and two variants that differ in anything they train
    with (4- vs 8-bit Lion Cub, DiLoCo H = 10 vs 50, another model or world size) never do. wandb's runs are
    grouped by it (trainer.dashboards), as the `arm` key of the run config. A run resumed with settings that
    change it (another world size, a longer train.max_steps) is from then on in the new arm's group."""
    kept = {sec: {k: v for k, v in vals.items() if not f"{sec}.{k}".startswith(ARM_IGNORED)}
            for sec, vals in sorted(config.items()) if isinstance(vals, dict) and not f"{sec}.".startswith(ARM_IGNORED)}
    digest = hashlib.sha1(json.dumps([kept, world_size], sort_keys=True, default=str).encode()).hexdigest()[:8]
    return (f"{(config.get('optim') or {}).get('name', '?')} {(config.get('comm') or {}).get('mode', '?')} "
            f"P{world_size} {digest}")


def resolve_wandb_mode(setting: str, environ: dict | None = None) -> str:
    """log.wandb, or when it is unset (""), what $WANDB_MODE says (online, offline, disabled; wandb's
    aliases run and dryrun too); disabled when neither says anything."""
    if setting:
        return setting
    env = (os.environ if environ is None else environ).get("WANDB_MODE", "").strip().lower()
    if env and env not in _WANDB_ENV:
        raise ValueError(f"WANDB_MODE={env!r} is not one of {', '.join(_WANDB_ENV)}; fix it or set log.wandb")
    return _WANDB_ENV.get(env, "disabled")


def repair_torn_tail(path: Path) -> bool:
    """End `path` with a newline if a killed writer left its last line torn, so the next record
    starts a line of its own (readers skip the torn one) instead of being glued onto it; True if
    it repaired the file."""
    try:
        with open(path, "rb+") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            if f.read(1) == b"\n":
                return False
            f.write(b"\n")
            return True
    except FileNotFoundError:
        return False


class RunLogger:
    def __init__(self, out_dir: Path, enabled: bool, wandb_mode: str, project: str, run_name: str,
                 group: str, config: dict, run_id: str | None = None) -> None:
        self.enabled = enabled
        self.wandb = None
        self.file = None
        self.last_train_step = None  # the step of the last train record (its console line is out)
        self.pending_diag = None  # a diagnostics summary waiting for the next train line
        self.tensorboard = None
        if not enabled:
            return
        # appended, never truncated: a resumed run adds its records after an "event": "resume" record, so a
        # step logged by the interrupted run after its last checkpoint appears again (readers keep the last)
        path = out_dir / "metrics.jsonl"
        repair_torn_tail(path)
        self.file = open(path, "a", buffering=1)
        from . import provenance

        provenance.record(out_dir)  # this start's code and library versions (trainer/provenance.py)
        if (config.get("log") or {}).get("tensorboard"):
            # the same scalars as wandb (wandb_payload), under the same keys, in <out_dir>/tensorboard
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        wandb_mode = resolve_wandb_mode(wandb_mode)
        if wandb_mode != "disabled":
            self.wandb = self._init_wandb(out_dir, wandb_mode, project, run_name, group, config,
                                          run_id or run_name.replace("/", "_"))

    @staticmethod
    def _init_wandb(out_dir, mode, project, run_name, group, config, run_id):
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        os.environ.setdefault("WANDB_SILENT", "true")
        if mode == "online" and not (os.environ.get("WANDB_API_KEY") or Path.home().joinpath(".netrc").exists()):
            print("log.wandb=online but no WANDB_API_KEY or ~/.netrc: logging offline instead "
                  f"(sync later with `wandb sync {out_dir}/wandb/offline-run-*`)", file=sys.stderr)
            mode = "offline"
        os.environ["WANDB_MODE"] = mode
        import wandb  # imported late so the environment above is in force

        # $WANDB_DIR (a cluster's scratch, say) is where wandb's files go when set, else the run directory
        run = wandb.init(project=project, name=run_name, group=group or None, config=config,
                         dir=os.environ.get("WANDB_DIR") or str(out_dir), mode=mode, resume="allow", id=run_id)
        if mode == "offline":   # WANDB_SILENT hides wandb's own hint: say where the run is and how to send it
            where = Path(run.dir).parent
            print(f"wandb: offline run in {where}; send it with `wandb sync {where}` (a resumed run adds "
                  f"one offline-run-* directory per start: sync them in order)", file=sys.stderr)
        return run

    def log(self, record: dict, histograms: dict | None = None) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        if self.wandb is not None:
            payload = wandb_payload(record)
            if histograms:
                import wandb

                payload.update({f"c_local/{k.split('/', 1)[-1]}": wandb.Histogram(v.float().cpu().numpy())
                                for k, v in histograms.items()})
            self.wandb.log(payload, step=record["step"])
        if self.tensorboard is not None:
            for k, v in wandb_payload(record).items():
                if math.isfinite(v):
                    self.tensorboard.add_scalar(k, v, global_step=record["step"])
            for k, v in (histograms or {}).items():
                self.tensorboard.add_histogram(f"c_local/{k.split('/', 1)[-1]}", v.float().cpu(),
                                               global_step=record["step"])
        self._console_diagnostics(record)

    def _console_diagnostics(self, record: dict) -> None:
        """One console line per logged diagnostics record: right after its step's train line when the
        step was a log step, else after the next train line (diag.every need not divide train.log_every)."""
        if "train_loss" in record:
            self.last_train_step = record["step"]
            if self.pending_diag:
                self.console(self.pending_diag)
                self.pending_diag = None
            return
        line = diag_summary(record)
        if line is None:
            return
        if record["step"] == self.last_train_step:
            self.console(line)
        else:
            self.pending_diag = line

    def console(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)

    def train_line(self, rec: dict, max_steps: int, elapsed: float, steps_done: int) -> str:
        eta = elapsed / max(1, steps_done) * (max_steps - rec["step"])
        comm_share = 100.0 * rec["comm_ms"] / rec["step_ms"] if rec["step_ms"] else 0.0
        return (f"step {rec['step']:>6}/{max_steps} | loss {rec['train_loss']:.4f} | lr {rec['lr']:.2e} | "
                f"{rec['tokens_per_s']:,.0f} tok/s | {rec['step_ms']:.0f} ms/step "
                f"(comm {comm_share:.0f}%) | {rec['comm_bytes'] / 2**20:.2f} MiB/step"
                + (f" | grad norm {rec['grad_norm']:.3g}" if "grad_norm" in rec else "") + f" | ETA {_fmt_time(eta)}")

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


# Dense bf16 peak FLOP/s for the MFU estimate (vendor datasheets).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "A10": 125e12, "L4": 121e12, "V100": 125e12}
WINDOW_KEYS = ("loss", "step_s", "data_s", "fwdbwd_s", "comm_s", "coll_s", "pack_s", "opt_s", "bytes_sent",
               "bytes_recv", "shard_bytes")


def peak_rss_gib() -> float:
    """This process's peak resident memory (the CPU counterpart of CUDA's max_memory_allocated)."""
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / (2**30 if sys.platform == "darwin" else 2**20)


def peak_flops(device) -> float | None:
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def window_record(trainer, window: list[dict]) -> dict:
    """The metrics.jsonl train record of a window of steps: rank means of every timing and byte
    count (ranks wait for each other in collectives, so means are representative)."""
    import torch

    from .dist import mean_over_ranks

    n = len(window)
    local = [sum(r[k] for r in window) / n for k in WINDOW_KEYS]
    norms = [r["grad_norms"] for r in window if r.get("grad_norms") is not None]
    if norms:  # one host read per logged window; update sync: the rank mean of local norms
        local += torch.stack(norms).mean(dim=0).tolist()
    means = mean_over_ranks(local, trainer.device)
    m = dict(zip(WINDOW_KEYS, means))
    rec = {"step": trainer.step, "train_loss": m["loss"], "lr": window[-1]["lr"],
           "step_ms": 1e3 * m["step_s"], "comm_ms": 1e3 * m["comm_s"], "comm_bytes": int(m["bytes_sent"]),
           "comm_bytes_recv": int(m["bytes_recv"]), "data_ms": 1e3 * m["data_s"],
           "fwdbwd_ms": 1e3 * m["fwdbwd_s"], "coll_ms": 1e3 * m["coll_s"], "pack_ms": 1e3 * m["pack_s"],
           "opt_ms": 1e3 * m["opt_s"], "tokens_per_s": trainer.tokens_per_step / max(m["step_s"], 1e-9),
           "train_time_s": trainer.train_time, "tokens": trainer.tokens_seen}
    if trainer.parallel.sharded:  # the optimizer's own collectives in the shard group (not FSDP's)
        rec["shard_bytes"] = int(m["shard_bytes"])
    if norms:
        *roles, rec["grad_norm"] = means[len(WINDOW_KEYS):]
        rec.update({f"grad_norm/{role}": v for role, v in zip(trainer.optimizer.grad_norm_roles, roles)})
    if trainer.device.type != "cuda":
        rec["peak_rss_gib"] = peak_rss_gib()
    else:
        rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
        peak = peak_flops(trainer.device)
        if peak:
            flops = trainer.model.flops_per_token(trainer.cfg.data.seq_len)
            rec["mfu"] = flops * rec["tokens_per_s"] / (peak * trainer.info.world_size)
    return rec


def finish_record(trainer, report) -> dict:
    """The {"event": "finish"} record: what the strategy's end of training sent (rank means, as a
    train record's), under keys of its own so no per-step series takes it for a step's."""
    from .dist import mean_over_ranks

    sent, recv, comm_s, seconds = mean_over_ranks([report.bytes_sent, report.bytes_recv, report.comm_s,
                                                   report.seconds], trainer.device)
    return {"step": trainer.step, "event": "finish", "finish_comm_bytes": int(sent),
            "finish_comm_bytes_recv": int(recv), "finish_comm_ms": 1e3 * comm_s, "finish_ms": 1e3 * seconds}


def banner(trainer) -> str:
    """The run log's opening lines: code and library versions, the machine, model, optimizer, data."""
    import platform

    import numpy
    import torch

    from . import provenance

    c, info = trainer.cfg, trainer.info
    m = trainer.model
    mix_dirs = getattr(trainer, "mix_dirs", None)
    data = (f"data mix {', '.join(f'{n} x{w:g} ({mix_dirs[n]})' for n, w in c.data.mix.items())}, val {trainer.data_dir}"
            if mix_dirs else f"data {trainer.data_dir}")
    return "\n".join([
        provenance.console_line(provenance.collect()),
        f"run {trainer.out_dir} | python {platform.python_version()} torch {torch.__version__} "
        f"numpy {numpy.__version__} | {platform.node()} {platform.machine()} | {info.backend} "
        f"world {info.world_size} on {trainer.device}" + (
            f", mesh {trainer.parallel.describe()}: FSDP2 inside each shard group, comm.mode across the replicas"
            if trainer.parallel.sharded else ""),
        f"model {c.model.preset}: {m.num_params() / 1e6:.2f}M params "
        f"({m.num_params(non_embedding=True) / 1e6:.2f}M non-embedding), "
        f"{m.flops_per_token(c.data.seq_len) / 1e6:.1f} MFLOP/token"
        + (f" | initialised from {c.model.init_from}" + (f" (resumed at step {trainer.step}: the checkpoint's "
                                                          f"weights are used)" if trainer.step else "")
           if c.model.init_from else ""),
        f"optim {c.optim.name} lr {c.optim.lr}" + _lr_mults(c.optim) + f" | {trainer.optimizer.describe()}",
        f"{data} | {trainer.tokens_per_step:,} tokens/step | {c.train.max_steps} steps"
        f" | eval {trainer.evaluator.steps} batches" + (
            f" (val split holds {trainer.evaluator.steps}, asked {c.train.eval_steps})"
            if trainer.evaluator.steps < c.train.eval_steps else "")
        + (f" + {len(trainer.evaluator.mc_items)} multiple-choice items" if trainer.evaluator.mc_items else ""),
        *[f"note: {n}" for n in trainer.optimizer.scheme_options.notes()],
        *[f"note: {n}" for n in [mix_val_note(c, trainer.data_dir, mix_dirs)] if n],
    ])


def mix_val_note(cfg, data_dir, mix_dirs: dict | None) -> str | None:
    """The note a data.mix run gets when it is scored on none of its sources (data.dataset left at the
    built-in corpus, typically), else None."""
    if not mix_dirs or cfg.data.dataset in cfg.data.mix or Path(data_dir) in {Path(p) for p in mix_dirs.values()}:
        return None
    return (f"data.mix validates on data.dataset={cfg.data.dataset}, which is none of the mix's sources (the "
            f"built-in corpus when data.dataset is unset); set data.dataset to a prepared dataset whose val split "
            f"you want the run scored on")


def _lr_mults(o) -> str:
    """The lr multipliers of the embedding, head and scalar groups when one is not 1 (a size file's
    Lion recipe, e.g. App. F.3's x1000 / x100, must not reach another optimizer unseen)."""
    mults = {"embedding": o.embedding_lr_mult, "head": o.head_lr_mult, "scalar": o.scalar_lr_mult}
    if all(v == 1 for v in mults.values()):
        return ""
    return " (x" + ", x".join(f"{v:g} {k}" for k, v in mults.items()) + ")"
