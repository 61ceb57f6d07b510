"""Evaluation during training: validation loss on the dataset's val split and, when a file is
configured (`train.mc_eval_file`), multiple-choice accuracy by completion log-likelihood on
HellaSwag-format items, each rank scoring its share of the items; the rules are trainer/scoring.py's
(the same `python -m eval` uses)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from data.loader import val_batch_count, val_batches

from . import scoring
from .config import ConfigError
from .dist import DistInfo, mean_over_ranks


class Evaluator:
    def __init__(self, cfg, info: DistInfo, data_dir: Path, vocab_size: int,
                 autocast: contextlib.AbstractContextManager) -> None:
        self.cfg, self.info, self.data_dir, self.vocab_size, self.autocast = cfg, info, data_dir, vocab_size, autocast
        d = cfg.data
        available = val_batch_count(data_dir, d.batch_size, d.seq_len, info.world_size)
        if available < 1:
            raise ConfigError(f"the val split of {data_dir} holds less than one global batch of {info.world_size} x "
                              f"{d.batch_size} x {d.seq_len} tokens; lower data.batch_size or data.seq_len, or "
                              f"prepare more val data")
        self.steps = min(cfg.train.eval_steps, available)  # never reuse val tokens within one eval
        self.mc_items, self.encode = None, None
        if cfg.train.mc_eval_file:
            from data import dataset_tokenizer
            from data.tokenizer import get_encoding

            try:
                self.mc_items = scoring.load_mc_file(cfg.train.mc_eval_file, cfg.train.mc_eval_items or None)
            except (scoring.MCFormatError, OSError) as e:
                raise ConfigError(f"train.mc_eval_file: {e}") from None
            self.encode = get_encoding(dataset_tokenizer(cfg.data.dataset)).encode_ordinary

    @torch.no_grad()
    def val_loss(self, model, forward) -> float:
        model.eval()
        d = self.cfg.data
        batches = val_batches(self.data_dir, d.batch_size, d.seq_len, self.info.rank, self.info.world_size,
                              self.steps, vocab_size=self.vocab_size, order=d.order)
        loss, _ = scoring.mean_batch_loss(forward, batches, self.info.device, self.autocast)
        return mean_over_ranks([loss], self.info.device)[0]

    @torch.no_grad()
    def multiple_choice(self, model) -> dict:
        """{mc_acc, mc_acc_norm, mc_acc_per_token, mc_items} over all ranks ({} without a file)."""
        if not self.mc_items:
            return {}
        with self.autocast:
            r = scoring.multiple_choice(model, self.mc_items, self.encode, self.info.device,
                                        rank=self.info.rank, world_size=self.info.world_size)
        ws = self.info.world_size
        n, c, cn, ct = (x * ws for x in mean_over_ranks(
            [r["n"], r["correct"], r["correct_norm"], r["correct_per_token"]], self.info.device))
        n = round(n)
        return {"mc_acc": c / n, "mc_acc_norm": cn / n, "mc_acc_per_token": ct / n, "mc_items": n}
