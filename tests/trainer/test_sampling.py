"""Generation (trainer/sampling.py and its command `python -m sample`): the KV cache reproduces full
forward passes, sampling is seeded and never emits padded ids, and `python -m sample` decodes the
same tokens from a run, a checkpoint and an export."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sample
from trainer import sampling
from model import get_preset, sample_next
from tests.model.test_export import make_run, trained_like


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
def test_cached_logits_equal_full_forward(pos_emb: str) -> None:
    model = trained_like(get_preset("debug", pos_emb=pos_emb, block_size=32))
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model.logits(idx)
        assert torch.equal(model(idx, idx)[0], full)  # the training forward's logits are these
        cache = model.new_cache(2)
        parts = [model.forward_cached(idx[:, :11], cache, last_only=False)]  # prefill 11
        parts += [model.forward_cached(idx[:, t:t + 1], cache, last_only=False) for t in range(11, 17)]  # 1 by 1
        parts.append(model.forward_cached(idx[:, 17:], cache, last_only=False))  # a chunk at an offset
    assert cache.length == 32
    assert (torch.cat(parts, dim=1) - full).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="KV cache holds 32 positions; 32 used \\+ 1 new do not fit"):
        model.forward_cached(idx[:, :1], cache)


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
@pytest.mark.parametrize("prompt_len, new", [(1, 1), (5, 9), (3, 29), (20, 30)])  # the last two pass block_size 32
def test_greedy_with_cache_equals_without(pos_emb: str, prompt_len: int, new: int) -> None:
    model = trained_like(get_preset("debug", pos_emb=pos_emb, block_size=32))
    prompt = torch.randint(0, 50257, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    a = model.generate(prompt, new, temperature=0, use_cache=True)
    b = model.generate(prompt, new, temperature=0, use_cache=False)
    assert a.shape == (2, prompt_len + new) and torch.equal(a, b)


def test_seeded_sampling_top_k_and_padded_vocab() -> None:
    model = trained_like(get_preset("debug", block_size=64))
    prompt = torch.tensor([[50256]])

    def draw(seed: int, **kw) -> torch.Tensor:
        return model.generate(prompt, 30, temperature=1.0, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(draw(3), draw(3)) and not torch.equal(draw(3), draw(4))
    assert torch.equal(draw(3), draw(3, use_cache=False))  # same draws with or without the cache
    assert torch.equal(draw(5, top_k=1), model.generate(prompt, 30, temperature=0))
    logits = torch.zeros(4, 50304)
    logits[:, 50300] = 100.0  # a padded id that no tokenizer can decode is the most likely
    assert (sample_next(logits, 0.0, vocab_limit=50257) < 50257).all()
    assert (sample_next(logits, 1.0, None, torch.Generator().manual_seed(0), vocab_limit=50257) < 50257).all()
    assert (sample_next(logits, 0.0) == 50300).all()


def test_cache_follows_autocast_dtype() -> None:
    model = trained_like(get_preset("debug", block_size=64))
    cache = model.new_cache(1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.forward_cached(torch.tensor([[1, 2, 3]]), cache)
        model.forward_cached(logits.argmax(-1), cache)
    assert cache.k[0].dtype == torch.bfloat16 and cache.length == 4


def test_stop_token_ends_each_row() -> None:
    model = trained_like(get_preset("debug", block_size=64))
    first = model.generate(torch.tensor([[1, 2, 3]]), 1, temperature=0)[0, -1].item()
    out = model.generate(torch.tensor([[1, 2, 3]]), 10, temperature=0, stop_token=first)
    assert out.tolist() == [[1, 2, 3, first]]


def test_cli_from_run_checkpoint_and_export_agree(tmp_path: Path, capsys) -> None:
    from model.export import main as export_main

    run = make_run(tmp_path / "run", tie=False)
    assert export_main([str(run), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    model, codec, _ = sampling.load(run, "cpu")
    ids = sampling.generate_ids(model, codec, "The meaning of", max_new_tokens=12, temperature=0)[0]
    ref = model.generate(torch.tensor([codec.encode("The meaning of")]), 12, temperature=0, use_cache=False,
                         vocab_limit=50257)[0, -12:].tolist()
    if 50256 in ref:
        ref = ref[:ref.index(50256)]
    assert ids == ref
    texts = []
    for src in (run, run / "ckpt" / "step_000010", tmp_path / "hf"):
        assert sample.main([str(src), "--prompt", "The meaning of", "--max-new-tokens", "12", "--temperature", "0",
                            "--device", "cpu"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] == "The meaning of" + codec.decode(ids) + "\n"
    assert sample.main([str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (ids 3, 0, 4, 1, 2)
    probs = torch.tensor([[0.25, 0.0625, 0.0625, 0.5, 0.125]])
    logits = probs.log()
    for top_p, allowed in [(0.5, {3}), (0.6, {3, 0}), (0.75, {3, 0}), (0.8, {3, 0, 4}), (1.0, {0, 1, 2, 3, 4})]:
        g = torch.Generator().manual_seed(0)
        drawn = {int(sample_next(logits, 1.0, None, g, top_p=top_p)) for _ in range(400)}
        assert drawn == allowed, (top_p, drawn)
    # the kept tokens keep their relative odds: with top_p 0.75, id 3 twice as often as id 0
    g = torch.Generator().manual_seed(1)
    draws = sample_next(logits.expand(20000, 5), 1.0, None, g, top_p=0.75)
    assert abs((draws == 3).float().mean().item() - 2 / 3) < 0.02
    # after top_k: top_k=1 leaves one token whatever top_p says
    assert {int(sample_next(logits, 1.0, 1, torch.Generator().manual_seed(s), top_p=0.99)) for s in range(20)} == {3}


def test_cli_top_p(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run", tie=True)
    model, codec, _ = sampling.load(run, "cpu")
    # a nucleus too small for a second token is greedy decoding
    greedy = sampling.generate_ids(model, codec, "Once", max_new_tokens=8, temperature=0)[0]
    assert sampling.generate_ids(model, codec, "Once", max_new_tokens=8, temperature=1.0, top_p=1e-6)[0] == greedy
    wide = {tuple(sampling.generate_ids(model, codec, "Once", max_new_tokens=8, temperature=1.0, top_p=0.9,
                                      seed=s)[0]) for s in range(4)}
    assert len(wide) > 1
    assert sample.main([str(run), "--prompt", "Once", "--max-new-tokens", "4", "--top-p", "0.9", "--device",
                        "cpu"]) == 0
    with pytest.raises(SystemExit):
        sample.main([str(run), "--top-p", "1.5"])
    assert "--top-p 1.5: must be in (0, 1]" in capsys.readouterr().err
    for flag, value, said in (("--temperature", "-1", "--temperature -1.0: must be >= 0"),
                              ("--top-k", "-3", "--top-k -3: must be >= 0")):  # -1 was greedy, silently
        with pytest.raises(SystemExit):
            sample.main([str(run), flag, value])
        assert said in capsys.readouterr().err



def test_sample_takes_flags_only_and_says_so_in_one_line(capsys) -> None:
    """util/cli.py's convention for a command with no config: a config file or key=value is refused by name,
    every error is one line with exit code 2 (argparse printed its usage block first)."""
    for argv, want in ((['runs/x', '--prompt', 'a=b', 'train.max_steps=5'], "'train.max_steps=5': this command takes no config file"), (['runs/x', '--top-k', 'many'], '--top-k: invalid int value')):
        with pytest.raises(SystemExit) as e:
            sample.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and want in err and err.count("\n") == 1, err
