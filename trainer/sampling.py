"""Sampling from a trained model: loading it with its tokenizer (`load`: a run, checkpoint or
Hugging Face directory, model.load.load_model; the run dataset's tokenizer or the export's own),
and drawing continuations (`generate_ids`: KV cache, temperature, top-k, top-p, stop at
<|endoftext|>), refusing non-finite logits in one line. The command line is sample.py (its
docstring says how decoding works); eval.py loads its model through `load` too."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model import GPT, Loaded, load_model


@dataclass
class TextCodec:
    """The tokenizer of a model, whatever it came from."""
    name: str
    n_vocab: int
    eot: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def tiktoken_codec(name: str) -> TextCodec:
    from data.tokenizer import eot_id, get_encoding

    enc = get_encoding(name)
    return TextCodec(name, enc.n_vocab, eot_id(enc), enc.encode_ordinary,
                     lambda ids: enc.decode(list(ids), errors="replace"))


def load_codec(loaded: Loaded) -> TextCodec:
    """The tokenizer of a loaded model: the run dataset's (manifest.json, GPT-2 if unknown), or an
    HF directory's (ours name the tiktoken encoding in tokenizer_config.json; any other goes
    through AutoTokenizer, offline)."""
    if loaded.kind == "hf":
        cfg_path = Path(loaded.weights) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        if cfg.get("lioncub_tokenizer"):
            return tiktoken_codec(cfg["lioncub_tokenizer"])
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError(f"{loaded.weights} has a tokenizer of its own, read with transformers, which is not "
                             f"installed: pip install -e '.[hf]' (or pass --tokenizer NAME)") from None

        tok = AutoTokenizer.from_pretrained(str(loaded.weights), local_files_only=True)
        eot = tok.eos_token_id if tok.eos_token_id is not None else 0
        return TextCodec(str(loaded.weights), len(tok), eot, lambda s: tok.encode(s, add_special_tokens=False),
                         lambda ids: tok.decode(list(ids)))
    codec = tiktoken_codec(run_tokenizer(loaded.run_config))
    check_vocab(codec.name, codec.n_vocab, loaded.model.config.vocab_size)
    return codec


def run_tokenizer(run_config: dict | None) -> str:
    """The tokenizer a run's dataset was prepared with (manifest.json); GPT-2 for the built-in
    corpus, and when the dataset is not on this machine."""
    from data import dataset_tokenizer

    return dataset_tokenizer(((run_config or {}).get("data") or {}).get("dataset", "builtin"))


def check_vocab(tokenizer: str, n_vocab: int, model_vocab: int) -> None:
    """A run's model vocabulary is its tokenizer's padded to a multiple of 64; anything else means
    the tokenizer guessed for it is not the one it was trained with."""
    from model import pad_vocab

    if pad_vocab(n_vocab) != model_vocab:
        raise ValueError(f"the model's vocabulary ({model_vocab}) does not belong to tokenizer {tokenizer} "
                         f"({n_vocab} ids, padded {pad_vocab(n_vocab)}); the run's dataset (and its manifest) "
                         f"is not on this machine — pass the tokenizer it was prepared with (--tokenizer)")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}, but torch {torch.__version__} sees no CUDA device; use --device cpu")
    return torch.device(device)


def load(src: str | Path, device: str = "auto", dtype: str | None = None,
         tokenizer: str | None = None) -> tuple[GPT, TextCodec, Loaded]:
    """(model in eval mode on `device`, its tokenizer, where it came from). `tokenizer` overrides
    the one found for it (a data.tokenizer name)."""
    dev = resolve_device(device)
    loaded = load_model(src, device=dev)
    if dtype:
        loaded.model.to(dtype={"float32": torch.float32, "bfloat16": torch.bfloat16,
                               "float16": torch.float16}[dtype])
    codec = tiktoken_codec(tokenizer) if tokenizer else load_codec(loaded)
    return loaded.model, codec, loaded


def check_logits(logits: torch.Tensor, what: str) -> None:
    """ValueError (one line) when `logits` hold NaN or inf: no token can be drawn from them."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"the model's logits for {what} are not finite (NaN or inf): no token can be sampled; the "
                         f"model is damaged, or overflows in this precision (try --dtype float32)")


def generate_ids(model: GPT, codec: TextCodec, prompt: str, *, max_new_tokens: int = 200,
                 temperature: float = 0.8, top_k: int | None = 200, seed: int = 1337, num_samples: int = 1,
                 use_cache: bool = True, stop: bool = True, top_p: float | None = None) -> list[list[int]]:
    """New token ids for each of `num_samples` continuations of `prompt` (reproducible per seed)."""
    device = model.transformer.wte.weight.device
    ids = codec.encode(prompt) or [codec.eot]
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():  # greedy decoding would turn NaN logits into token 0 without a word
        check_logits(model.logits(idx[:1, -model.config.block_size:]), "the prompt")
    try:
        out = model.generate(idx, max_new_tokens, temperature, top_k, use_cache=use_cache, generator=gen,
                             stop_token=codec.eot if stop else None,
                             vocab_limit=min(codec.n_vocab, model.config.vocab_size), top_p=top_p)
    except RuntimeError as e:  # torch.multinomial on a later step's NaN / inf probabilities
        if "inf" in str(e) or "nan" in str(e):
            raise ValueError(f"the model's logits became non-finite while sampling ({str(e).splitlines()[0]}); "
                             f"the model is damaged, or overflows in this precision (try --dtype float32)") from None
        raise
    rows = []
    for row in out[:, len(ids):].tolist():
        if stop and codec.eot in row:
            row = row[:row.index(codec.eot)]
        rows.append(row)
    return rows


__all__ = ["TextCodec", "check_logits", "check_vocab", "generate_ids", "load", "load_codec", "resolve_device",
           "run_tokenizer", "tiktoken_codec"]
