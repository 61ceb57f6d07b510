"""Evaluate a trained model (run dir, checkpoint dir or Hugging Face export).

    python -m eval val runs/default --data builtin                    # validation loss / perplexity
    python -m eval val exports/m --data data/fineweb10B --batches 50 --seq-len 1024
    python -m eval mc runs/default --file hellaswag_val.jsonl         # multiple-choice accuracy

`val` reads a prepared dataset's val split with the training loader's val iterator
(data.loader.val_batches; token ids range-checked against the model's vocabulary) and reports the
mean next-token cross-entropy and its exponential, the perplexity. `--order` picks which val
batches `--batches N` reads, as `data.order` does for the trainer's evaluation: `sequential`, the
split's first N batches; `shuffled`, windows spread evenly over the whole split; `run` (the
default), the order the run itself was evaluated with (its config's `data.order`; sequential for
a Hugging Face export, which keeps no run config), so a run's own val loss is what this repeats.

`mc` scores multiple-choice items by completion log-likelihood, the way HellaSwag is evaluated
(Zellers et al., 2019; lm-evaluation-harness, llm.c): for each item the context is followed by
each ending (" " + ending), and the model's log-probability of the ending's tokens given the
context is summed. Three accuracies:
- acc: the ending with the largest summed log-likelihood;
- acc_norm: the largest log-likelihood per UTF-8 byte of the ending (lm-evaluation-harness's
  acc_norm divides by the ending's length in characters: the same for ASCII text);
- acc_per_token: the largest mean log-likelihood per ending token (what llm.c reports as acc_norm).
Items are JSON lines with `ctx`, `endings` (a list) and `label` (the index of the right ending),
or HellaSwag's own `ctx_a` / `ctx_b` instead of `ctx` (ctx = ctx_a + " " + ctx_b.capitalize(), as
the dataset defines it). HellaSwag's validation set is hellaswag_val.jsonl (10,042 items) in the
data/ folder of the authors' GitHub repository rowanz/hellaswag; nothing is downloaded here. The
context is used as given (llm.c's setup); lm-evaluation-harness's hellaswag task also prefixes the
activity label and strips "[title]"-style artifacts, so its numbers differ slightly.

The trainer calls `load_mc_file` once and `multiple_choice(model, items, encode, device, rank=,
world_size=)` at eval steps; each rank scores items[rank::world_size] and returns counts to sum.
"""
from __future__ import annotations

import json
import sys

# the logic lives in trainer/scoring.py (the trainer's evaluation calls it too); this is the command
from trainer.scoring import (MCFormatError, MCItem, NonFiniteResult, ending_logprobs, item_from,  # noqa: F401
                             load_mc_file, mean_batch_loss, multiple_choice, val_loss)
from util.cli import Parser

_item_from = item_from  # the name tests/model/test_eval.py and older callers use


def main(argv: list[str] | None = None) -> int:
    from data import DataError, resolve_dataset
    from data.loader import ORDERS, tokenizer_identity
    from trainer.sampling import load

    p = Parser(prog="python -m eval", description=__doc__.split("\n\n")[0], epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("val", help="validation loss and perplexity on a prepared dataset")
    v.add_argument("src", metavar="RUN_DIR_OR_EXPORT")
    v.add_argument("--data", default=None, help="data.prepare output dir, or builtin (default: the run's "
                                                  "data.dataset; an export records none)")
    v.add_argument("--batch-size", type=int, default=8)
    v.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: the model's block size)")
    v.add_argument("--batches", type=int, default=0, help="evaluate N batches (default: all)")
    v.add_argument("--order", choices=("run",) + ORDERS, default="run",
                   help="which N batches: the split's first (sequential), windows spread over the whole split "
                        "(shuffled), or as the run's data.order (run, the default; sequential for an HF export)")
    m = sub.add_parser("mc", help="multiple-choice accuracy (HellaSwag format) by completion log-likelihood")
    m.add_argument("src", metavar="RUN_DIR_OR_EXPORT")
    m.add_argument("--file", required=True, help="JSONL with ctx (or ctx_a/ctx_b), endings, label")
    m.add_argument("--limit", type=int, default=None, help="only the first N items")
    m.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    for sp in (v, m):
        sp.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
        sp.add_argument("--tokenizer", default=None, help="tokenizer name (default: the run dataset's / the export's)")
        sp.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        model, codec, loaded = load(args.src, args.device, tokenizer=args.tokenizer)
        device = model.transformer.wte.weight.device
        if args.cmd == "val":
            seq_len = args.seq_len or model.config.block_size
            order = args.order
            if order == "run":
                order = ((loaded.run_config or {}).get("data") or {}).get("order", "sequential")
            ran_on = ((loaded.run_config or {}).get("data") or {}).get("dataset")
            if not (args.data or ran_on):
                raise ValueError(f"{args.src} records no dataset (an export); give --data DIR (a data.prepare output "
                                 f"dir, or builtin)")
            data_dir = resolve_dataset(args.data or ran_on)
            if ran_on and args.data and args.data != ran_on:  # another dataset: made with the model's tokenizer?
                try:
                    theirs = tokenizer_identity(resolve_dataset(ran_on))
                except DataError:
                    theirs = None  # the run's dataset is not on this machine: nothing to compare with
                mine = tokenizer_identity(data_dir)
                if mine and theirs and mine != theirs:
                    raise ValueError(f"--data {args.data} was prepared with tokenizer {mine[0]} ({mine[2]} ids"
                                     f"{', sha256 ' + mine[1][:12] if mine[1] else ''}), the model's run with "
                                     f"{theirs[0]} ({theirs[2]} ids{', sha256 ' + theirs[1][:12] if theirs[1] else ''}"
                                     f"): its loss would mean nothing; give data prepared with the run's tokenizer")
            res = val_loss(model, data_dir, args.batch_size, seq_len, args.batches or None, device, order=order)
            res["order"] = order
            text = (f"val loss {res['loss']:.4f} | ppl {res['ppl']:.2f} | {res['batches']} batches x "
                    f"{args.batch_size} x {seq_len} = {res['tokens']:,} tokens ({order})")
        else:
            items = load_mc_file(args.file, args.limit)
            res = multiple_choice(model, items, codec.encode, device, args.batch_size)
            text = (f"{res['n']} items | acc {res['acc']:.4f} | acc_norm {res['acc_norm']:.4f} (per byte) | "
                    f"acc_per_token {res['acc_per_token']:.4f}")
    except (FileNotFoundError, DataError, ValueError) as e:
        print(f"eval: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"source": str(loaded.weights), **res}) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
