"""Run configuration: YAML -> nested dataclasses, CLI overrides, one validation pass.

Precedence: dataclass defaults < YAML file (and the files it `extends:`) < `section.key=value`
overrides. Every field carries a docstring (the string under it); `describe()` prints them as
help. `validate()` collects every problem into one ConfigError naming the key and the allowed
values, so a user fixes a config in one round trip (STYLE.md: torchtitan, litgpt).
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

GRADIENT_SYNC_MODES = ("fp32", "bf16")
UPDATE_SYNC_MODES = ("ps", "onebit", "pbit", "hierarchical")
COMM_MODES = GRADIENT_SYNC_MODES + UPDATE_SYNC_MODES
OPTIMIZER_NAMES = ("adamw", "lion")
LAYER_SELECTORS = ("embedding", "head", "attn", "mlp", "norm", "all")


class ConfigError(ValueError):
    """A config problem the user must fix; the message lists every problem found."""


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Size preset from model.PRESETS (debug, tiny, cpu-30m, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1558m)."""
    tie_embeddings: bool | None = None
    """Share token embedding and output head; null keeps the preset's choice (tied)."""
    pos_emb: str = "rope"
    """Position encoding: rope or learned."""
    block_size: int = 0
    """Context length override; 0 keeps the preset's block size."""


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
    cache_dir: str = ""
    """Where the built-in corpus and tokenizer cache live; empty = <repo>/.cache."""


@dataclass
class OptimConfig:
    name: str = "lion"
    """Optimizer: adamw or lion. With comm.mode ps/onebit/pbit/hierarchical, lion becomes
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
    """LR schedule after warmup: cosine (to min_lr_ratio * lr) or constant."""
    warmup_steps: int = 0
    """Linear warmup steps from 0 to lr."""
    min_lr_ratio: float = 0.1
    """Final LR of the cosine schedule as a fraction of lr."""
    embedding_lr_mult: float = 1.0
    """LR multiplier of the token embedding (Lion Cub App. F.3: 3e-2 / 3e-5 = 1000)."""
    head_lr_mult: float = 1.0
    """LR multiplier of the output head (Lion Cub App. F.3: 100)."""
    scalar_lr_mult: float = 1.0
    """LR multiplier of 1-D parameters: norms (Lion Cub App. F.3: 100)."""


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
    """What crosses the network. Gradient sync: fp32, bf16 (mean-allreduce of the flat gradient).
    Update sync (optim.name=lion only): ps (Distributed Lion parameter server), onebit (Lion Cub 1-bit
    compressed allreduce), pbit (Lion Cub p-bit direct allreduce), hierarchical (BinSGDM §4 vote)."""
    bits: int = 4
    """pbit: lane width in bits on the wire: 1, 2, 4, 8 or 16."""
    quantizer: str = "sign"
    """pbit: how the local update is quantized: sign, l0, l1, l2, linf or lp (Lion Cub §4.2 eq. 1)."""
    p: float = 1.0
    """pbit with quantizer lp: the norm exponent p."""
    levels: int = -1
    """pbit: quantization levels L (values in [-L, L]); -1 = the largest L with P*2L <= 2**bits - 1."""
    clip: float = 2.0
    """pbit: clip ratio of eq. (1)."""
    rounding: str = "nearest"
    """pbit: nearest or stochastic rounding."""
    tie_break: str = "alternate"
    """onebit: how a zero vote sum becomes one bit: alternate (Lion Cub App. B.1), plus, minus."""
    ps_aggregate: str = "vote"
    """ps: vote (majority, Distributed Lion-MaVo) or avg (Distributed Lion-Avg)."""
    ps_topology: str = "naive"
    """ps: naive (gather at rank 0, send back) or tree."""
    node_size: int = 0
    """hierarchical: ranks per node; 0 = LOCAL_WORLD_SIZE from the launcher."""
    mask_zero_updates: bool = False
    """Do not move elements whose local update is exactly zero on every rank (Lion Cub App. B.1)."""
    momentum_sync: MomentumSyncConfig = field(default_factory=MomentumSyncConfig)
    """Selective momentum synchronisation (Lion Cub §5)."""
    timeout_s: float = 600.0
    """Collective timeout in seconds (process group); a hung peer fails the run after this."""


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


@dataclass
class LogConfig:
    wandb: str = "disabled"
    """online, offline (no network; sync later with `wandb sync`) or disabled. online without an API
    key falls back to offline with a warning."""
    project: str = "lioncub"
    """wandb project."""
    run_name: str = ""
    """Run name; empty = the run directory's name."""
    group: str = ""
    """wandb group (compare modes side by side)."""


@dataclass
class DiagConfig:
    every: int = 0
    """Compute Lion Cub diagnostics every N steps (sign match/flip, tie rate, momentum spread); 0 = off.
    They cost extra communication, timed and counted separately."""
    histograms: bool = True
    """Log histograms of the local update per layer type to wandb on diagnostic steps."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    diag: DiagConfig = field(default_factory=DiagConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def dump(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------- docstrings (help text)
def field_docs(cls) -> dict[str, str]:
    """The string literal under each field of a dataclass: its help text."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def describe() -> str:
    lines = []
    for sec in dataclasses.fields(Config):
        lines.append(f"{sec.name}:")
        cls = sec.default_factory().__class__
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            lines.append(f"  {f.name}: {docs.get(f.name, '')}")
    return "\n".join(lines)


# ---------------------------------------------------------------- loading and merging
def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config 'extends' cycle: {' -> '.join(map(str, seen + (path,)))}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
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
            parsed = yaml.safe_load(value) if value != "" else ""
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
    return True


def _build(cls, data: dict, prefix: str, problems: list[str]):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
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


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read YAML (following `extends:`), apply overrides, build and validate the Config."""
    raw = _read_yaml(Path(path)) if path else {}
    raw = _merge(raw, parse_overrides(overrides or []))
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
    cfg = _build(Config, raw, "", problems)
    problems += validate(cfg, world_size=None, raise_error=False)
    if problems:
        raise ConfigError(_format(problems))
    return cfg


def _format(problems: list[str]) -> str:
    return f"{len(problems)} config problem(s):\n" + "\n".join(f"  - {p}" for p in problems)


def _choice(problems, key, value, allowed):
    if value not in allowed:
        problems.append(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")


def pbit_levels(bits: int, world_size: int, levels: int = -1) -> int:
    """Lion Cub p-bit levels: the largest L with P * 2L <= 2**bits - 1 unless set (DESIGN.md)."""
    from comm import max_levels
    from optim.quantize import MAX_LEVELS

    if levels >= 0:
        return levels
    return max(0, min(max_levels(world_size, bits), MAX_LEVELS))  # -1 (not even signs fit) reads as 0


def validate(cfg: Config, world_size: int | None = None, raise_error: bool = True) -> list[str]:
    """Check ranges and combinations. With world_size, also the checks that depend on it."""
    from model import PRESETS  # the trainer sees everything; config validation needs the presets

    p: list[str] = []
    m, d, o, c, t, lg, dg = cfg.model, cfg.data, cfg.optim, cfg.comm, cfg.train, cfg.log, cfg.diag
    _choice(p, "model.preset", m.preset, list(PRESETS))
    _choice(p, "model.pos_emb", m.pos_emb, ["rope", "learned"])
    for key, val, lo in [("data.batch_size", d.batch_size, 1), ("data.seq_len", d.seq_len, 1),
                         ("data.grad_accum", d.grad_accum, 1), ("train.max_steps", t.max_steps, 1),
                         ("train.eval_steps", t.eval_steps, 1), ("train.log_every", t.log_every, 1),
                         ("train.keep_ckpts", t.keep_ckpts, 1), ("model.block_size", m.block_size, 0),
                         ("train.eval_every", t.eval_every, 0), ("train.ckpt_every", t.ckpt_every, 0),
                         ("optim.warmup_steps", o.warmup_steps, 0), ("diag.every", dg.every, 0),
                         ("train.stop_after", t.stop_after, 0),
                         ("comm.node_size", c.node_size, 0)]:
        if val < lo:
            p.append(f"{key}: {val} must be >= {lo}")
    if m.preset in PRESETS:
        block = m.block_size or PRESETS[m.preset].block_size
        if d.seq_len > block:
            p.append(f"data.seq_len: {d.seq_len} exceeds the model's block size {block}; "
                     f"lower data.seq_len or set model.block_size")
    _choice(p, "optim.name", o.name, OPTIMIZER_NAMES)
    _choice(p, "optim.schedule", o.schedule, ["cosine", "constant"])
    if not (o.lr > 0 and math.isfinite(o.lr)):
        p.append(f"optim.lr: {o.lr} must be a positive number")
    if len(o.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas):
        p.append(f"optim.betas: {o.betas} must be two numbers in [0, 1)")
    for key, val in [("optim.weight_decay", o.weight_decay), ("optim.grad_clip", o.grad_clip),
                     ("optim.eps", o.eps), ("optim.embedding_lr_mult", o.embedding_lr_mult),
                     ("optim.head_lr_mult", o.head_lr_mult), ("optim.scalar_lr_mult", o.scalar_lr_mult)]:
        if val < 0:
            p.append(f"{key}: {val} must be >= 0")
    if not 0 <= o.min_lr_ratio <= 1:
        p.append(f"optim.min_lr_ratio: {o.min_lr_ratio} must be in [0, 1]")
    _choice(p, "comm.mode", c.mode, COMM_MODES)
    if c.mode in UPDATE_SYNC_MODES and o.name != "lion":
        p.append(f"comm.mode: {c.mode} is an update-sync mode (each rank keeps its own momentum) and needs "
                 f"optim.name=lion, got optim.name={o.name}; use comm.mode=fp32 or bf16 with {o.name}")
    _choice(p, "comm.bits", c.bits, [1, 2, 4, 8, 16])
    _choice(p, "comm.quantizer", c.quantizer, ["sign", "l0", "l1", "l2", "linf", "lp"])
    _choice(p, "comm.rounding", c.rounding, ["nearest", "stochastic"])
    _choice(p, "comm.tie_break", c.tie_break, ["alternate", "plus", "minus"])
    _choice(p, "comm.ps_aggregate", c.ps_aggregate, ["vote", "avg"])
    _choice(p, "comm.ps_topology", c.ps_topology, ["naive", "tree"])
    if c.levels < -1:
        p.append(f"comm.levels: {c.levels} must be -1 (automatic) or >= 0")
    if c.clip <= 0:
        p.append(f"comm.clip: {c.clip} must be > 0")
    if c.timeout_s <= 0:
        p.append(f"comm.timeout_s: {c.timeout_s} must be > 0")
    ms = c.momentum_sync
    if ms.every < 0 or ms.start < 0 or ms.stop < 0:
        p.append("comm.momentum_sync: every, start and stop must be >= 0")
    if ms.stop and ms.start > ms.stop:
        p.append(f"comm.momentum_sync: start={ms.start} is after stop={ms.stop}; no sync would run")
    if ms.every and not ms.layers:
        p.append("comm.momentum_sync.layers: empty; select layers (e.g. [head]) or set every: 0")
    if c.quantizer == "lp" and not c.p >= 0:
        p.append(f"comm.p: {c.p} must be >= 0 for comm.quantizer=lp (0 = geometric mean, 1 = L1, ...)")
    if c.levels > 127:
        p.append(f"comm.levels: {c.levels} exceeds 127 (votes travel as int8); use -1 (automatic) or <= 127")
    bad = [x for x in ms.layers if x not in LAYER_SELECTORS]
    if bad:
        p.append(f"comm.momentum_sync.layers: {bad} not among {', '.join(LAYER_SELECTORS)}")
    if ms.every and c.mode not in UPDATE_SYNC_MODES:
        p.append(f"comm.momentum_sync.every: {ms.every} but comm.mode={c.mode} already shares one momentum "
                 f"(gradient sync); momentum sync applies to ps/onebit/pbit/hierarchical")
    if ms.every and "head" in ms.layers and m.tie_embeddings is not False and len(ms.layers) == 1:
        p.append("comm.momentum_sync.layers: [head] but the model ties embedding and head (the shared weight "
                 "is the 'embedding' layer); set model.tie_embeddings=false or select embedding")
    _choice(p, "train.resume", t.resume, ["never", "auto", "overwrite"])
    _choice(p, "train.device", t.device, ["auto", "cpu", "cuda"])
    _choice(p, "train.dtype", t.dtype, ["bfloat16", "float32"])
    _choice(p, "log.wandb", lg.wandb, ["online", "offline", "disabled"])
    if not t.out_dir:
        p.append("train.out_dir: empty; name a run directory")
    if world_size is not None:
        p += _world_checks(cfg, world_size)
    if p and raise_error:
        raise ConfigError(_format(p))
    return p


def _world_checks(cfg: Config, world: int) -> list[str]:
    p = []
    c = cfg.comm
    if c.mode == "pbit":
        lanes = 2 ** c.bits - 1
        levels = pbit_levels(c.bits, world, c.levels)
        if levels == 0 and world > lanes:
            better = next((b for b in (2, 4, 8, 16) if 2 ** b - 1 >= world), None)
            p.append(f"comm.bits: {c.bits}-bit sign lanes hold at most {lanes} ranks, world size is {world}; "
                     f"use comm.bits={better}" + (" (Lion Cub uses 8-bit with L1 beyond 15 ranks)" if c.bits == 4 else ""))
        elif levels == 0 and c.quantizer != "sign":
            better = next((b for b in (2, 4, 8, 16) if (2 ** b - 1) // (2 * world) >= 1), None)
            p.append(f"comm.bits: {c.bits}-bit lanes leave no quantization level for comm.quantizer={c.quantizer} "
                     f"at {world} ranks (need P*2L <= {lanes}); use comm.bits={better} or comm.quantizer=sign")
        elif world * 2 * levels > lanes:
            p.append(f"comm.levels: {levels} levels x {world} ranks overflow {c.bits}-bit lanes "
                     f"(P*2L = {world * 2 * levels} > {lanes}); use comm.levels={lanes // (2 * world)} "
                     f"or more bits")
    if c.mode == "hierarchical" and c.node_size and world % c.node_size:
        p.append(f"comm.node_size: {c.node_size} does not divide the world size {world}")
    if cfg.comm.mode == "bf16" and world == 1:
        pass  # legal: the cast still happens, useful for parity checks
    return p
