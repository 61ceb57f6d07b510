"""Run configuration: YAML -> nested dataclasses, CLI overrides, one validation pass.

Precedence: dataclass defaults < YAML file (and the files it `extends:`) < `section.key=value`
overrides. Every field carries a docstring (the string under it); `describe()` prints them as
help. `validate()` collects every problem into one ConfigError naming the key and the allowed
values, so a user fixes a config in one round trip.

The `comm` and `optim` sections are open: besides their common keys they take the options of the
selected entry of a registry (`comm.mode` -> optim.sync, `optim.name` -> optim.registry), each a
typed dataclass that validates itself, so a new mode or optimizer brings its keys with it and
nothing here names a mode.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from optim.options import at_least, choice, common_problems

from comm.kernels import IMPLS as kernel_impls
from data.loader import ORDERS as DATA_ORDERS
from model import ROLES
from optim import sync
from optim.registry import compatibility_problem, optimizer_names, run_problems
from util.files import FileShapeError, strict_yaml

from .schedule import DECAY_SHAPES, SCHEDULES, decay_steps

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
    beyond noise (configs/auto_quality.yaml states the rule): 8-bit L1 Lion Cub qualifies (-0.025 ±
    0.022 val loss vs 32-bit Lion, 3 seeds); 1-bit Lion Cub does not (+0.021 ± 0.008), nor do
    ablations or variants without evidence. Name such a variant here (e.g. lioncub_1bit) to let auto
    trade that quality for speed."""
    auto_min_gain: float = 0.10
    """comm.mode=auto: leave fp32 only when the fastest allowed variant's predicted step time is more
    than this fraction faster than fp32's (0.10: 10 %); otherwise stay on fp32 and say so."""
    auto_remeasure: bool = False
    """comm.mode=auto on resume: measure again instead of keeping the stored decision (a different
    pick then refuses the resume: no mid-run switching)."""
    momentum_sync: MomentumSyncConfig = field(default_factory=MomentumSyncConfig)
    """Selective momentum synchronisation (Lion Cub §5); update-sync modes only."""
    timeout_s: float = 600.0
    """Collective timeout in seconds (process group); a hung peer fails the run after this."""
    kernels: str = "auto"
    """The fused hot-path kernels (quantize/pack, unpack/vote, Lion passes; comm.kernels, optim.lion): auto (per
    kernel, the fastest of eager, compiled with torch.compile and native C loops (CPU), timed in warm-up on
    the run's sizes and agreed by the ranks; $LIONCUB_KERNELS overrides auto), compiled (an error where no
    compiler exists), native (comm.native, CPU only) or eager. Every choice gives the same bytes and updates;
    compilation is paid once before the first timed step and reported."""
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
    """Validation batches per evaluation (per rank)."""
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
    evaluation (acc, acc_norm per byte, acc per token); empty = off. See README "Evaluation"."""
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
    local shards. 1 = every rank holds the whole model (replicated). Must divide the world size."""


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


def describe() -> str:
    lines = []
    regs = _registries()
    for sec in dataclasses.fields(Config):
        lines.append(f"{sec.name}:")
        default = sec.default_factory()
        cls = default.__class__
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name != "options":
                value = getattr(default, f.name)
                lines.append(f"  {f.name} ({_type_and_default(cls, f.name, value)}): {docs.get(f.name, '')}")
                if dataclasses.is_dataclass(value):  # a nested section: its keys, dotted
                    sub = field_docs(type(value))
                    lines += [f"  {f.name}.{g.name} ({_type_and_default(type(value), g.name, getattr(value, g.name))}): "
                              f"{sub.get(g.name, '')}" for g in dataclasses.fields(value)]
        if sec.name in regs:
            selector, entries = regs[sec.name]
            owners: dict[str, list[str]] = {}
            helps: dict[str, str] = {}
            for name, ocls in entries:
                d = field_docs(ocls)
                defaults = {f.name: f for f in dataclasses.fields(ocls)}
                for key in ocls.field_names():
                    owners.setdefault(key, []).append(name)
                    f = defaults[key]
                    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                    helps.setdefault(key, f"({_type_and_default(ocls, key, value)}) {d.get(key, '')}")
            for key, names in owners.items():
                lines.append(f"  {key} {helps[key].split(') ', 1)[0]}): [{sec.name}.{selector}={'|'.join(names)}] "
                             f"{helps[key].split(') ', 1)[1]}")
    return "\n".join(lines)


def _type_and_default(cls, name: str, value: Any) -> str:
    """'float, default 0.0003' for --help-config: the key's type as the YAML takes it, and its default."""
    tp = typing.get_type_hints(cls).get(name)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    tname = (getattr(args[0], "__name__", str(args[0])) + " or null") if len(args) == 1 and \
        type(None) in typing.get_args(tp) else getattr(tp, "__name__", str(tp))
    if dataclasses.is_dataclass(value):
        return "section"
    return f"{tname}, default {yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()!s}"


# ---------------------------------------------------------------- loading and merging
def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config 'extends' cycle: {' -> '.join(map(str, seen + (path,)))}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:  # a key given twice (a second `train:` section) is an error naming both lines, never a silent loss
        raw = strict_yaml(path.read_text(), path) or {}
    except FileShapeError as e:
        raise ConfigError(str(e)) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    parents = raw.pop("extends", None) or []
    if isinstance(parents, str):
        parents = [parents]
    base: dict = {}
    for parent in parents:  # later parents override earlier ones, the file itself overrides all
        base = _merge(base, _read_yaml(path.parent / parent, seen + (path,)))
    return _merge(base, raw)


def read_yaml(path: str | Path) -> dict:
    """A config file as a plain dict, its `extends:` chain resolved (ConfigError on a bad file)."""
    return _read_yaml(Path(path))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(items: list[str]) -> dict:
    """`section.key=value` (value parsed as YAML) -> nested dict."""
    out: dict = {}
    problems = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or "." not in key:
            problems.append(f"override {item!r}: expected section.key=value (e.g. train.max_steps=100)")
            continue
        try:
            parsed = strict_yaml(value, f"override {key}") if value != "" else ""
        except FileShapeError as e:
            problems.append(str(e))
            continue
        except yaml.YAMLError:
            parsed = value
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override {item!r} conflicts with another override of {part}")
                break
        else:
            node[parts[-1]] = parsed
    if problems:
        raise ConfigError("\n".join(problems))
    return out


def _type_ok(value: Any, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is list or origin is list:
        return isinstance(value, list)
    if tp is str:
        return isinstance(value, str)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    return True


def _build(cls, data: dict, prefix: str, problems: list[str]):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "options"]
    kwargs = {}
    regs = _registries()
    section = prefix.rstrip(".")
    if cls in (CommConfig, OptimConfig) and section in regs:
        data, kwargs["options"] = _split_options(section, data, names, regs[section], problems)
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(names)}"
            problems.append(f"{where}: unknown key{hint}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(f"{where}: expected a mapping of {', '.join(f.name for f in dataclasses.fields(tp))}")
                continue
            kwargs[key] = _build(tp, value, where + ".", problems)
            continue
        if isinstance(value, str) and float in typing.get_args(tp) + (tp,):
            try:  # YAML 1.1 reads 3e-4 (no dot) as a string; accept what float() accepts
                value = float(value)
            except ValueError:
                pass
        if not _type_ok(value, tp):
            tname = getattr(tp, "__name__", str(tp)).replace("NoneType", "null")
            problems.append(f"{where}: expected {tname}, got {value!r} ({type(value).__name__})")
            continue
        if tp is float and isinstance(value, int):
            value = float(value)
        kwargs[key] = value
    return cls(**kwargs)


def _split_options(section: str, data: dict, fixed: list[str], registry, problems: list[str]):
    """Separate the selected registry entry's option keys from the section's common keys and
    build the entry's options dataclass (typed, with the same checks as every other key)."""
    selector, entries = registry
    default = {"comm": CommConfig.mode, "optim": OptimConfig.name}[section]
    chosen = data.get(selector, default)
    classes = dict(entries)
    if chosen not in classes:
        return data, None  # the selector itself is reported by validate()
    ocls = classes[chosen]
    own = set(ocls.field_names())
    rest, mine = {}, {}
    for key, value in data.items():
        if key in own:
            mine[key] = value
        elif key in fixed:
            rest[key] = value
        else:
            owners = [n for n, c in entries if key in c.field_names()]
            if owners:
                problems.append(f"{section}.{key}: not an option of {section}.{selector}={chosen} (it belongs to "
                                f"{', '.join(owners)}); remove it or change {section}.{selector}")
            else:
                valid = fixed + sorted(own)
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f"; did you mean {section}.{close[0]}?" if close else f"; valid keys: {', '.join(valid)}"
                problems.append(f"{section}.{key}: unknown key{hint}")
    return rest, _build(ocls, mine, section + ".", problems)


def split_config_args(args: list[str]) -> tuple[list[str], list[str]]:
    """A command line's leading config files (*.yaml / *.yml, no '=') and the key=value overrides after them."""
    files = []
    for a in args:
        if "=" in a or not a.endswith((".yaml", ".yml")):
            break
        files.append(a)
    return files, args[len(files):]


def load_config_args(args: list[str]) -> Config:
    """The Config of train.py's command line (CONFIG.yaml [MORE.yaml ...] [section.key=value ...]);
    ConfigError when it names no config file first or the config is invalid."""
    files, overrides = split_config_args(args)
    if not files:
        raise ConfigError(f"{args[0]}: expected a config file (*.yaml) first; usage: train.py CONFIG.yaml "
                          f"[MORE.yaml ...] [section.key=value ...]")
    return load_config(files, overrides)


def load_config(path: str | Path | list | tuple | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (following `extends:`), apply overrides, build and validate the Config.

    `path` may be several files, merged in order (a size file, then a variant file:
    `configs/gpt2_124m.yaml configs/variants/lioncub_1bit.yaml`). With several files the run
    directory defaults to the merged train.out_dir joined with the last file's name
    (runs/gpt2_124m/lioncub_1bit), unless a file after the first or an override sets it."""
    paths = [Path(p) for p in (path if isinstance(path, (list, tuple)) else [path] if path else [])]
    raw: dict = {}
    for p in paths:
        raw = _merge(raw, _read_yaml(p))
    over = parse_overrides(overrides or [])
    if len(paths) > 1 and "out_dir" in (raw.get("train") or {}) and not any(
            "out_dir" in (_read_yaml(p).get("train") or {}) for p in paths[1:]) \
            and "out_dir" not in (over.get("train") or {}):
        raw["train"] = {**raw["train"], "out_dir": str(Path(raw["train"]["out_dir"]) / paths[-1].stem)}
    raw = _merge(raw, over)
    problems: list[str] = []
    names = [f.name for f in dataclasses.fields(Config)]
    for key in list(raw):
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            problems.append(f"{key}: unknown section" + (f"; did you mean {close[0]}?" if close else
                                                         f"; valid sections: {', '.join(names)}"))
            raw.pop(key)
        elif not isinstance(raw[key], dict):
            problems.append(f"{key}: expected a mapping of keys, got {raw[key]!r}")
            raw.pop(key)
    for section in _registries():
        raw.setdefault(section, {})  # so the selected entry's options are always built
    cfg = _build(Config, raw, "", problems)
    problems += validate(cfg, world_size=None, raise_error=False)
    if problems:
        raise ConfigError(_format(problems))
    return cfg


def wandb_problems(setting: str, environ: dict | None = None) -> list[str]:
    """log.wandb (or $WANDB_MODE) asks for wandb, an optional package, and it is not installed: a
    config error on every rank before anything starts, not a traceback on rank 0 mid-start."""
    import importlib.util

    from .logger import resolve_wandb_mode

    try:
        mode = resolve_wandb_mode(setting, environ)
    except ValueError as e:
        return [f"log.wandb: unset, and {e}"]
    if mode != "disabled" and importlib.util.find_spec("wandb") is None:
        where = f"log.wandb={setting}" if setting else f"log.wandb unset and WANDB_MODE={mode}"
        return [f"{where}, but wandb is not installed: pip install -e '.[wandb]', or set log.wandb=disabled"]
    return []


def warmup_steps(optim: OptimConfig, horizon: int) -> int:
    """optim.warmup_steps, or optim.warmup_fraction of the schedule's horizon rounded down (so always
    below the horizon)."""
    return optim.warmup_steps or math.floor(round(optim.warmup_fraction * horizon, 9))  # 0.02 * 50000 is 1000


def _format(problems: list[str]) -> str:
    return f"{len(problems)} config problem(s):\n" + "\n".join(f"  - {p}" for p in problems)


def _parallel_problems(cfg: Config, world_size: int | None) -> list[str]:
    """parallel.shard_size: >= 1, divides the world size, and what the trainer cannot do on shards
    (whether the optimizer and comm.mode run on shards is theirs to say: optim.registry.run_problems)."""
    S = cfg.parallel.shard_size
    if S < 1:
        return [f"parallel.shard_size: {S} must be >= 1 (1 = replicated)"]
    p = []
    if world_size is not None and world_size % S:
        p.append(f"parallel.shard_size: {S} does not divide the world size {world_size}; choose a divisor "
                 f"(the ranks per node, typically)")
    if S > 1 and cfg.train.mc_eval_file:
        p.append(f"train.mc_eval_file: set with parallel.shard_size={S}; each rank scores its own items, so the ranks "
                 f"of a shard group would run different forwards; leave train.mc_eval_file empty (score the "
                 f"checkpoint with `python -m eval mc`)")
    if S > 1 and cfg.comm.bucket_mb:
        p.append(f"comm.bucket_mb: {cfg.comm.bucket_mb} with parallel.shard_size={S}: FSDP already overlaps its "
                 f"reduce-scatter with backward; set comm.bucket_mb=0 and comm.overlap=false")
    return p


def validate(cfg: Config, world_size: int | None = None, raise_error: bool = True) -> list[str]:
    """Check ranges and combinations. With world_size, also the checks that depend on it."""
    from model import PRESETS  # the trainer sees everything; config validation needs the presets

    p: list[str] = []
    m, d, o, c, t, lg, dg = cfg.model, cfg.data, cfg.optim, cfg.comm, cfg.train, cfg.log, cfg.diag
    choice(p, "model.preset", m.preset, list(PRESETS))
    choice(p, "model.pos_emb", m.pos_emb, ["rope", "learned"])
    choice(p, "data.order", d.order, list(DATA_ORDERS))
    for key, val, lo in [("data.batch_size", d.batch_size, 1), ("data.seq_len", d.seq_len, 1),
                         ("data.grad_accum", d.grad_accum, 1), ("train.max_steps", t.max_steps, 1),
                         ("train.eval_steps", t.eval_steps, 1), ("train.log_every", t.log_every, 1),
                         ("train.keep_ckpts", t.keep_ckpts, 1), ("model.block_size", m.block_size, 0),
                         ("train.max_skipped_steps", t.max_skipped_steps, 1),
                         ("train.eval_every", t.eval_every, 0), ("train.ckpt_every", t.ckpt_every, 0),
                         ("optim.warmup_steps", o.warmup_steps, 0), ("diag.every", dg.every, 0),
                         ("train.stop_after", t.stop_after, 0), ("train.mc_eval_items", t.mc_eval_items, 0)]:
        at_least(p, key, val, lo)
    for key in ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "rope_base", "norm_eps"):
        at_least(p, f"model.{key}", getattr(m, key), 0)
    if m.init_from and not Path(m.init_from).expanduser().is_dir():
        p.append(f"model.init_from: {m.init_from} is not a directory; give a run directory, a checkpoint directory "
                 f"(RUN/ckpt/step_N) or a Hugging Face Llama directory")
    if m.preset in PRESETS:
        from model import resolve_config

        try:  # the shape keys over the preset must make a valid model (heads divide the width, ...)
            resolve_config(m)
        except ValueError as e:
            p.append(f"model: {e}; fix the model.n_* keys")
        block = m.block_size or PRESETS[m.preset].block_size
        if d.seq_len > block:
            p.append(f"data.seq_len: {d.seq_len} exceeds the model's block size {block}; "
                     f"lower data.seq_len or set model.block_size")
    for name, weight in d.mix.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            p.append(f"data.mix: weight of {name!r} is {weight!r}; give each dataset a finite number > 0")
    choice(p, "optim.name", o.name, optimizer_names())
    choice(p, "optim.schedule", o.schedule, list(SCHEDULES))
    choice(p, "optim.decay_shape", o.decay_shape, list(DECAY_SHAPES))
    at_least(p, "optim.schedule_steps", o.schedule_steps, 0)
    if not 0 <= o.warmup_fraction < 1:
        p.append(f"optim.warmup_fraction: {o.warmup_fraction} must be in [0, 1)")
    if not 0 < o.decay_fraction <= 1:
        p.append(f"optim.decay_fraction: {o.decay_fraction} must be in (0, 1]")
    horizon = o.schedule_steps or t.max_steps
    where = "optim.schedule_steps" if o.schedule_steps else "train.max_steps"
    warm = warmup_steps(o, horizon)
    if horizon >= 1 and warm >= horizon:
        p.append(f"optim.warmup_steps: {warm} >= {where}={horizon}: the lr would never leave warmup (and never "
                 f"decay); lower optim.warmup_steps (e.g. {max(0, horizon // 10)}), use optim.warmup_fraction, "
                 f"or raise {where}")
    elif o.schedule == "wsd" and horizon >= 1 and 0 < o.decay_fraction <= 1 and \
            warm + decay_steps(horizon, o.decay_fraction) > horizon:
        p.append(f"optim.decay_fraction: warmup ({warm}) + decay ({decay_steps(horizon, o.decay_fraction)} steps) "
                 f"exceed {where}={horizon}; lower optim.warmup_steps or optim.decay_fraction")
    p += common_problems(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, grad_clip=o.grad_clip)
    for key, val in [("optim.embedding_lr_mult", o.embedding_lr_mult),
                     ("optim.head_lr_mult", o.head_lr_mult), ("optim.scalar_lr_mult", o.scalar_lr_mult)]:
        at_least(p, key, val, 0)
    if not 0 <= o.min_lr_ratio <= 1:
        p.append(f"optim.min_lr_ratio: {o.min_lr_ratio} must be in [0, 1]")
    choice(p, "comm.mode", c.mode, sync.names() + [AUTO_MODE])
    variants = sorted(q.stem for q in VARIANTS_DIR.glob("*.yaml"))
    bad_allow = ([m for m in c.auto_allow if m not in sync.names() and m not in variants]
                 if isinstance(c.auto_allow, list) else c.auto_allow)
    if bad_allow or not c.auto_allow:
        p.append(f"comm.auto_allow: {bad_allow or '[]'} not among the modes {', '.join(sync.names())} "
                 f"(or the variants in configs/variants); list one or more of them")
    elif c.mode == AUTO_MODE and o.name in optimizer_names() and all(
            m in sync.names() and compatibility_problem(o.name, m) for m in c.auto_allow):
        p.append(f"comm.auto_allow: optim.name={o.name} runs on none of {c.auto_allow}; allow one of "
                 f"{', '.join(m for m in sync.names() if not compatibility_problem(o.name, m))}")
    if c.auto_min_gain < 0 or not math.isfinite(c.auto_min_gain):
        p.append(f"comm.auto_min_gain: {c.auto_min_gain} must be a finite fraction >= 0 (0.10: 10 % faster)")
    if c.mode == AUTO_MODE and cfg.parallel.shard_size > 1:  # trainer.advise predicts replicated runs only
        p.append(f"comm.mode=auto with parallel.shard_size={cfg.parallel.shard_size}: the advisor measures and "
                 f"predicts replicated runs only; pick comm.mode yourself (python -m bench.advise on the "
                 f"replicated config ranks the modes) or set parallel.shard_size=1")
    S = cfg.parallel.shard_size
    replicas = world_size // S if world_size is not None and S >= 1 and world_size % S == 0 else world_size
    ms = c.momentum_sync
    if c.mode in sync.names() and c.options is not None:
        # whether this optimizer runs on this mode with these options and settings: the registries
        # decide (world-size checks across the replicas); comm.mode=auto is checked once resolved
        run = dict(bucket_mb=c.bucket_mb, overlap=c.overlap, grad_clip=o.grad_clip, momentum_sync_every=ms.every,
                   shard_size=max(S, 1))
        p += run_problems(o.name, c.mode, c.options, replicas, **run) if o.name in optimizer_names() else \
            sync.get(c.mode).run_problems(c.options, replicas, **run)
    if c.options is not None:
        p += c.options.run_problems(t.max_steps)
    if o.options is not None:
        p += o.options.problems(replicas) + o.options.run_problems(t.max_steps)
    choice(p, "comm.kernels", c.kernels, kernel_impls)
    if c.timeout_s <= 0 or c.init_timeout_s <= 0:
        p.append(f"comm.timeout_s: {c.timeout_s}, comm.init_timeout_s: {c.init_timeout_s}; both must be > 0")
    if ms.every < 0 or ms.start < 0 or ms.stop < 0:
        p.append("comm.momentum_sync: every, start and stop must be >= 0")
    if ms.stop and ms.start > ms.stop:
        p.append(f"comm.momentum_sync: start={ms.start} is after stop={ms.stop}; no sync would run")
    if ms.every and not ms.layers:
        p.append("comm.momentum_sync.layers: empty; select layers (e.g. [head]) or set every: 0")
    bad = [x for x in ms.layers if x not in LAYER_SELECTORS]
    if bad:
        p.append(f"comm.momentum_sync.layers: {bad} not among {', '.join(LAYER_SELECTORS)}")
    if ms.every and "head" in ms.layers and m.tie_embeddings is not False and len(ms.layers) == 1:
        p.append("comm.momentum_sync.layers: [head] but the model ties embedding and head (the shared weight "
                 "is the 'embedding' layer); set model.tie_embeddings=false or select embedding")
    p += _parallel_problems(cfg, world_size)
    choice(p, "train.resume", t.resume, ["never", "auto", "overwrite"])
    choice(p, "train.on_nonfinite", t.on_nonfinite, ["stop", "skip_step", "rollback"])
    choice(p, "train.device", t.device, ["auto", "cpu", "cuda"])
    choice(p, "train.dtype", t.dtype, ["bfloat16", "float32"])
    if lg.wandb:  # empty follows $WANDB_MODE (trainer/logger.py resolve_wandb_mode)
        choice(p, "log.wandb", lg.wandb, ["online", "offline", "disabled"])
    p += wandb_problems(lg.wandb)
    from .profiling import config_problems  # train.profile, train.memory_snapshot, log.tensorboard

    p += config_problems(cfg)
    if not t.out_dir:
        p.append("train.out_dir: empty; name a run directory")
    if p and raise_error:
        raise ConfigError(_format(p))
    return p
