"""Config validation: ranges, choices and the cross-section rules, every problem collected into one
ConfigError naming the key and the fix."""
from __future__ import annotations

import math
from pathlib import Path

from data.loader import ORDERS as DATA_ORDERS
from optim import sync
from optim.options import at_least, choice
from optim.registry import optimizer_names, plan_problems

from .config_files import read_yaml
from .config_schema import AUTO_MODE, LAYER_SELECTORS, VARIANTS_DIR, Config, ConfigError, OptimConfig
from .schedule import DECAY_SHAPES, SCHEDULES, decay_steps


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


def auto_variants(optim_name: str) -> dict[str, str]:
    """{variant: its comm.mode} of the configs/variants files comm.mode=auto may pick for `optim_name`:
    that optimizer (optim.name, default lion), no comm.momentum_sync schedule (trainer.automode.candidates
    reads the same files by the same rule)."""
    out = {}
    for path in sorted(VARIANTS_DIR.glob("*.yaml")):
        doc = read_yaml(path)  # its extends: chain resolved, as advise.load_variant reads it
        o, c = doc.get("optim") or {}, doc.get("comm") or {}
        if o.get("name", "lion") == optim_name and not (c.get("momentum_sync") or {}).get("every"):
            out[path.stem] = c.get("mode", "fp32")
    return out


def _blocks(m) -> int | None:
    """The model's transformer blocks (its resolved n_layer), or None where the config alone cannot say: an
    unknown preset or shape (reported elsewhere), or model.init_from (the starting point's own shape)."""
    from model import PRESETS, resolve_config

    if m.init_from or m.preset not in PRESETS:
        return None
    try:
        return int(resolve_config(m).n_layer)
    except (ValueError, TypeError):
        return None


def _format(problems: list[str]) -> str:
    return f"{len(problems)} config problem(s):\n" + "\n".join(f"  - {p}" for p in problems)


def _parallel_problems(cfg: Config, world_size: int | None, node_size: int | None = None) -> list[str]:
    """parallel.shard_size: >= 1, divides the world size and (given) the ranks per node, as
    trainer.parallel.make_mesh demands inside the ranks, and what the trainer cannot do on shards
    (whether the optimizer and comm.mode run on shards is theirs to say: optim.registry.run_problems)."""
    S = cfg.parallel.shard_size
    if S < 1:
        return [f"parallel.shard_size: {S} must be >= 1 (1 = replicated)"]
    p = []
    if world_size is not None and world_size % S:
        p.append(f"parallel.shard_size: {S} does not divide the world size {world_size}; choose a divisor "
                 f"(the ranks per node, typically)")
    elif node_size is not None and node_size % S:
        p.append(f"parallel.shard_size: {S} does not divide the ranks per node ({node_size}); a shard group must "
                 f"share a node's fast links: choose a divisor of {node_size}")
    if S > 1 and cfg.train.mc_eval_file:
        p.append(f"train.mc_eval_file: set with parallel.shard_size={S}; each rank scores its own items, so the ranks "
                 f"of a shard group would run different forwards; leave train.mc_eval_file empty (score the "
                 f"checkpoint with `python -m eval mc`)")
    if S > 1 and cfg.comm.bucket_mb:
        p.append(f"comm.bucket_mb: {cfg.comm.bucket_mb} with parallel.shard_size={S}: FSDP already overlaps its "
                 f"reduce-scatter with backward; set comm.bucket_mb=0 and comm.overlap=false")
    return p


def allowed_variants(cfg: Config) -> dict[str, str]:
    """{variant: comm.mode} of the variants comm.mode=auto chooses among for cfg: its optimizer's
    (auto_variants) whose mode or name comm.auto_allow lists (trainer.automode.candidates builds them)."""
    allow = cfg.comm.auto_allow if isinstance(cfg.comm.auto_allow, list) else []
    return {n: m for n, m in auto_variants(cfg.optim.name).items() if m in allow or n in allow}


def elastic_problems(cfg: Config) -> list[str]:
    """Why a run of cfg could not continue on another world size after a restart (a launcher that lets
    the world shrink: train.sbatch's MIN_NODES below its node count, torchrun's --nnodes=MIN:MAX), []
    when it could: a comm.mode whose exchange keeps per-rank state sized for the saved world (error
    feedback, DiLoCo's outer state: the registry's `stateful`) is refused on resume (optim.base
    load_resharded, the remesh path), so every restart on fewer ranks would fail. comm.mode=auto: any
    of the modes it may pick (allowed_variants), since its pick is kept for the run's restarts. Unknown
    modes are validate()'s to report."""
    auto = cfg.comm.mode == AUTO_MODE
    modes = list(allowed_variants(cfg).values()) if auto else [cfg.comm.mode]
    bad = sorted({m for m in modes if m in sync.names() and sync.get(m).stateful})
    if not bad:
        return []
    what = (f"comm.mode=auto may pick {', '.join(bad)} (comm.auto_allow), which "
            f"{'keeps' if len(bad) == 1 else 'keep'}" if auto else f"comm.mode={bad[0]} keeps")
    return [f"{what} per-rank exchange state sized for the world it was saved on (error feedback, or DiLoCo's "
            f"outer state), so a restart on fewer ranks could not resume it; keep the world size fixed "
            f"(launch/slurm/train.sbatch: MIN_NODES = the job's node count, its default; torchrun: --nnodes=N, "
            f"not a range) or choose a mode without such state" + (" in comm.auto_allow" if auto else "")]


def validate(cfg: Config, world_size: int | None = None, raise_error: bool = True,
             node_size: int | None = None) -> list[str]:
    """Check ranges and combinations. With world_size, also the checks that depend on it; with node_size
    (the ranks per node, known to a launcher before any rank starts), that a shard group fits a node."""
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
    elif c.mode == AUTO_MODE and o.name in optimizer_names():
        # auto chooses among the variant files of this optimizer (trainer.automode.candidates' rule)
        mine = auto_variants(o.name)
        if not mine:
            p.append(f"comm.mode=auto: configs/variants holds no variant of optim.name={o.name} to choose among; "
                     f"set comm.mode yourself")
        elif not allowed_variants(cfg):
            p.append(f"comm.auto_allow: no variant of optim.name={o.name} runs on {c.auto_allow}; allow one of "
                     f"{', '.join(sorted(set(mine.values())))} (its variants: {', '.join(sorted(mine))})")
    if c.auto_min_gain < 0 or not math.isfinite(c.auto_min_gain):
        p.append(f"comm.auto_min_gain: {c.auto_min_gain} must be a finite fraction >= 0 (0.10: 10 % faster)")
    if c.mode == AUTO_MODE and cfg.parallel.shard_size > 1:  # trainer.advise predicts replicated runs only
        p.append(f"comm.mode=auto with parallel.shard_size={cfg.parallel.shard_size}: the advisor measures and "
                 f"predicts replicated runs only; pick comm.mode yourself (python -m bench.advise on the "
                 f"replicated config ranks the modes) or set parallel.shard_size=1")
    S = cfg.parallel.shard_size
    replicas = world_size // S if world_size is not None and S >= 1 and world_size % S == 0 else world_size
    ms = c.momentum_sync
    # the run's optimizer plan, checked by the function that builds it (optim.registry.resolve's
    # problems-only twin): the entry and the mode, their options at the replica count, the common
    # optim.* keys, momentum sync's schedule, comm.kernels; comm.mode=auto is checked once resolved.
    # An unknown optim.name or comm.mode is reported above, so the plan is asked without it.
    mode = c.mode if c.mode in sync.names() and c.options is not None else None
    p += plan_problems(o.name if o.name in optimizer_names() else None, comm_mode=mode, comm_options=c.options,
                       optim_options=o.options, betas=o.betas, eps=o.eps, lr=o.lr, weight_decay=o.weight_decay,
                       grad_clip=o.grad_clip, momentum_sync=vars(ms), world_size=replicas, shard_size=max(S, 1),
                       bucket_mb=c.bucket_mb, overlap=c.overlap, kernels=c.kernels)
    blocks = _blocks(m)
    if c.options is not None:
        p += c.options.run_problems(t.max_steps, blocks=blocks)
    if o.options is not None:
        p += o.options.run_problems(t.max_steps, blocks=blocks)
    if c.timeout_s <= 0 or c.init_timeout_s <= 0:
        p.append(f"comm.timeout_s: {c.timeout_s}, comm.init_timeout_s: {c.init_timeout_s}; both must be > 0")
    bad = [x for x in ms.layers if x not in LAYER_SELECTORS]
    if bad:
        p.append(f"comm.momentum_sync.layers: {bad} not among {', '.join(LAYER_SELECTORS)}")
    if ms.every and "head" in ms.layers and m.tie_embeddings is not False and len(ms.layers) == 1:
        p.append("comm.momentum_sync.layers: [head] but the model ties embedding and head (the shared weight "
                 "is the 'embedding' layer); set model.tie_embeddings=false or select embedding")
    p += _parallel_problems(cfg, world_size, node_size)
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
