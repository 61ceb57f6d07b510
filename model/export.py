"""Export a trained run as a Hugging Face LlamaForCausalLM directory.

    python -m model.export RUN_DIR_OR_CKPT --out DIR [--dtype float32|bfloat16|float16] [--tokenizer NAME]

RUN_DIR_OR_CKPT is a run directory (train.out_dir: config.yaml + the checkpoint ckpt/latest
names) or one checkpoint directory (RUN/ckpt/step_NNNNNN). DIR receives config.json,
generation_config.json, model.safetensors (sharded past 4 GiB), the tokenizer files (<|endoftext|>
also pads, on the left) and README.md (a model card: architecture, tokens trained, optimizer and
mode, final val loss, how to load it), all readable by others (0644 under umask 022), so that

    AutoModelForCausalLM.from_pretrained(DIR); AutoTokenizer.from_pretrained(DIR)

work offline, and `lm_eval --model hf --model_args pretrained=DIR` evaluates it. The tokenizer
is the one the run's dataset was prepared with (its manifest.json; GPT-2 for the built-in corpus
or when the dataset is not on this machine), or --tokenizer. The weight mapping is model/hf.py's.
Ids past the tokenizer's vocabulary (the padding up to a multiple of 64) are listed in
generation_config.json's suppress_tokens, so `generate` never emits an undecodable id.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from util import replace_dir
from util.cli import Parser

from .hf import DTYPES, HFFormatError, save_hf
from .load import load_model
from .presets import pad_vocab

EXPORT_FILES = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json",
                "README.md"}


def _trained_on(data: dict) -> str:
    """The training data in a card's words: data.dataset, or a data.mix's sources with their shares and the
    validation set (data.dataset)."""
    mix = data.get("mix") or {}
    if not mix:
        return str(data.get("dataset", "builtin"))
    total = sum(float(w) for w in mix.values()) or 1.0
    parts = ", ".join(f"{src} ({100 * float(w) / total:.0f} %)" for src, w in mix.items())
    return f"a mix of {parts}; validated on {data.get('dataset', 'builtin')}"


def run_facts(loaded) -> dict:
    """What the checkpoint's run says about its training, for the model card: step, tokens trained
    (recorded in meta.json; older checkpoints: step x tokens per step, marked approximate), optimizer,
    comm mode, world size, dataset (a data.mix: its sources and weights, validated on data.dataset) and the
    val loss of the last evaluation at or before the step."""
    import json

    ckpt = Path(loaded.weights).parent
    meta = json.loads((ckpt / "meta.json").read_text()) if (ckpt / "meta.json").is_file() else {}
    cfg = meta.get("config") or loaded.run_config or {}  # the checkpoint's own config first
    step = loaded.step if loaded.step is not None else meta.get("step")
    facts = {"step": step, "world_size": meta.get("world_size"), "optim": cfg.get("optim") or {},
             "comm": cfg.get("comm") or {}, "dataset": _trained_on(cfg.get("data") or {}),
             "tokens": meta.get("tokens_seen"), "tokens_exact": "tokens_seen" in meta, "val_loss": None}
    d = cfg.get("data") or {}
    if facts["tokens"] is None and step is not None and meta.get("world_size") and d.get("batch_size"):
        facts["tokens"] = step * d["batch_size"] * d.get("seq_len", 0) * d.get("grad_accum", 1) * meta["world_size"]
    metrics = ckpt.parent.parent / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash: the others still count
            if rec.get("val_loss") is not None and (step is None or rec.get("step", 0) <= step):
                facts["val_loss"], facts["val_step"] = rec["val_loss"], rec.get("step")
    return facts


def model_card(model, facts: dict, tokenizer: str, name: str) -> str:
    """README.md of an export: architecture, training, final val loss, how to load and evaluate it."""
    c = model.config
    kv = getattr(c, "n_kv_head", c.n_head)
    o, m = facts["optim"], facts["comm"]
    tokens = (f"{facts['tokens']:,}" + ("" if facts["tokens_exact"] else " (step x tokens per step)")
              if facts["tokens"] is not None else "not recorded")
    val = (f"{facts['val_loss']:.4f} (step {facts['val_step']})" if facts["val_loss"] is not None
           else "not recorded (no val_loss in the run's metrics.jsonl)")
    rows = [
        ("architecture", f"LlamaForCausalLM (GPT-2++: RMSNorm, SwiGLU, RoPE, no biases): {c.n_layer} layers, "
                         f"width {c.n_embd}, {c.n_head} heads ({kv} key/value heads), MLP hidden {c.mlp_hidden}, "
                         f"context {c.block_size}, vocabulary {c.vocab_size}, "
                         f"{'tied' if c.tie_embeddings else 'untied'} embedding and head"),
        ("parameters", f"{model.num_params():,}"),
        ("tokenizer", f"{tokenizer} (`<|endoftext|>` is bos, eos and pad; ids past the tokenizer's are suppressed)"),
        ("trained", f"{facts['step']} steps, {tokens} tokens, on {facts['dataset']}"),
        ("optimizer", f"{o.get('name', '?')} (lr {o.get('lr', '?')}, {o.get('schedule', '?')} schedule), comm.mode "
                      f"{m.get('mode', '?')}, {facts['world_size'] or '?'} rank(s)"),
        ("final val loss", val),
    ]
    table = "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [llama, lioncub-train]
---
# {name}

A GPT-2++ trained with lioncub-train and exported by `python -m model.export`.

{table}

## Load

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")
batch = tokenizer(["The meaning of", "Once"], return_tensors="pt", padding=True)
print(tokenizer.batch_decode(model.generate(**batch, max_new_tokens=20, do_sample=False)))
```

Or with lioncub-train: `python -m sample {name} --prompt "The meaning of"`; to train on from these
weights, `model.init_from={name}`.

## Evaluate

```bash
pip install "lm-eval[hf]"   # the harness with transformers, accelerate and peft
lm_eval --model hf --model_args pretrained={name},dtype=float32 --tasks hellaswag --batch_size 16
```
"""


def _is_our_export(d: Path) -> bool:
    return (d / "config.json").is_file() and all(
        p.name in EXPORT_FILES or (p.name.startswith("model-") and p.name.endswith(".safetensors"))
        for p in d.iterdir())


def export(src: str | Path, out: str | Path, *, dtype: str | None = None, tokenizer: str | None = None,
           overwrite: bool = False) -> dict:
    """Export run/checkpoint `src` to the HF directory `out`; returns a summary dict."""
    # The CLI joins the model and its tokenizer: the one place model/ reaches into data/ (lazily).
    from data import dataset_tokenizer
    from data.hf_tokenizer import write_hf_tokenizer
    from data.tokenizer import eot_id, get_encoding

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise FileExistsError(f"--out {out} exists and is not empty; pass --overwrite to replace an earlier "
                                  f"export, or pick another directory")
        if not out.is_dir() or not _is_our_export(out):
            raise FileExistsError(f"--overwrite refuses to replace {out}: it is not a directory written by "
                                  f"model.export (config.json, safetensors and tokenizer files only); nothing "
                                  f"was deleted")
    loaded = load_model(src)
    if loaded.kind == "hf":
        raise HFFormatError(f"{src} is already a Hugging Face directory; copy it instead")
    model = loaded.model
    if tokenizer is None:  # the dataset's (GPT-2 when its manifest is not on this machine)
        tokenizer = dataset_tokenizer(((loaded.run_config or {}).get("data") or {}).get("dataset", "builtin"))
    enc = get_encoding(tokenizer)
    if pad_vocab(enc.n_vocab) != model.config.vocab_size:  # the trainer sizes the model from its tokenizer
        raise HFFormatError(f"the model's vocabulary ({model.config.vocab_size}) does not belong to tokenizer "
                            f"{tokenizer} ({enc.n_vocab} ids, padded {pad_vocab(enc.n_vocab)}); pass the "
                            f"--tokenizer the run's dataset was prepared with")
    eot = eot_id(enc)
    suppress = list(range(enc.n_vocab, model.config.vocab_size))
    tmp = out.with_name(f".{out.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model, tmp, bos_token_id=eot, eos_token_id=eot, dtype=dtype,
            generation={"suppress_tokens": suppress} if suppress else None)
    write_hf_tokenizer(tmp, tokenizer, model_max_length=model.config.block_size)
    (tmp / "README.md").write_text(model_card(model, run_facts(loaded), tokenizer, str(out)))
    mode = 0o666 & ~_umask()  # safetensors writes 0600; an export is meant to be read by others
    for f in tmp.iterdir():
        f.chmod(mode)
    replace_dir(tmp, out)  # checked above: absent, or an export of ours with --overwrite
    return {"source": str(loaded.weights), "step": loaded.step, "out": str(out), "tokenizer": tokenizer,
            "params": model.num_params(), "vocab_size": model.config.vocab_size, "tokenizer_vocab": enc.n_vocab}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m model.export", description=__doc__.split("\n\n")[0], epilog=__doc__)
    p.add_argument("src", metavar="RUN_DIR_OR_CKPT", help="run dir (train.out_dir) or RUN/ckpt/step_NNNNNN")
    p.add_argument("--out", required=True, help="output directory (Hugging Face format)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="stored precision (default: as trained)")
    p.add_argument("--tokenizer", default=None, help="tokenizer name (default: the run dataset's, else gpt2)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    args = p.parse_args(argv)
    try:
        info = export(args.src, args.out, dtype=args.dtype, tokenizer=args.tokenizer, overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"model.export: error: {e}", file=sys.stderr)
        return 2
    step = f" (step {info['step']})" if info["step"] is not None else ""
    print(f"exported {info['source']}{step} -> {info['out']}: LlamaForCausalLM, {info['params'] / 1e6:.2f}M params, "
          f"vocab {info['vocab_size']} ({info['tokenizer']} tokenizer, {info['tokenizer_vocab']} ids)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
