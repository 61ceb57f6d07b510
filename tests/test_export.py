"""Hugging Face export: transformers (offline) gives our logits and our greedy tokens, the tokenizer
files tokenize like ours, import back is exact, resolve_config is the trainer's translation."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from model import GPT, GPTConfig, from_hf, get_preset, load_model, pad_vocab, resolve_config  # noqa: E402
from model.checkpoint_files import sha256_file  # noqa: E402
from model.export import main as export_main  # noqa: E402
from model.hf import HFFormatError, config_from_hf, save_hf  # noqa: E402


def trained_like(cfg: GPTConfig, seed: int = 0) -> GPT:
    """A model whose weights are far from their init (norm gains != 1, larger matrices), so a
    mapping mistake cannot hide behind near-identity layers."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05))
    return model.eval()


def make_run(run: Path, tie: bool, pos_emb: str = "rope", dataset: str = "builtin", vocab_size: int | None = None) -> Path:
    """A run dir as the trainer leaves it: config.yaml, ckpt/step_000010/{model.pt, meta.json}, latest."""
    section = {"preset": "debug", "tie_embeddings": tie, "pos_emb": pos_emb, "block_size": 0}
    config = {"model": section, "data": {"dataset": dataset}}
    ckpt = run / "ckpt" / "step_000010"
    ckpt.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    torch.save(trained_like(resolve_config(section, vocab_size)).state_dict(), ckpt / "model.pt")
    files = {"model.pt": sha256_file(ckpt / "model.pt")}  # checksums, as the trainer records them
    (ckpt / "meta.json").write_text(json.dumps({"step": 10, "world_size": 1, "config": config, "files": files}))
    (run / "ckpt" / "latest").write_text("step_000010")
    return run


def hf_model(d: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("export")
    out = {}
    for tie in (True, False):
        run = make_run(root / f"run_{tie}", tie)
        assert export_main([str(run), "--out", str(root / f"hf_{tie}")]) == 0
        out[tie] = (run, root / f"hf_{tie}")
    return out


@pytest.mark.parametrize("tie", [True, False])
def test_transformers_gives_our_logits_and_greedy_tokens(exported, tie: bool) -> None:
    run, d = exported[tie]
    ours = load_model(run).model
    theirs = hf_model(d)
    assert type(theirs).__name__ == "LlamaForCausalLM" and theirs.config.tie_word_embeddings == tie
    assert theirs.config.vocab_size == 50304 == ours.config.vocab_size
    idx = torch.randint(0, 50257, (3, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours.logits(idx), theirs(idx).logits
    assert a.abs().max() > 1.0  # logits of a trained-like model, not all near zero
    assert (a - b).abs().max().item() < 1e-4
    # greedy decoding: HF's generate (with its generation_config) and our sampler pick the same tokens
    prompt = idx[:1, :7]
    ref = theirs.generate(prompt, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(prompt))
    got = ours.generate(prompt, 24, temperature=0, vocab_limit=50257)
    assert got.tolist() == ref.tolist()


def test_import_back_is_exact_and_tokenizer_works_offline(exported) -> None:
    from transformers import AutoTokenizer

    from data.tokenizer import get_encoding

    for tie, (run, d) in exported.items():
        ours = load_model(run).model
        back = from_hf(d)
        assert back.config == ours.config
        a, b = ours.state_dict(), back.state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert (back.lm_head.weight is back.transformer.wte.weight) == tie
    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    enc = get_encoding()
    assert tok.eos_token_id == tok.bos_token_id == 50256 and len(tok) == 50257
    for text in ["Hello world", "  multiple   spaces\n\n\ttabs  ", "naïve café 日本語 🦁 3.14159", "a <|endoftext|> b"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == enc.encode(text, allowed_special="all") and tok.decode(ids) == text
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 50256 and gen["suppress_tokens"] == list(range(50257, 50304))


def test_rope_base_and_shapes_other_than_the_presets(tmp_path: Path) -> None:
    # a non-default rope base and MLP width prove config.json carries them to transformers
    cfg = GPTConfig(block_size=48, vocab_size=320, n_layer=2, n_head=4, n_embd=64, mlp_hidden=96,
                    rope_base=500000.0, tie_embeddings=False, norm_eps=1e-5)
    ours = trained_like(cfg)
    save_hf(ours, tmp_path / "hf", bos_token_id=0, eos_token_id=0, max_shard_bytes=200_000)
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1  # sharded with an index
    theirs = hf_model(tmp_path / "hf")
    idx = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours.logits(idx) - theirs(idx).logits).abs().max().item() < 1e-4
    back = from_hf(tmp_path / "hf")
    assert back.config == cfg and all(torch.equal(p, q) for p, q in zip(ours.parameters(), back.parameters()))
    # the same weights with the default base give other logits: a dropped rope_theta would show
    default_base = GPT(GPTConfig(**{**cfg.__dict__, "rope_base": 10000.0})).eval()
    default_base.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (default_base.logits(idx) - theirs(idx).logits).abs().max().item() > 1e-3


def test_learned_positions_are_refused_and_foreign_configs_too(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run", tie=True, pos_emb="learned")
    assert export_main([str(run), "--out", str(tmp_path / "hf")]) == 2
    assert "Llama has no learned position table" in capsys.readouterr().err and not (tmp_path / "hf").exists()
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
            "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 32}
    with pytest.raises(HFFormatError, match=r"grouped-query attention \(2 key/value heads for 4 query heads\)"):
        config_from_hf({**base, "num_key_value_heads": 2})
    with pytest.raises(HFFormatError, match="rope type 'llama3'"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert config_from_hf(base).mlp_hidden == 128


def test_a_model_whose_tokenizer_is_unknown_here_is_not_exported_with_gpt2(tmp_path: Path, capsys) -> None:
    # trained on a 70,001-id tokenizer (vocab 70016) whose dataset is not on this machine
    run = make_run(tmp_path / "run", tie=True, dataset=str(tmp_path / "elsewhere"), vocab_size=70001)
    assert load_model(run).model.config.vocab_size == 70016
    assert export_main([str(run), "--out", str(tmp_path / "hf")]) == 2
    assert ("the model's vocabulary (70016) does not belong to tokenizer gpt2 (50257 ids, padded 50304)"
            in capsys.readouterr().err) and not (tmp_path / "hf").exists()


def test_export_refuses_to_overwrite_what_it_did_not_write(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run", tie=True)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert export_main([str(run), "--out", str(foreign)]) == 2
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert export_main([str(run), "--out", str(foreign), "--overwrite"]) == 2
    assert "refuses to replace" in capsys.readouterr().err and (foreign / "notes.txt").read_text() == "keep me"
    assert export_main([str(run / "ckpt" / "step_000010"), "--out", str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    assert "(step 10)" in capsys.readouterr().out
    assert export_main([str(run), "--out", str(tmp_path / "hf"), "--overwrite"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float32"


def test_resolve_config_is_the_trainers_translation() -> None:
    def trainer_way(m: dict):  # trainer.Trainer.__init__ / bench.variants.num_params before resolve_config
        overrides = {"pos_emb": m.get("pos_emb", "rope")}
        if m.get("tie_embeddings") is not None:
            overrides["tie_embeddings"] = m["tie_embeddings"]
        if m.get("block_size"):
            overrides["block_size"] = m["block_size"]
        return get_preset(m["preset"], **overrides)

    for section in [{"preset": "tiny"}, {"preset": "debug", "tie_embeddings": False, "pos_emb": "learned"},
                    {"preset": "cpu-30m", "tie_embeddings": None, "pos_emb": "rope", "block_size": 512},
                    {"preset": "gpt2-124m", "tie_embeddings": True, "block_size": 0}]:
        assert resolve_config(section) == trainer_way(section)
    cfg = resolve_config({"preset": "debug"}, vocab_size=100277)  # cl100k_base
    assert cfg.vocab_size == pad_vocab(100277) == 100288 and cfg.vocab_size % 64 == 0
    assert resolve_config({"preset": "debug"}, vocab_size=50257).vocab_size == 50304
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['n_layers'\]"):
        resolve_config({"preset": "debug", "n_layers": 3})
