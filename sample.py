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

import sys

# the logic lives in trainer/sampling.py (eval.py loads models through it too); this is the command
from trainer.sampling import (TextCodec, check_logits, check_vocab, generate_ids, load, load_codec,  # noqa: F401
                              resolve_device, run_tokenizer, tiktoken_codec)
from util.cli import Parser

_tiktoken_codec = tiktoken_codec  # the name older callers use


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m sample", description=__doc__.split("\n\n")[0], epilog=__doc__)
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
    if not args.temperature >= 0:  # also NaN
        p.error(f"--temperature {args.temperature}: must be >= 0 (0 = greedy)")
    if args.top_k < 0:
        p.error(f"--top-k {args.top_k}: must be >= 0 (0 = no top-k)")
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
