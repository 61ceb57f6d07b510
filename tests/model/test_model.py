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


def test_shape_keys_override_the_preset_and_gqa_shrinks_only_keys_and_values():
    from model import resolve_config

    cfg = resolve_config({"preset": "debug", "n_layer": 3, "n_head": 4, "n_kv_head": 1, "n_embd": 128,
                          "mlp_hidden": 96, "init_from": "", "activation_checkpointing": True})
    assert (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.n_embd, cfg.mlp_hidden) == (3, 4, 1, 128, 96)
    assert resolve_config({"preset": "debug", "n_head": 4}).n_kv_head == 4  # n_kv_head follows n_head unless set
    assert resolve_config({"preset": "debug", "n_embd": 128}).mlp_hidden == 64 * round(8 * 128 / 3 / 64)
    full, gqa = GPT(get_preset("debug", n_head=4)), GPT(get_preset("debug", n_head=4, n_kv_head=2))
    # per block the key and value projections shrink from 64 to 32 rows each
    assert full.num_params() - gqa.num_params() == 2 * 2 * 32 * 64
    with pytest.raises(ValueError, match="n_kv_head=3 must divide n_head=4"):
        get_preset("debug", n_head=4, n_kv_head=3)


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model = GPT(get_preset("debug", n_head=4, n_kv_head=2))
    x = torch.randint(0, 50257, (2, 64))
    grads = []
    for recompute in (False, True):
        model.zero_grad()
        model.activation_checkpointing = recompute
        loss = model(x, x)[1]
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = grads
    assert torch.equal(l0, l1) and all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(g0, g1))
    assert all(a.abs().sum() > 0 for a in g0)
    # it recomputes: the checkpointed forward keeps fewer saved tensors (each block's inputs only)
    saved = []
    for recompute in (False, True):
        model.activation_checkpointing = recompute
        count = [0]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: count.__setitem__(0, count[0] + 1) or t,
                                                      lambda t: t):
            model(x, x)
        saved.append(count[0])
    assert saved[1] < saved[0] / 2, saved
