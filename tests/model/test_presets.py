"""A model feature is two files: GPTConfig (model/gpt.py) and the config schema's ModelConfig. The model
section's keys are derived from GPTConfig, so model/presets.py needs no edit for a new field."""
import dataclasses
from dataclasses import dataclass

import pytest

from model import presets
from model.gpt import GPTConfig
from trainer.config import ModelConfig


def test_every_gptconfig_field_is_a_model_key_and_in_the_schema():
    fields = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size"}
    assert set(presets.SECTION_KEYS) == fields | {"preset"}
    schema = {f.name for f in dataclasses.fields(ModelConfig)}
    missing = set(presets.SECTION_KEYS) - schema
    assert not missing, f"GPTConfig fields without a ModelConfig field (trainer/config_schema.py): {missing}"


def test_a_new_switch_reaches_the_model_without_touching_presets(monkeypatch):
    """Plant a GPTConfig with one more switch and one more number: resolve_config passes both on, and
    None / 0 keep the preset's."""
    @dataclass
    class Planted(GPTConfig):
        qk_norm: bool = False
        qk_scale: float = 0.0

    monkeypatch.setattr(presets, "GPTConfig", Planted)
    shape, switch = presets.model_keys(Planted)
    assert "qk_scale" in shape and "qk_norm" in switch
    monkeypatch.setattr(presets, "SHAPE_KEYS", shape)
    monkeypatch.setattr(presets, "SWITCH_KEYS", switch)
    monkeypatch.setattr(presets, "SECTION_KEYS", ("preset", *switch, *shape))
    monkeypatch.setattr(presets, "PRESETS", {"debug": Planted(n_layer=2, n_head=2, n_embd=64, block_size=128)})
    cfg = presets.resolve_config({"preset": "debug", "qk_norm": True, "qk_scale": 2.0})
    assert cfg.qk_norm is True and cfg.qk_scale == 2.0
    kept = presets.resolve_config({"preset": "debug", "qk_norm": None, "qk_scale": 0})
    assert kept.qk_norm is False and kept.qk_scale == 0.0


def test_switches_keep_their_meaning():
    assert presets.resolve_config({"preset": "debug"}).pos_emb == "rope"
    assert presets.resolve_config({"preset": "debug", "pos_emb": "learned"}).pos_emb == "learned"
    assert presets.resolve_config({"preset": "debug", "tie_embeddings": None}).tie_embeddings is True
    assert presets.resolve_config({"preset": "debug", "tie_embeddings": False}).tie_embeddings is False
    with pytest.raises(ValueError, match="unknown key"):
        presets.resolve_config({"preset": "debug", "qk_norm": True})
