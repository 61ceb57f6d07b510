import math

import pytest
import torch

from model import GPT, PRESETS, ROLES, get_preset, param_roles

NOMINAL = {"gpt2-124m": 124e6, "gpt2-350m": 350e6, "gpt2-774m": 774e6, "gpt2-1558m": 1558e6}


@pytest.mark.parametrize("name", list(NOMINAL))
def test_gpt2_preset_param_counts_near_nominal(name):
    # Counted as unique parameters with tied embedding/head, no position table (RoPE).
    with torch.device("meta"):
        model = GPT(get_preset(name, tie_embeddings=True))
    n = model.num_params()
    assert abs(n - NOMINAL[name]) / NOMINAL[name] < 0.02, (name, n)
    assert model.config.vocab_size == 50304 and model.config.mlp_hidden % 64 == 0
    assert abs(model.config.mlp_hidden - 8 * model.config.n_embd / 3) <= 32


def test_cpu30m_is_about_30m():
    with torch.device("meta"):
        n = GPT(PRESETS["cpu-30m"]).num_params()
    assert 27e6 < n < 33e6


def test_untied_counts_head_separately():
    tied = GPT(get_preset("debug", tie_embeddings=True))
    untied = GPT(get_preset("debug", tie_embeddings=False))
    assert untied.num_params() - tied.num_params() == 50304 * 64
    assert untied.num_params(non_embedding=True) == tied.num_params(non_embedding=True)


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
def test_shapes_and_causality(pos_emb):
    torch.manual_seed(0)
    model = GPT(get_preset("debug", pos_emb=pos_emb)).eval()
    idx = torch.randint(0, 50257, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 50304) and loss.ndim == 0
    last, none = model(idx)
    assert last.shape == (2, 1, 50304) and none is None
    # changing a future token must not change earlier logits
    idx2 = idx.clone()
    idx2[:, 10] = (idx2[:, 10] + 1) % 50257
    logits2, _ = model(idx2, idx2)
    torch.testing.assert_close(logits[:, :10], logits2[:, :10], rtol=0, atol=0)
    assert not torch.allclose(logits[:, 10:], logits2[:, 10:])


def test_untrained_loss_near_uniform():
    torch.manual_seed(0)
    model = GPT(PRESETS["debug"])
    idx = torch.randint(0, 50257, (4, 64))
    targets = torch.randint(0, 50257, (4, 64))  # independent of the input (tied weights favour idx itself)
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(50304)) < 0.1


def test_residual_projections_scaled_init():
    torch.manual_seed(0)
    model = GPT(get_preset("tiny"))
    std_proj = model.transformer.h[0].mlp.proj.weight.std().item()
    std_fc = model.transformer.h[0].mlp.fc.weight.std().item()
    assert abs(std_fc - 0.02) < 0.002
    assert abs(std_proj - 0.02 / math.sqrt(2 * 4)) < 0.001


def test_param_roles_cover_every_parameter_once():
    for tie in (True, False):
        model = GPT(get_preset("debug", tie_embeddings=tie))
        roles = param_roles(model)
        names = [n for n, _ in model.named_parameters()]
        assert sorted(roles) == sorted(names)
        assert set(roles.values()) <= set(ROLES)
        assert roles["transformer.wte.weight"] == "embedding"
        assert ("lm_head.weight" in roles) == (not tie)
        assert roles["transformer.h.1.attn.qkv.weight"] == "attn"
        assert roles["transformer.h.0.mlp.fc.weight"] == "mlp"
        assert roles["transformer.norm_f.weight"] == "norm"


def test_unknown_preset_and_bad_shape():
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'.*gpt2-124m"):
        get_preset("gpt5")
    with pytest.raises(ValueError, match="not divisible"):
        get_preset("debug", n_head=3)


def test_flops_per_token_matches_6n_rule():
    with torch.device("meta"):
        model = GPT(PRESETS["gpt2-124m"])
    f = model.flops_per_token(1024)
    n_matmul = model.num_params(non_embedding=True) + 50304 * 768
    assert f == 6 * n_matmul + 12 * 12 * 768 * 1024
