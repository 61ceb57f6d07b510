"""Sample text from a trained model: a run dir, a checkpoint dir or a Hugging Face export.

    python -m sample runs/default --prompt "The meaning of" --max-new-tokens 100
    python -m sample exports/gpt2-124m --prompt "def f(x):" --temperature 0 --device cuda
    python -m sample runs/default/ckpt/step_000300 --prompt "" --num-samples 3 --seed 7

Decoding uses the model's KV cache (model/gpt.py: one new position per token); --no-cache runs
the whole context every token (the reference the tests compare against). --temperature 0 is
greedy; --top-k and --top-p (nucleus sampling) restrict the draw. The tokenizer is the one the
run's dataset was prepared with (manifest.json; GPT-2 for the built-in corpus), or the export's
own tokenizer files. Sampling stops at <|endoftext|>
(--no-stop to go on), and never picks the padded ids past the tokenizer's vocabulary. An empty
prompt starts from <|endoftext|>, i.e. from the beginning of a document.
"""
from __future__ import annotations

import argparse
import json
import sys
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


def _tiktoken_codec(name: str) -> TextCodec:
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
            return _tiktoken_codec(cfg["lioncub_tokenizer"])
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError(f"{loaded.weights} has a tokenizer of its own, read with transformers, which is not "
                             f"installed: pip install -e '.[hf]' (or pass --tokenizer NAME)") from None

        tok = AutoTokenizer.from_pretrained(str(loaded.weights), local_files_only=True)
        eot = tok.eos_token_id if tok.eos_token_id is not None else 0
        return TextCodec(str(loaded.weights), len(tok), eot, lambda s: tok.encode(s, add_special_tokens=False),
                         lambda ids: tok.decode(list(ids)))
    codec = _tiktoken_codec(run_tokenizer(loaded.run_config))
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
    codec = _tiktoken_codec(tokenizer) if tokenizer else load_codec(loaded)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sample", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("src", metavar="RUN_DIR_OR_EXPORT", help="run dir, RUN/ckpt/step_NNNNNN, or an HF export dir")
    p.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the most likely tokens up to this total probability (default 1 = all)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="compute precision (default: as stored)")
    p.add_argument("--tokenizer", default=None, help="tokenizer name (default: the run dataset's / the export's)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context every token")
    p.add_argument("--no-stop", action="store_true", help="keep going past <|endoftext|>")
    args = p.parse_args(argv)
    if args.max_new_tokens < 0 or args.num_samples < 1:
        p.error("--max-new-tokens must be >= 0 and --num-samples >= 1")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p {args.top_p}: must be in (0, 1] (1 keeps every token)")
    try:
        model, codec, _ = load(args.src, args.device, args.dtype, args.tokenizer)
    except (FileNotFoundError, ValueError) as e:
        print(f"sample: error: {e}", file=sys.stderr)
        return 2
    try:
        rows = generate_ids(model, codec, args.prompt, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_k=args.top_k or None, seed=args.seed,
                            num_samples=args.num_samples, use_cache=not args.no_cache, stop=not args.no_stop,
                            top_p=args.top_p)
    except ValueError as e:
        print(f"sample: error: {e}", file=sys.stderr)
        return 2
    for i, row in enumerate(rows):
        if i:
            print("\n---------------")
        print(args.prompt + codec.decode(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
