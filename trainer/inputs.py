"""What a run starts from: its datasets (data.dataset, data.mix: rank 0 resolves and prepares them,
the others wait and read its answer), the loader over them, and its initial model (seeded, or the
weights of model.init_from).
Everything here can fail on bad config or data, so the trainer calls it before the run directory is
touched."""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

import data
from data.loader import MixLoader, ShardLoader, tokenizer_identity
import torch

from model import GPT, PRESETS, GPTConfig, load_model, pad_vocab, resolve_config
from model.presets import SHAPE_KEYS, SWITCH_KEYS

from .config import Config, ConfigError
from .dist import DistInfo


def _from_rank0(value, info: DistInfo):
    """Rank 0's `value` on every rank (collective when there are several)."""
    if info.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def resolve_data(cfg: Config, info: DistInfo) -> tuple[Path, dict[str, Path] | None]:
    """(the directory of data.dataset, data.mix's sources by name or None). Rank 0 prepares the
    built-in corpus once; the others wait for it. The mix's sources must share the dataset's
    vocabulary (the validation set is data.dataset's)."""
    cache = cfg.data.cache_dir or None
    data_dir = data.resolve_dataset(cfg.data.dataset, cache) if info.is_main else None
    data_dir = Path(_from_rank0(str(data_dir) if data_dir else None, info))
    if not cfg.data.mix:
        return data_dir, None
    names = list(cfg.data.mix)
    dirs = [str(data.resolve_dataset(n, cache)) for n in names] if info.is_main else None
    mix = {n: Path(p) for n, p in zip(names, _from_rank0(dirs, info))}
    want = data.dataset_vocab_size(data_dir)
    other = {n: data.dataset_vocab_size(p) for n, p in mix.items() if data.dataset_vocab_size(p) != want}
    if other:
        raise ConfigError(f"data.mix: {other} have another vocabulary than data.dataset={cfg.data.dataset} ({want}); "
                          f"mix datasets prepared with one tokenizer")
    # one size, another tokenizer (two tokenizer.json files of 8192 ids): the manifests tell them apart
    ident = tokenizer_identity(data_dir)
    differ = [n for n, p in mix.items() if ident and (t := tokenizer_identity(p)) and t != ident]
    if differ:
        raise ConfigError(f"data.mix: {differ} were prepared with another tokenizer than data.dataset="
                          f"{cfg.data.dataset} (same vocabulary size, other manifest tokenizer: "
                          f"{tokenizer_identity(mix[differ[0]])[:2]} against {ident[:2]}); mix datasets prepared "
                          f"with one tokenizer")
    return data_dir, mix


def train_loader(cfg: Config, info: DistInfo, data_dir: Path, mix_dirs: dict[str, Path] | None, vocab_size: int):
    """This rank's loader of training batches: over data.mix's sources when set, else data.dataset."""
    d = cfg.data
    if mix_dirs:
        return MixLoader([(name, mix_dirs[name], w) for name, w in d.mix.items()], "train", d.batch_size,
                         d.seq_len, info.rank, info.world_size, cfg.train.seed, vocab_size=vocab_size, order=d.order)
    return ShardLoader(data_dir, "train", d.batch_size, d.seq_len, info.rank, info.world_size, cfg.train.seed,
                       vocab_size=vocab_size, order=d.order)


def init_source(cfg: Config, vocab_size: int | None):
    """The model of model.init_from (model.load_model: run, checkpoint or HF Llama directory), after
    filling cfg.model's architecture keys from it; a key set to something else, or a vocabulary that
    is not the dataset tokenizer's, is a ConfigError."""
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
    defaults = type(m)()
    for key in SWITCH_KEYS:  # unset (None or the schema's default) keeps the preset's: here the source's
        mine = getattr(m, key)
        if mine not in (None, getattr(defaults, key)) and mine != getattr(src, key):
            problems.append(f"model.{key}: {mine}, but model.init_from has {getattr(src, key)}; remove model.{key} "
                            "(the architecture is the source's)")
        setattr(m, key, getattr(src, key))
    if cfg.data.seq_len > src.block_size:
        problems.append(f"data.seq_len: {cfg.data.seq_len} exceeds model.init_from's block size {src.block_size}")
    if problems:
        raise ConfigError("\n".join(problems))
    return loaded


def initial_model(cfg: Config, vocab_size: int, source, device: torch.device) -> tuple[GPTConfig, GPT]:
    """(the model's config, the model on `device`): initialised from train.seed, the same on every
    rank, then given `source`'s weights when model.init_from set one (init_source)."""
    torch.manual_seed(cfg.train.seed)  # same init on every rank
    model_config = resolve_config(vars(cfg.model), vocab_size=vocab_size)
    model = GPT(model_config).to(device)
    if source is not None:
        model.load_state_dict(source.model.state_dict())  # cast to the model's dtype, exact in fp32
    model.activation_checkpointing = cfg.model.activation_checkpointing
    return model_config, model


__all__ = ["init_source", "initial_model", "resolve_data", "train_loader"]
