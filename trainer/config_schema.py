"""The run configuration's schema: one dataclass per YAML section, each field with its help text
(the string under it), and the shared pieces the loader, the validator and --help-config use.

trainer.config is the public module; it re-exports every name here."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from model import ROLES
from optim import sync

VARIANTS_DIR = Path(__file__).resolve().parent.parent / "configs" / "variants"  # comm.auto_allow may name them

LAYER_SELECTORS = ROLES + ("all",)


AUTO_MODE = "auto"  # comm.mode: chosen at start from measurements (trainer/automode.py)


class ConfigError(ValueError):
    """A config problem the user must fix; the message lists every problem found."""


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Size preset from model.PRESETS (debug, tiny, cpu-30m, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1558m, gpt-7b)."""
    tie_embeddings: bool | None = None
    """Share token embedding and output head; null keeps the preset's choice (tied)."""
    pos_emb: str = "rope"
    """Position encoding: rope or learned."""
    block_size: int = 0
    """Context length override; 0 keeps the preset's block size."""
    n_layer: int = 0
    """Transformer blocks; 0 keeps the preset's. The shape keys (n_layer, n_head, n_kv_head, n_embd,
    mlp_hidden, block_size, rope_base, norm_eps) override the preset one by one."""
    n_head: int = 0
    """Query heads; 0 keeps the preset's."""
    n_kv_head: int = 0
    """Key/value heads (grouped-query attention; must divide n_head); 0 = n_head (the preset's when
    n_head is not set either)."""
    n_embd: int = 0
    """Model width; 0 keeps the preset's."""
    mlp_hidden: int = 0
    """SwiGLU hidden width; 0 = the preset's, or about 8/3 n_embd when n_embd is set."""
    rope_base: float = 0.0
    """RoPE frequency base (Llama's rope_theta); 0 = 10000."""
    norm_eps: float = 0.0
    """RMSNorm epsilon; 0 = 1e-6."""
    init_from: str = ""
    """Start from these weights instead of a random init: a run directory, a checkpoint directory
    (RUN/ckpt/step_N) or a Hugging Face Llama-architecture directory (our export, or a Llama with
    grouped-query attention). The architecture is the source's (the shape keys are filled from it; one
    set to something else is an error); the step count, optimizer state and data position start fresh,
    and the source's val loss is logged at step 0. A resume continues from the run's own checkpoint (the
    source is read again for its architecture, so it must still be there)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them (torch.utils.checkpoint,
    non-reentrant): less memory, about one more forward's compute; the same gradients."""


@dataclass
class DataConfig:
    dataset: str = "builtin"
    """'builtin' (the bundled CPython documentation corpus, prepared on first use) or a directory of
    train_*.bin / val_*.bin shards written by `python -m data.prepare`."""
    batch_size: int = 8
    """Sequences per micro-batch per rank."""
    seq_len: int = 128
    """Tokens per sequence (<= the model's block size)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step on each rank."""
    order: str = "sequential"
    """How the train stream is read (data.loader.ORDERS): sequential (each global batch the next
    consecutive tokens, split into adjacent per-rank chunks) or shuffled (seq_len windows in a seeded
    permutation per epoch: ranks and rows read unrelated text, still no token twice an epoch; the val
    batches are windows spread over the whole val split)."""
    cache_dir: str = ""
    """Where the built-in corpus and tokenizer cache live; empty = <repo>/.cache."""
    mix: dict = field(default_factory=dict)
    """Train on several prepared datasets by weight, e.g. {builtin: 0.3, data/owt: 0.7} (weights are
    normalised): each global batch comes from one source, the one furthest behind its share, so after
    any k batches each source has given within one batch of its weight times k; a resume continues
    every source where it stopped. data.dataset is then the validation set. Empty = data.dataset only."""


@dataclass
class OptimConfig:
    name: str = "lion"
    """Optimizer (optim.registry): adamw or lion, ... With an update-sync comm.mode, lion becomes
    distributed Lion / Lion Cub (each rank keeps its own momentum)."""
    lr: float = 3e-4
    """Peak (base) learning rate."""
    betas: list = field(default_factory=lambda: [0.9, 0.99])
    """(beta1, beta2). Lion: interpolation and momentum coefficients (Chen et al.)."""
    eps: float = 1e-8
    """AdamW epsilon (unused by Lion)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied only to >= 2-D weights."""
    grad_clip: float = 1.0
    """Clip the gradient to this global L2 norm before the step; 0 disables. Update-sync modes
    clip each rank's local gradient."""
    schedule: str = "cosine"
    """LR schedule after warmup (trainer/schedule.py): cosine or linear decay to min_lr_ratio * lr over the
    run; wsd (warmup-stable-decay: the peak lr, then decay over the last decay_fraction of the run in
    decay_shape); or constant."""
    warmup_steps: int = 0
    """Linear warmup steps from 0 to lr; must be below train.max_steps."""
    warmup_fraction: float = 0.0
    """Warmup as a fraction of the schedule's horizon (rounded down), so any train.max_steps keeps a
    valid schedule; used when warmup_steps is 0."""
    min_lr_ratio: float = 0.1
    """Final LR of the decaying schedules as a fraction of lr; 0 decays to zero."""
    decay_fraction: float = 0.2
    """wsd: the fraction of the horizon spent decaying, at its end."""
    decay_shape: str = "linear"
    """wsd: the decay's shape: linear (1 - p), cosine ((1 + cos pi p) / 2) or sqrt (1 - sqrt p)."""
    schedule_steps: int = 0
    """The schedule's horizon (the step where the decay ends). 0 = train.max_steps of the run's first
    start, kept on resume: raising train.max_steps then extends the run at the final lr instead of
    re-stretching the schedule (the console says so); set this to re-stretch it."""
    embedding_lr_mult: float = 1.0
    """LR multiplier of the token embedding (Lion Cub App. F.3: 3e-2 / 3e-5 = 1000)."""
    head_lr_mult: float = 1.0
    """LR multiplier of the output head (Lion Cub App. F.3: 100)."""
    scalar_lr_mult: float = 1.0
    """LR multiplier of 1-D parameters: norms (Lion Cub App. F.3: 100)."""
    options: Any = None
    """(not a key) the selected optimizer's own options; their keys sit flat in this section."""

    def __getattr__(self, name: str):
        return _option(self, name)


@dataclass
class MomentumSyncConfig:
    every: int = 0
    """Mean-allreduce the selected layers' momenta every k steps (Lion Cub §5); 0 disables."""
    layers: list = field(default_factory=lambda: ["head"])
    """Layer selectors: embedding, head, attn, mlp, norm, all."""
    start: int = 0
    """First step at which momentum sync may run."""
    stop: int = 0
    """Step after which it stops; 0 = never stops."""


@dataclass
class CommConfig:
    mode: str = "fp32"
    """What crosses the network (optim.sync registry). Gradient sync (every rank averages its gradient,
    one shared optimizer state): fp32, bf16. Update sync (every rank keeps its own state, only the
    aggregated update crosses): onebit (Lion Cub 1-bit compressed allreduce), pbit (Lion Cub p-bit
    direct allreduce), ps (Distributed Lion parameter server), hierarchical (BinSGDM §4 vote), ...
    Each mode's own keys are listed below it. auto: measure the links and the model at start and run
    the fastest of comm.auto_allow for optim.name whose quality evidence allows it, when its predicted
    gain exceeds comm.auto_min_gain (trainer.advise; the decision is kept in the run directory, so a
    resumed run keeps it)."""
    auto_allow: list = field(default_factory=lambda: ["fp32", "bf16", "onebit", "pbit"])
    """comm.mode=auto: the modes (or named variants, configs/variants) it may choose. Among a mode's
    variants auto keeps only those the study-prose reproduction does not measure worse than fp32
    beyond noise (trainer/auto_quality.yaml states the rule): 8-bit L1 Lion Cub qualifies (-0.030 ±
    0.017 val loss vs 32-bit Lion, 5 seeds); 1-bit Lion Cub does not (+0.017 ± 0.007), nor do
    ablations or variants without evidence. Name such a variant here (e.g. lioncub_1bit) to let auto
    trade that quality for speed."""
    auto_min_gain: float = 0.10
    """comm.mode=auto: leave fp32 only when the fastest allowed variant's predicted step time is more
    than this fraction faster than fp32's (0.10: 10 %); otherwise stay on fp32 and say so."""
    auto_remeasure: bool = False
    """comm.mode=auto on resume: measure again instead of keeping the stored decision (a different
    pick then stops the resume with an error naming both: no mid-run switching)."""
    momentum_sync: MomentumSyncConfig = field(default_factory=MomentumSyncConfig)
    """Selective momentum synchronisation (Lion Cub §5); update-sync modes only."""
    timeout_s: float = 600.0
    """Collective timeout in seconds (process group); a hung peer fails the run after this."""
    kernels: str = "auto"
    """The fused hot-path kernels (quantize/pack, unpack/vote, Lion passes; comm.kernels, optim.lion): auto (the
    device's fast implementation: the native C loops on CPU, the compiled kernels on CUDA, where sign packing
    and the majority are timed against eager in warm-up and the ranks agree on one choice, and Lion's fused
    step replays from a CUDA graph; $LIONCUB_KERNELS overrides auto), compiled (an error where no compiler
    exists; Lion's fused step without the graph), native (comm.native, CPU only) or eager.
    Every choice gives the same bytes and updates; compilation is paid once before the first timed step and
    reported."""
    bucket_mb: float = 0.0
    """Exchange the vector in buckets of about this many MiB, in the order backward finishes their
    gradients (DDP's reducer uses 25); 0 = one bucket, the whole vector. Results are the same with and
    without comm.overlap for the same buckets."""
    overlap: bool = False
    """Launch each bucket's exchange during backward as soon as its gradients are final (gradient sync:
    an asynchronous allreduce, like DDP; update sync: that bucket's vote, on a background thread).
    Needs comm.bucket_mb > 0; with update sync also optim.grad_clip=0."""
    fine_timing: bool = True
    """Time collectives and packing inside each step (the step-time breakdown); off: bytes only, and
    the step time alone is measured (to check that the timers cost nothing)."""
    init_timeout_s: float = 120.0
    """How long forming the process group may take; a (re)started round whose peers do not all connect
    fails after this, so an elastic launcher can restart it instead of waiting comm.timeout_s."""
    options: Any = None
    """(not a key) the selected mode's options; their keys sit flat in this section."""

    def __getattr__(self, name: str):
        return _option(self, name)


def _option(section, name: str):
    """cfg.comm.bits reads the selected entry's option (AttributeError if it has none)."""
    opts = section.__dict__.get("options")
    if opts is not None and name in opts.field_names():
        return getattr(opts, name)
    raise AttributeError(f"{type(section).__name__} has no key {name!r}"
                         + (f" (options of the selected entry: {opts.field_names()})" if opts is not None else ""))


@dataclass
class TrainConfig:
    max_steps: int = 300
    """Optimizer steps to run."""
    eval_every: int = 50
    """Evaluate every N steps (and at the end); 0 = only at the end."""
    eval_steps: int = 10
    """Validation batches per evaluation, per rank: an evaluation reads the val split's first world size x
    eval_steps batches, so a run at another world size evaluates another set."""
    ckpt_every: int = 0
    """Checkpoint every N steps (and always at the end); 0 = only at the end."""
    keep_ckpts: int = 2
    """How many checkpoints to keep (oldest deleted first)."""
    async_ckpt: bool = False
    """Write checkpoints in a background thread: the state is copied to the CPU at the save, training
    continues while the files, checksums and meta.json are written; the next save and the end of the
    run wait for it. A failed background save is reported and never marked intact."""
    out_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, ckpt/."""
    stop_after: int = 0
    """Stop with a checkpoint after this many steps in this invocation (e.g. a time-limited slurm job
    that is requeued and resumes with train.resume=auto); 0 = run to max_steps."""
    resume: str = "never"
    """never (refuse an existing run dir), auto (continue from its latest checkpoint if any), or
    overwrite (delete the existing run dir first)."""
    seed: int = 1337
    """Seed for init (same on all ranks) and data order."""
    log_every: int = 10
    """Write a train record every N steps."""
    device: str = "auto"
    """auto (cuda if available), cpu or cuda."""
    dtype: str = "bfloat16"
    """Autocast dtype on CUDA (bfloat16 or float32); CPU always runs float32."""
    compile: bool = False
    """torch.compile the model."""
    on_nonfinite: str = "stop"
    """What a non-finite loss or gradient on any rank does (checked every step, all ranks agree; no
    update is applied): stop (exit non-zero naming the step), skip_step (go on without that update) or
    rollback (reload the last good checkpoint and skip the offending step's batches)."""
    max_skipped_steps: int = 10
    """With on_nonfinite=skip_step: stop (exit 3, the last good checkpoint kept) after this many
    consecutive skipped steps; a run that skips step after step is diverging, not hiccuping."""
    mc_eval_file: str = ""
    """HellaSwag-format JSONL (ctx, endings, label) scored by completion log-likelihood at every
    evaluation (acc, acc_norm per byte, acc per token); empty = off. See docs/models.md "During training"."""
    mc_eval_items: int = 0
    """Score only the first N items of mc_eval_file; 0 = all."""
    profile: str | int | list = ""
    """Steps to trace with torch.profiler on every rank: 5-7, "5,9", 6 or [5, 6] (the first step is 1);
    empty = off. Chrome traces (TensorBoard's profiler plugin reads them) in <out_dir>/profile/."""
    memory_snapshot: int = 0
    """CUDA only: record the allocator's history from the first step and write a snapshot per rank
    (<out_dir>/memory/rank<R>.pickle, for pytorch.org/memory_viz) after this step; 0 = off."""


@dataclass
class LogConfig:
    wandb: str = ""
    """online, offline (no network; sync later with `wandb sync`) or disabled; unset (empty): what
    $WANDB_MODE says, else disabled. online without an API key falls back to offline with a warning."""
    project: str = "lioncub"
    """wandb project."""
    run_name: str = ""
    """Run name; empty = the run directory's name."""
    group: str = ""
    """wandb group (compare modes side by side)."""
    tensorboard: bool = False
    """Also write the scalars logged to wandb to TensorBoard event files in <out_dir>/tensorboard/
    (the tensorboard extra: pip install -e '.[tensorboard]')."""


@dataclass
class DiagConfig:
    every: int = 0
    """Compute Lion Cub diagnostics every N steps (sign match/flip, tie rate, momentum spread); 0 = off.
    They cost extra communication, timed and counted separately."""
    histograms: bool = True
    """Log histograms of the local update per layer type to wandb on diagnostic steps."""


@dataclass
class ParallelConfig:
    shard_size: int = 1
    """Ranks that shard one copy of the model (FSDP2 inside the group, over the fast links: consecutive
    ranks of one node); the optimizer's comm.mode runs across the world / shard_size replicas on the
    local shards. 1 = every rank holds the whole model (replicated). Must divide the ranks per node (a shard
    group lives on one node), hence the world size."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    diag: DiagConfig = field(default_factory=DiagConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        """Plain nested dict as in the YAML files: registry options flat in their section."""
        out = {}
        for sec in dataclasses.fields(self):
            obj = getattr(self, sec.name)
            d = {}
            for f in dataclasses.fields(obj):
                v = getattr(obj, f.name)
                if f.name == "options":
                    d.update(v.as_dict() if v is not None else {})
                else:
                    d[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
            out[sec.name] = d
        return out

    def dump(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------- docstrings (help text)
def field_docs(cls) -> dict[str, str]:
    """The string literal under each field of a dataclass (and of its dataclass bases): its help."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # defined where no source is available
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:] + [None]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


# registry-backed sections: section -> (selector key, entries as (name, options class))
def _registries() -> dict[str, tuple[str, list[tuple[str, type]]]]:
    from optim.registry import optimizers

    return {"comm": ("mode", [(s.name, s.options) for s in sync.schemes()]),
            "optim": ("name", [(o.name, o.options) for o in optimizers()])}
