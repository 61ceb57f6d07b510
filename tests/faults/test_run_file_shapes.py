"""Config and run files of the wrong shape: one line naming the file (and both lines of a duplicated
YAML key), exit 2, nothing written to the wrong place; never a silent loss or a traceback."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.dist import ROOT
from tests.faults.common import ENV, cli, run1


def _one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_a_yaml_key_given_twice_is_an_error_naming_both_lines(tmp_path):
    out = tmp_path / "mine"
    cfg = tmp_path / "twice.yaml"
    cfg.write_text(f"extends: {ROOT / 'configs/default.yaml'}\ntrain:\n  out_dir: {out}\ndata:\n  batch_size: 2\n"
                   f"train:\n  max_steps: 1\n")
    proc = subprocess.run([sys.executable, "train.py", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env=ENV)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _one_line(proc.stderr)
    assert f"{cfg}: key 'train' appears twice" in line and "lines 2 and 6" in line, line
    assert not out.exists() and not (ROOT / "runs" / "twice").exists()


def test_a_duplicate_key_in_an_override_value_is_an_error(tmp_path):
    proc = run1(tmp_path / "run", "train.max_steps=1", "data.mix={builtin: 1, builtin: 2}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "key 'builtin' appears twice" in proc.stderr, proc.stderr


@pytest.mark.parametrize("weight", [".inf", ".nan", "-1", "0"])
def test_a_mix_weight_must_be_finite_and_positive(tmp_path, weight):
    proc = run1(tmp_path / "run", "train.max_steps=1", f"data.mix={{builtin: {weight}}}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.mix: weight of 'builtin'" in proc.stderr and "finite number > 0" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_mix_loader_refuses_an_infinite_weight(tmp_path):
    from data.loader import DataError, MixLoader

    with pytest.raises(DataError, match="finite and > 0"):
        MixLoader([("a", tmp_path, float("inf")), ("b", tmp_path, 1.0)], "train", 2, 8, 0, 1, 0)


@pytest.mark.parametrize("shape", [[1, 2], {"step": "4", "world_size": 1}, {"step": 4, "world_size": 1, "files": []},
                                   {"step": 4, "world_size": True}])
def test_a_meta_json_of_the_wrong_shape_is_named_and_skipped(run_copy, tmp_path, shape):
    meta = run_copy / "ckpt" / "step_000004" / "meta.json"
    meta.write_text(json.dumps(shape))
    proc = cli("model.export", run_copy, "--out", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipped checkpoint step_000004: {meta}" in proc.stderr, proc.stderr
    (tmp_path / "direct").mkdir()
    proc = cli("model.export", run_copy / "ckpt" / "step_000004", "--out", tmp_path / "direct" / "hf")
    assert proc.returncode == 2 and str(meta) in _one_line(proc.stderr)
    proc = run1(run_copy, "train.max_steps=5", "train.eval_every=0", "train.resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipped checkpoint step_000004: {meta}" in proc.stdout and "step_000002 at step 2" in proc.stdout


def test_read_json_object_names_the_file_and_the_key(tmp_path):
    from util.files import FileShapeError, read_json_object

    f = tmp_path / "auto_mode.json"
    fields = {"mode": str, "rates": dict}
    for text, why in [("[1]", "holds a JSON list, not an object"), ("{\"mode\": 3, \"rates\": {}}", "'mode' is 3"),
                      ("{\"mode\": \"x\"}", "lacks the key 'rates'"), ("{", "is not valid JSON")]:
        f.write_text(text)
        with pytest.raises(FileShapeError) as e:
            read_json_object(f, fields, fix="delete it to decide again")
        msg = str(e.value)
        assert msg.startswith(str(f)) and why in msg and msg.endswith("delete it to decide again") and "\n" not in msg
    f.write_text(json.dumps({"mode": "x", "rates": {}, "extra": 1}))
    assert read_json_object(f, fields)["extra"] == 1


@pytest.mark.parametrize("config", [[1], {"model_type": "llama", "hidden_size": "128"}])
def test_an_hf_config_json_of_the_wrong_shape_is_one_line(run_copy, tmp_path, config):
    hf = tmp_path / "hf"
    assert cli("model.export", run_copy, "--out", hf).returncode == 0
    full = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config if isinstance(config, list) else {**full, **config}))
    proc = cli("sample", hf, "--prompt", "The", "--max-new-tokens", "2", "--device", "cpu")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert str(hf / "config.json") in _one_line(proc.stderr)
