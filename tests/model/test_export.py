"""Hugging Face export: transformers (offline) gives our logits and our greedy tokens, the tokenizer
files tokenize like ours, import back is exact, resolve_config is the trainer's translation."""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
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
def exported(tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("export")
    out = {}
    for tie in (True, False):
        run = make_run(root / f"run_{tie}", tie)
        assert export_main([str(run), "--out", str(root / f"hf_{tie}")]) == 0
        out[tie] = (run, root / f"hf_{tie}")
    yield out
    shutil.rmtree(root, ignore_errors=True)


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
    with pytest.raises(HFFormatError, match=r"num_key_value_heads 3 does not divide num_attention_heads 4"):
        config_from_hf({**base, "num_key_value_heads": 3})
    assert config_from_hf({**base, "num_key_value_heads": 2}).n_kv_head == 2
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


def test_export_pads_batches_is_readable_and_has_a_model_card(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    run = make_run(tmp_path / "run", tie=True)
    meta = json.loads((run / "ckpt/step_000010/meta.json").read_text())
    meta["config"].update(optim={"name": "lion", "lr": 0.001, "schedule": "wsd"}, comm={"mode": "onebit"})
    meta.update(tokens_seen=20480, world_size=2)
    (run / "ckpt/step_000010/meta.json").write_text(json.dumps(meta))
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 5, "val_loss": 6.5}, {"step": 10, "val_loss": 5.25}, {"step": 12, "val_loss": 4.0}]) + "\n")
    out = tmp_path / "hf"
    old = os.umask(0o022)
    try:
        assert export_main([str(run), "--out", str(out)]) == 0
    finally:
        os.umask(old)
    for f in out.iterdir():
        assert f.stat().st_mode & 0o777 == 0o644, f.name  # safetensors alone would leave the weights 0600
    card = (out / "README.md").read_text()
    for expected in ("2 layers, width 64, 2 heads (2 key/value heads)", "10 steps, 20,480 tokens", "lion (lr 0.001, wsd",
                     "comm.mode onebit, 2 rank(s)", "| final val loss | 5.2500 (step 10) |",
                     f'AutoModelForCausalLM.from_pretrained("{out}")', 'pip install "lm-eval[hf]"'):
        assert expected in card, expected
    # a padded batch generates what each prompt generates alone
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    model = hf_model(out)
    assert tok.pad_token == "<|endoftext|>" and model.config.pad_token_id == tok.pad_token_id == 50256
    assert model.generation_config.pad_token_id == 50256
    prompts = ["The meaning of life is", "def"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][1].tolist()[0] == 0  # left padding
    together = model.generate(**batch, max_new_tokens=8, do_sample=False)[:, batch["input_ids"].shape[1]:]
    for row, prompt in zip(together.tolist(), prompts):
        alone = tok(prompt, return_tensors="pt")
        ref = model.generate(**alone, max_new_tokens=8, do_sample=False)[0, alone["input_ids"].shape[1]:]
        assert row == ref.tolist(), prompt


MC_ITEMS = [
    {"ctx": "A woman pours flour into a large bowl. She", "label": 0,
     "endings": ["cracks two eggs over the flour and stirs.", "drives the bowl to the airport.",
                 "paints the ceiling with the flour.", "sings the bowl to sleep."]},
    {"ctx": "The function returns a list of", "label": 1,
     "endings": ["bananas in the garden.", "strings, one per line.", "nothing at all, ever."]},
    {"ctx": "To install the package, run", "label": 2,
     "endings": ["away from the computer.", "a marathon tomorrow.", "pip install with the name."]},
]


@pytest.mark.slow
def test_lm_eval_harness_scores_an_export_offline_like_our_eval(tmp_path: Path) -> None:
    """README's `pip install lm-eval[hf]` line: lm-evaluation-harness's `--model hf` loads the export
    offline and, on a local multiple-choice task, computes the same ending log-likelihoods (and so
    the same accuracy) as eval.py's scorer."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness not installed (pip install -e '.[eval]')")
    pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate (pip install -e '.[eval]')")
    import subprocess
    import sys

    import eval as mc_eval
    from data.tokenizer import get_encoding

    run = make_run(tmp_path / "run", tie=True)
    out = tmp_path / "hf"
    assert export_main([str(run), "--out", str(out)]) == 0
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps(it) + "\n" for it in MC_ITEMS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mini.yaml").write_text(yaml.safe_dump({
        "task": "lioncub_mini_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(items)}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "ctx", "doc_to_choice": "endings",
        "doc_to_target": "label", "metric_list": [{"metric": "acc"}]}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                           f"pretrained={out},dtype=float32", "--tasks", "lioncub_mini_mc", "--include_path",
                           str(tasks), "--device", "cpu", "--batch_size", "4", "--log_samples", "--output_path",
                           str(tmp_path / "results")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = [json.loads(line) for f in (tmp_path / "results").rglob("samples_lioncub_mini_mc_*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(samples) == len(MC_ITEMS)
    model = load_model(out).model
    encode = get_encoding("gpt2").encode_ordinary
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        item = MC_ITEMS[s["doc_id"]]
        theirs = [float(r[0][0]) for r in s["resps"]]
        ours = [ll for ll, _ in mc_eval.ending_logprobs(model, encode(item["ctx"]),
                                                        [encode(" " + e) for e in item["endings"]], "cpu")]
        assert theirs == pytest.approx(ours, abs=2e-3), (s["doc_id"], theirs, ours)


def test_grouped_query_attention_round_trips_through_export_and_import(tmp_path: Path) -> None:
    """n_kv_head < n_head: transformers' LlamaForCausalLM reads our export with our logits, from_hf
    reads it back exactly, and a Llama with GQA written by transformers itself imports with its logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = GPTConfig(block_size=40, vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, tie_embeddings=False)
    ours = trained_like(cfg)
    assert ours.transformer.h[0].attn.qkv.weight.shape == ((4 + 2 * 2) * 16, 64)
    save_hf(ours, tmp_path / "ours", bos_token_id=0, eos_token_id=0)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["num_key_value_heads"] == 2
    theirs = hf_model(tmp_path / "ours")
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = ours.logits(idx), theirs(idx).logits
    assert a.abs().max() > 1.0 and (a - b).abs().max().item() < 1e-4
    back = from_hf(tmp_path / "ours")
    assert back.config == cfg and all(torch.equal(p, q) for p, q in zip(ours.parameters(), back.parameters()))
    # the KV cache holds n_kv_head heads and decodes the tokens of the full forward pass
    prompt = idx[:1, :5]
    assert ours.generate(prompt, 20, temperature=0).tolist() == \
        ours.generate(prompt, 20, temperature=0, use_cache=False).tolist()
    # a GQA Llama from transformers (1 key/value head for 4 query heads), imported
    torch.manual_seed(0)
    foreign = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32,
                                           rms_norm_eps=1e-5, tie_word_embeddings=False)).eval()
    foreign.save_pretrained(str(tmp_path / "foreign"), safe_serialization=True)
    mine = from_hf(tmp_path / "foreign")
    assert mine.config.n_kv_head == 1 and mine.config.norm_eps == 1e-5
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (mine.logits(x) - foreign(x).logits).abs().max().item() < 1e-4



def test_export_takes_flags_only_and_says_so_in_one_line(capsys) -> None:
    """util/cli.py's convention for a command with no config: a config file or key=value is refused by name,
    every error is one line with exit code 2 (argparse printed its usage block first)."""
    for argv, want in ((['runs/x', '--out', 'o', 'model.n_layer=2'], "'model.n_layer=2': this command takes no config file"), (['runs/x'], 'required: --out')):
        with pytest.raises(SystemExit) as e:
            export_main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and want in err and err.count("\n") == 1, err


def test_the_card_names_a_mix_s_sources_not_only_its_validation_set() -> None:
    """A data.mix run trained on every source of the mix by weight (data.dataset is then its val set): the
    card's 'trained' line said only data.dataset."""
    from model.export import _trained_on

    assert _trained_on({"dataset": "data/owt"}) == "data/owt"
    assert _trained_on({}) == "builtin"
    assert _trained_on({"dataset": "data/A", "mix": {"data/A": 1, "data/B": 3}}) == \
        "a mix of data/A (25 %), data/B (75 %); validated on data/A"
