"""A model that cannot be right is refused by every reader in one line (exit 2), never turned into
"val loss nan", a traceback or silent garbage: weights of finite garbage (every byte 0x7f, about
3.4e38) in an HF export, and in a model.pt resealed with a matching checksum."""
from __future__ import annotations

import pytest
import torch

from tests.faults.common import _reseal, cli, run1

GARBAGE = 3.3895313892515355e38  # the float32 whose four bytes are all 0x7f


def _one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


READERS = {
    "export": lambda src, tmp: cli("model.export", src, "--out", tmp / "out"),
    "sample": lambda src, tmp: cli("sample", src, "--prompt", "The", "--max-new-tokens", "2", "--device", "cpu"),
    "eval": lambda src, tmp: cli("eval", "val", src, "--data", "builtin", "--batches", "1", "--batch-size", "1",
                                 "--seq-len", "16", "--device", "cpu"),
    "init_from": lambda src, tmp: run1(tmp / "new", "train.max_steps=1", "train.eval_every=0",
                                       f"model.init_from={src}"),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_a_resealed_model_of_finite_garbage_is_refused(run_copy, tmp_path, reader):
    ckpt = run_copy / "ckpt" / "step_000004"
    sd = torch.load(ckpt / "model.pt", weights_only=True)
    torch.save({k: torch.full_like(v, GARBAGE) if v.is_floating_point() else v for k, v in sd.items()},
               ckpt / "model.pt")
    _reseal(ckpt, "model.pt")
    proc = READERS[reader](ckpt, tmp_path)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    line = _one_line(proc.stderr)
    assert "model.pt: refused:" in line and "holds |weight| 3.39e+38, beyond 2**64" in line, line


@pytest.mark.parametrize("reader", ["sample", "eval", "init_from"])
def test_an_hf_export_of_0x7f_bytes_is_refused(run_copy, tmp_path, reader):
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    assert cli("model.export", run_copy, "--out", hf).returncode == 0
    tensors = load_file(hf / "model.safetensors")
    garbage = {k: torch.frombuffer(bytearray(b"\x7f" * (v.numel() * v.element_size())), dtype=v.dtype).reshape(v.shape)
               for k, v in tensors.items()}
    save_file(garbage, hf / "model.safetensors", metadata={"format": "pt"})
    proc = READERS[reader](hf, tmp_path)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    line = _one_line(proc.stderr)
    assert f"{hf}: refused:" in line and "|weight| 3.4e+38, beyond 2**64" in line, line


def test_a_large_but_finite_weight_is_reported_not_refused(run_copy, tmp_path):
    ckpt = run_copy / "ckpt" / "step_000004"
    sd = torch.load(ckpt / "model.pt", weights_only=True)
    sd["transformer.h.0.norm1.weight"][0] = 5e3  # one outlier gain: large, finite logits
    torch.save(sd, ckpt / "model.pt")
    _reseal(ckpt, "model.pt")
    proc = READERS["eval"](ckpt, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning:" in proc.stderr and "transformer.h.0.norm1.weight holds |weight| up to 5e+03" in proc.stderr


def test_eval_refuses_a_non_finite_loss_and_sample_non_finite_logits():
    import eval as evaluation
    import sample
    from data import resolve_dataset
    from model import GPT
    from model.presets import resolve_config

    model = GPT(resolve_config({"preset": "debug"})).eval()
    with torch.no_grad():
        model.lm_head.weight.fill_(float("inf"))  # loaded models are refused earlier; a model built in code is not
    with pytest.raises(evaluation.NonFiniteResult, match="validation loss is nan"):
        evaluation.val_loss(model, resolve_dataset("builtin"), 1, 16, 1)
    codec = sample._tiktoken_codec("gpt2")
    with pytest.raises(ValueError, match="logits for the prompt are not finite"):
        sample.generate_ids(model, codec, "The", max_new_tokens=2, temperature=0)
