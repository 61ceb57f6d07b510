"""Scoring a trained model: the validation-loss rule (`mean_batch_loss`, shared by `python -m eval
val` and the trainer's evaluation, trainer/evaluation.py), perplexity over a prepared dataset's val
split (`val_loss`), and multiple-choice accuracy by completion log-likelihood on HellaSwag-format
items (`load_mc_file`, `multiple_choice`; eval.py's docstring says how the three accuracies are
defined). A score that is not finite is a NonFiniteResult (one line), never a printed "nan".
The command line is eval.py; this module holds its logic."""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from model import GPT


class NonFiniteResult(ValueError):
    """A score that is NaN or inf: the model is broken; the message is one line."""


class MCFormatError(ValueError):
    """A multiple-choice file that does not have the expected fields (names the line and field)."""


@dataclass
class MCItem:
    ctx: str
    endings: list[str]
    label: int


def item_from(obj: Any, where: str) -> MCItem:
    if not isinstance(obj, dict):
        raise MCFormatError(f"{where}: expected a JSON object with ctx (or ctx_a/ctx_b), endings and label, "
                            f"got {type(obj).__name__}")
    if "ctx" in obj:
        ctx = obj["ctx"]
    elif "ctx_a" in obj:  # HellaSwag's own definition of ctx
        ctx_b = obj.get("ctx_b") or ""
        ctx = obj["ctx_a"] + (" " + ctx_b.capitalize() if ctx_b else "")
    else:
        raise MCFormatError(f"{where}: missing field 'ctx' (or HellaSwag's 'ctx_a'/'ctx_b'); fields present: "
                            f"{sorted(obj)}")
    if not isinstance(ctx, str):
        raise MCFormatError(f"{where}: field 'ctx' must be a string, got {type(ctx).__name__}")
    for field in ("endings", "label"):
        if field not in obj:
            raise MCFormatError(f"{where}: missing field {field!r}; fields present: {sorted(obj)}")
    endings = obj["endings"]
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) and e for e in endings):
        raise MCFormatError(f"{where}: field 'endings' must be a list of at least 2 non-empty strings, "
                            f"got {endings!r:.200}")
    label = obj["label"]
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise MCFormatError(f"{where}: field 'label' must be an index into endings (0..{len(endings) - 1}), "
                            f"got {obj['label']!r}")
    return MCItem(ctx, endings, label)


def load_mc_file(path: str | os.PathLike, limit: int | None = None) -> list[MCItem]:
    """The items of a HellaSwag-format JSONL file (first `limit` if given), validated: MCFormatError
    naming the line and the missing or malformed field otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"multiple-choice file {path} does not exist; HellaSwag's validation set is "
                                f"data/hellaswag_val.jsonl in the GitHub repository rowanz/hellaswag")
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise MCFormatError(f"{path}:{lineno}: not valid JSON ({e})") from None
            items.append(item_from(obj, f"{path}:{lineno}"))
            if limit is not None and len(items) >= limit:
                break
    if not items:
        raise MCFormatError(f"{path} holds no items (expected one JSON object per line)")
    return items


@torch.no_grad()
def ending_logprobs(model: GPT, ctx: list[int], endings: list[list[int]], device: torch.device | str,
                    batch_size: int = 16) -> list[tuple[float, int]]:
    """(sum of log p(ending tokens | ctx), number of ending tokens) for each ending. A sequence
    longer than the model's context keeps its last block_size tokens."""
    block = model.config.block_size
    seqs, spans = [], []
    for end in endings:
        seq = (ctx + end)[-block:]
        n_end = min(len(end), len(seq) - 1)  # the first kept token has no prediction
        seqs.append(seq)
        spans.append((len(seq) - n_end, len(seq)))
    out = []
    for b in range(0, len(seqs), batch_size):
        chunk = seqs[b:b + batch_size]
        T = max(len(s) for s in chunk)
        x = torch.zeros(len(chunk), T, dtype=torch.long)
        for i, s in enumerate(chunk):
            x[i, :len(s)] = torch.tensor(s)
        logp = F.log_softmax(model.logits(x.to(device)).float(), dim=-1)
        for i, s in enumerate(chunk):
            a, e = spans[b + i]
            targets = torch.tensor(s[a:e], device=logp.device)
            out.append((float(logp[i, a - 1:e - 1].gather(1, targets[:, None]).sum()), e - a))
    return out


def multiple_choice(model: GPT, items: list[MCItem], encode: Callable[[str], list[int]],
                    device: torch.device | str = "cpu", batch_size: int = 16, rank: int = 0,
                    world_size: int = 1) -> dict:
    """Accuracy of `model` on items[rank::world_size] by completion log-likelihood. Returns
    {"n", "correct", "correct_norm", "correct_per_token"} (sum them over ranks) and the rates
    "acc", "acc_norm" (per UTF-8 byte), "acc_per_token" of this rank's share."""
    was_training = model.training
    model.eval()
    n = correct = correct_norm = correct_tok = 0
    try:
        for item in items[rank::world_size]:
            conts = [" " + e for e in item.endings]
            scores = ending_logprobs(model, encode(item.ctx), [encode(c) for c in conts], device, batch_size)
            ll = [s for s, _ in scores]
            if not all(math.isfinite(x) for x in ll):
                raise NonFiniteResult(f"log-likelihoods {ll} of an item's endings are not finite: the model's outputs "
                                      f"are not finite; it is damaged, or overflows in this precision")
            per_byte = [s / len(e.encode("utf-8")) for (s, _), e in zip(scores, item.endings)]
            per_tok = [s / max(k, 1) for s, k in scores]
            n += 1
            correct += int(max(range(len(ll)), key=ll.__getitem__) == item.label)
            correct_norm += int(max(range(len(ll)), key=per_byte.__getitem__) == item.label)
            correct_tok += int(max(range(len(ll)), key=per_tok.__getitem__) == item.label)
    finally:
        model.train(was_training)
    rate = (lambda k: k / n) if n else (lambda k: float("nan"))
    return {"n": n, "correct": correct, "correct_norm": correct_norm, "correct_per_token": correct_tok,
            "acc": rate(correct), "acc_norm": rate(correct_norm), "acc_per_token": rate(correct_tok)}


@torch.no_grad()
def mean_batch_loss(forward: Callable, batches, device: torch.device | str,
                    autocast: contextlib.AbstractContextManager | None = None) -> tuple[float, int]:
    """The validation loss rule, in one place (used here and by the trainer's evaluation): the mean
    over batches of `forward(x, y)`'s mean next-token cross-entropy, and the number of batches."""
    total, count = 0.0, 0
    for x, y in batches:
        with autocast if autocast is not None else contextlib.nullcontext():
            _, loss = forward(x.to(device), y.to(device))
        total += float(loss)
        count += 1
    return total / max(count, 1), count


@torch.no_grad()
def val_loss(model: GPT, data_dir: str | os.PathLike, batch_size: int, seq_len: int,
             n_batches: int | None = None, device: torch.device | str = "cpu",
             order: str = "sequential") -> dict:
    """Mean next-token cross-entropy over `n_batches` (None: all) val batches of a prepared
    dataset, read in `order` (data.loader.ORDERS, as val_batches), and its perplexity."""
    from data.loader import val_batches

    was_training = model.training
    model.eval()
    try:
        batches = val_batches(data_dir, batch_size, seq_len, 0, 1, n_batches, vocab_size=model.config.vocab_size,
                              order=order)
        loss, count = mean_batch_loss(model, batches, device)
    finally:
        model.train(was_training)
    if not math.isfinite(loss):  # "val loss nan" is no result: the model (or its dtype) is broken
        raise NonFiniteResult(f"the validation loss is {loss} (over {count} batches): the model's outputs are not "
                              f"finite; it is damaged, or overflows in this precision (try float32)")
    return {"loss": loss, "ppl": math.exp(loss), "batches": count, "tokens": count * batch_size * seq_len}


__all__ = ["MCFormatError", "MCItem", "NonFiniteResult", "ending_logprobs", "item_from", "load_mc_file",
           "mean_batch_loss", "multiple_choice", "val_loss"]
