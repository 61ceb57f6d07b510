"""Train a byte-level BPE tokenizer on a corpus with Hugging Face `tokenizers`, saved as a standard
tokenizer.json that data.tokenizer.get_encoding, data.prepare and AutoTokenizer all load offline.

The pre-tokenizer is GPT-2's: its regex (tiktoken's possessive form, the one data.tokenizer uses)
splits words, numbers, punctuation runs and whitespace, then every byte maps to GPT-2's printable
character (ByteLevel without its own regex), so the 256 byte symbols are the initial alphabet and
any text round-trips. <|endoftext|> is the one special token (id 0), the document separator.
The vocabulary size (merges + 256 bytes + the special token) is the caller's choice.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from data.tokenizer import EOT_TOKEN, GPT2_PAT_STR
from util import replaced_from_temp


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | os.PathLike, *, min_frequency: int = 2,
              length: int | None = None, progress: bool = False) -> Path:
    """Train on `texts` (one document each) and save tokenizer.json at `out` (written atomically)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must exceed the 256 byte symbols plus {EOT_TOKEN}, got {vocab_size}")
    tok = Tokenizer(models.BPE(fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT2_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with replaced_from_temp(out) as tmp:
        tok.save(str(tmp))
    return out
