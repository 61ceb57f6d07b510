"""End-to-end trainer tests: torchrun on gloo, the debug model, the built-in corpus."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from model import GPT, get_preset
from tests.dist import ROOT, torchrun

TINY = ["model.preset=debug", "data.batch_size=4", "data.seq_len=64", "train.eval_steps=2",
        "train.log_every=1", "log.wandb=disabled", "optim.warmup_steps=0"]


def records(run: Path, key: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if key in r]


def train(nproc: int, out: Path, *overrides: str, timeout: float = 240):
    args = ["configs/default.yaml", *TINY, f"train.out_dir={out}", *overrides]
    if nproc == 1:
        proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc
    return torchrun(nproc, ROOT / "train.py", *args, timeout=timeout)


# both optimizers and both wire dtypes (the other two pairings train in tests/trainer/test_golden.py)
@pytest.mark.parametrize("optim,mode", [("adamw", "bf16"), ("lion", "fp32")])
def test_two_ranks_loss_falls_and_params_identical(tmp_path, optim, mode):
    train(2, tmp_path / "run", f"optim.name={optim}", f"comm.mode={mode}", "optim.lr=3e-3", "train.max_steps=20")
    steps = records(tmp_path / "run", "train_loss")
    assert [r["step"] for r in steps] == list(range(1, 21))
    losses = [r["train_loss"] for r in steps]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses
    final = records(tmp_path / "run", "params_identical")[-1]
    assert final["params_identical"] and len(final["param_sha256"]) == 2
    # gradient sync hands the flat gradient to one allreduce: 4 bytes per parameter in fp32, 2 in bf16
    n_params = GPT(get_preset("debug")).num_params()
    assert steps[-1]["comm_bytes"] == n_params * (4 if mode == "fp32" else 2)
    assert steps[-1]["comm_ms"] > 0 and steps[-1]["step_ms"] > steps[-1]["comm_ms"]
    assert (tmp_path / "run" / "config.yaml").is_file() and (tmp_path / "run" / "ckpt" / "latest").is_file()
    assert records(tmp_path / "run", "val_loss")


def test_loss_parity_two_ranks_vs_one_rank_double_batch(tmp_path):
    common = ["optim.name=adamw", "optim.lr=3e-3", "comm.mode=fp32", "train.max_steps=8"]
    train(2, tmp_path / "p2", "data.batch_size=4", *common)
    train(1, tmp_path / "p1", "data.batch_size=8", *common)
    l2 = [r["train_loss"] for r in records(tmp_path / "p2", "train_loss")]
    l1 = [r["train_loss"] for r in records(tmp_path / "p1", "train_loss")]
    assert len(l1) == len(l2) == 8
    assert max(abs(a - b) for a, b in zip(l1, l2)) < 2e-4, list(zip(l1, l2))
    assert l1[-1] < l1[0] - 0.5  # they also learned, so the match is not trivial


def _params(run: Path) -> dict:
    ckpt = run / "ckpt" / (run / "ckpt" / "latest").read_text().strip()
    return torch.load(ckpt / "model.pt", map_location="cpu")


def test_resume_is_bit_exact(tmp_path):
    # update-sync with stochastic rounding: the per-rank momenta and RNG must round-trip too
    mode = ["optim.name=lion", "comm.mode=pbit", "comm.bits=8", "comm.quantizer=l1", "comm.rounding=stochastic",
            "train.max_steps=8"]
    train(2, tmp_path / "straight", *mode)
    train(2, tmp_path / "split", *mode, "train.stop_after=4")
    first = records(tmp_path / "split", "train_loss")
    assert first[-1]["step"] == 4 and not records(tmp_path / "split", "val_loss")
    train(2, tmp_path / "split", *mode, "train.resume=auto")
    a = records(tmp_path / "straight", "train_loss")
    b = records(tmp_path / "split", "train_loss")
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    pa, pb = _params(tmp_path / "straight"), _params(tmp_path / "split")
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_existing_run_dir_is_not_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {preset: debug}\n")  # an earlier run's directory
    (run / "notes.txt").write_text("precious")
    proc = subprocess.run([sys.executable, "train.py", "configs/default.yaml", *TINY, f"train.out_dir={run}",
                           "train.max_steps=2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "already exists" in proc.stderr and "train.resume=auto" in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "notes.txt"]
    proc = subprocess.run([sys.executable, "train.py", "configs/default.yaml", *TINY, f"train.out_dir={run}",
                           "train.max_steps=2", "train.resume=overwrite"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # not made by the trainer (no marker): overwrite refuses, naming what is there
    assert proc.returncode == 2 and "holds no .lioncub_run marker" in proc.stderr and "notes.txt" in proc.stderr
    assert (run / "notes.txt").read_text() == "precious" and sorted(p.name for p in run.iterdir()) == [
        "config.yaml", "notes.txt"]
    (run / "notes.txt").unlink()
    (run / "config.yaml").unlink()
    train(1, run, "train.max_steps=2")
    first = (run / ".lioncub_run").read_text()
    train(1, run, "train.max_steps=2", "train.resume=overwrite")  # ours: replaced, the old run retired
    assert records(run, "train_loss") and (run / ".lioncub_run").read_text() != first
    assert not [p for p in run.iterdir() if p.name.startswith(".replaced-")]


def test_sigterm_saves_a_loadable_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", "configs/default.yaml", *TINY, f"train.out_dir={run}",
                             "train.max_steps=100000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "metrics.jsonl").exists():
            time.sleep(0.2)
        while time.time() < deadline and len(records(run, "train_loss")) < 3:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "stopping (signal" in out
    ckpt = run / "ckpt" / (run / "ckpt" / "latest").read_text().strip()
    meta = json.loads((ckpt / "meta.json").read_text())
    assert 3 <= meta["step"] < 100000
    state = torch.load(ckpt / "rank_00000.pt", map_location="cpu", weights_only=False)
    assert state["step"] == meta["step"] and "optimizer" in state and "loader" in state
    assert set(torch.load(ckpt / "model.pt", map_location="cpu")) >= {"transformer.wte.weight"}


def test_wandb_online_without_key_falls_back_to_offline_and_stays_off_the_network(tmp_path):
    run = tmp_path / "run"
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    # any attempt to reach a server would go to a closed local port and fail the run or hang it
    env.update(HOME=str(home), WANDB_BASE_URL="http://127.0.0.1:9", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "train.py", "configs/default.yaml", *TINY, f"train.out_dir={run}",
                           "train.max_steps=2", "log.wandb=online"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "logging offline instead" in proc.stderr
    assert f"wandb: offline run in {run / 'wandb'}/offline-run-" in proc.stderr and "`wandb sync " in proc.stderr
    offline = list((run / "wandb").glob("offline-run-*/*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0
    assert records(run, "train_loss")[-1]["step"] == 2
    # the run config wandb holds carries the arm the dashboards group by (trainer.logger.arm_label): its key and
    # JSON value are in the offline run's records as written
    from trainer.config import load_config
    from trainer.logger import arm_label

    arm = arm_label(load_config(ROOT / "configs/default.yaml", [*TINY, f"train.out_dir={run}", "train.max_steps=2",
                                                                "log.wandb=online"]).to_dict(), 1)
    assert arm.startswith("lion fp32 P1 ") and b"arm" in offline[0].read_bytes()
    assert json.dumps(arm).encode() in offline[0].read_bytes()


def test_wandb_files_go_to_wandb_dir_when_set(tmp_path):
    run, wd = tmp_path / "run", tmp_path / "scratch"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}, "HOME": str(tmp_path),
           "OMP_NUM_THREADS": "1", "WANDB_DIR": str(wd)}
    proc = subprocess.run([sys.executable, "train.py", "configs/default.yaml", *TINY, f"train.out_dir={run}",
                           "train.max_steps=1", "log.wandb=offline"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((wd / "wandb").glob("offline-run-*/*.wandb")) and not (run / "wandb").exists()
    assert f"wandb: offline run in {wd / 'wandb'}/offline-run-" in proc.stderr


def _run1(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", "configs/default.yaml", *TINY, f"train.out_dir={out}",
                           *overrides], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_diagnostics_asked_of_a_run_without_them_are_said_once(tmp_path):
    p = _run1(tmp_path / "run", "train.max_steps=3", "optim.name=adamw", "diag.every=1")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("computes no diagnostics") == 1 and "optim.name=adamw" in p.stdout
    assert not records(tmp_path / "run", "diag/seconds")


def test_resume_guards(tmp_path):
    run = tmp_path / "run"
    # reaching max_steps through stop_after still ends with the final eval and the parameter check
    assert _run1(run, "train.max_steps=4", "train.stop_after=2").returncode == 0
    assert _run1(run, "train.max_steps=4", "train.stop_after=2", "train.resume=auto").returncode == 0
    assert records(run, "val_loss")[-1]["step"] == 4 and records(run, "params_identical")[-1]["params_identical"]
    done = _run1(run, "train.max_steps=4", "train.resume=auto")
    assert done.returncode == 0 and "already complete" in done.stdout
    # a resume that changes what the checkpoint was trained with is refused, and config.yaml is kept
    before = (run / "config.yaml").read_text()
    bad = _run1(run, "train.max_steps=6", "train.resume=auto", "optim.name=adamw")
    assert bad.returncode == 2 and "optim.name: 'lion' -> 'adamw'" in bad.stderr and "Traceback" not in bad.stderr
    assert (run / "config.yaml").read_text() == before
    # a dangling `latest` pointer falls back to the newest complete checkpoint instead of restarting
    (run / "ckpt" / "latest").write_text("step_999999")
    more = _run1(run, "train.max_steps=6", "train.resume=auto")
    assert more.returncode == 0 and "resumed from" in more.stdout and "at step 4" in more.stdout
    assert [r["step"] for r in records(run, "train_loss")] == list(range(1, 7))
    # overwrite refuses a directory that is not a run directory
    other = tmp_path / "notarun"
    other.mkdir()
    (other / "data.txt").write_text("keep")
    refused = _run1(other, "train.max_steps=2", "train.resume=overwrite")
    assert refused.returncode == 2 and "the trainer did not make it (data.txt)" in refused.stderr
    assert (other / "data.txt").read_text() == "keep"


def test_per_layer_diagnostics_and_presync_spread(tmp_path):
    run = tmp_path / "run"
    train(2, run, "optim.name=lion", "comm.mode=onebit", "model.tie_embeddings=false", "train.max_steps=4",
          "diag.every=2", "comm.momentum_sync.every=2", "comm.momentum_sync.layers=[head]")
    diags = records(run, "diag/sign_match")
    assert [r["step"] for r in diags] == [2, 4]
    d = diags[-1]
    # embedding and head apart (untied), per transformer block, per parameter tensor
    for metric in ("sign_match", "sign_flip", "tie_rate", "momentum_spread"):
        for key in ("embedding", "head", "block/0", "block/1", "tensor/transformer.h.1.mlp.fc.weight",
                    "tensor/lm_head.weight", "tensor/transformer.wte.weight"):
            assert f"diag/{metric}/{key}" in d, (metric, key)
    # step 4 synced the head: its spread is reported before the sync (> 0) and after it (exactly 0)
    assert d["diag/momentum_spread/head"] > 0 and d["diag/momentum_spread_after_sync/head"] == 0.0
    assert d["diag/momentum_spread_after_sync/embedding"] == d["diag/momentum_spread/embedding"] > 0
    blocks = [d[f"diag/momentum_spread/block/{i}"] for i in (0, 1)]
    tensors = [v for k, v in d.items() if k.startswith("diag/momentum_spread/tensor/transformer.h.0.")]
    assert blocks[0] == max(tensors)  # a block's spread is the max over its tensors


def test_wandb_run_id_is_unique_per_run_directory_and_renewed_on_overwrite(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HOME": str(tmp_path)}
    ids = {}
    for name, extra in (("a", []), ("b", []), ("b2", ["train.resume=overwrite"]), ("b3", ["train.resume=auto",
                                                                                          "train.max_steps=3"])):
        run = tmp_path / name[0]
        proc = subprocess.run([sys.executable, "train.py", "configs/default.yaml", *TINY, f"train.out_dir={run}",
                               "train.max_steps=2", "log.wandb=offline", *extra], cwd=ROOT, capture_output=True,
                              text=True, timeout=180, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ids[name] = (run / "run_id").read_text().strip()
        assert any(p.name.endswith(ids[name]) for p in (run / "wandb").glob("offline-run-*")), name
    assert ids["a"] != ids["b"]          # two directories, two runs (same directory name stem differs)
    assert ids["b2"] != ids["b"]         # a replaced directory is a new run
    assert ids["b3"] == ids["b2"]        # a resumed run continues the same wandb run


def test_model_vocabulary_follows_a_uint32_dataset(tmp_path, monkeypatch):
    from tests.data.test_formats import DOCS, use_big_vocab
    import data.prepare as dp

    use_big_vocab(monkeypatch)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 20))
    dp.prepare_text(tmp_path / "ds", [tmp_path / "docs.jsonl"], tokenizer="big70k", val_fraction=0, val_shards=1,
                    shard_tokens=512, num_proc=1, cache_dir=str(tmp_path / "hf"))
    run = tmp_path / "run"
    train(1, run, f"data.dataset={tmp_path / 'ds'}", "data.batch_size=2", "data.seq_len=32", "train.max_steps=3")
    assert torch.load(run / "ckpt" / "step_000003" / "model.pt")["transformer.wte.weight"].shape[0] == 70016
    assert records(run, "val_loss")


def test_multiple_choice_eval_at_eval_steps(tmp_path):
    run = tmp_path / "run"
    fixture = ROOT / "tests" / "fixtures" / "hellaswag_mini.jsonl"
    train(2, run, "train.max_steps=4", "train.eval_every=2", f"train.mc_eval_file={fixture}")
    evals = records(run, "mc_acc")
    assert [r["step"] for r in evals] == [2, 4]
    n_items = sum(1 for line in fixture.read_text().splitlines() if line.strip())
    assert all(r["mc_items"] == n_items and 0 <= r["mc_acc"] <= 1 and 0 <= r["mc_acc_norm"] <= 1 for r in evals)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "a", "label": 0}\n')
    proc = _run1(tmp_path / "run2", "train.max_steps=2", f"train.mc_eval_file={bad}")
    assert proc.returncode == 2 and "train.mc_eval_file" in proc.stderr and "endings" in proc.stderr
    assert not (tmp_path / "run2").exists()  # the run directory is made only after config and data pass


def test_wandb_payload_groups_panels():
    from trainer.logger import wandb_payload

    rec = {"step": 3, "train_loss": 2.5, "data_ms": 1.0, "fwdbwd_ms": 10.0, "coll_ms": 4.0, "pack_ms": 2.0,
           "opt_ms": 3.0, "comm_bytes": 1000, "diag/sign_match": 0.9, "diag/momentum_spread/block/0": 0.1,
           "diag/sign_flip/tensor/lm_head.weight": 0.01, "params_identical": True}
    p = wandb_payload(rec)
    assert p["loss/train"] == 2.5 and p["comm/bytes_sent"] == 1000 and "step" not in p
    assert [p[f"step_time_stacked_ms/{n}"] for n in ("1_data", "2_+fwd_bwd", "3_+collectives", "4_+pack",
                                                     "5_+optimizer")] == [1.0, 11.0, 15.0, 17.0, 20.0]
    assert p["diag/sign_match"] == 0.9 and p["diag_momentum_spread/block.0"] == 0.1
    assert p["diag_sign_flip/tensor.lm_head.weight"] == 0.01 and "params_identical" not in p
    # an event record's numbers go to their own section, not beside the training charts
    ev = wandb_payload({"step": 0, "event": "kernels", "compile_s": 1.5, "choices": {}})
    assert ev == {"events/kernels.compile_s": 1.5}
    assert wandb_payload({"step": 9, "event": "finish", "finish_comm_bytes": 12, "train_loss": 2.0}) == {
        "events/finish.finish_comm_bytes": 12, "events/finish.train_loss": 2.0}


def test_resume_with_more_steps_keeps_the_schedule_unless_told(tmp_path):
    from trainer.schedule import lr_at

    kept, stretched = tmp_path / "kept", tmp_path / "stretched"
    for run in (kept, stretched):
        assert _run1(run, "train.max_steps=4", "optim.schedule=linear", "optim.min_lr_ratio=0.25").returncode == 0
    more = _run1(kept, "train.max_steps=6", "optim.schedule=linear", "optim.min_lr_ratio=0.25", "train.resume=auto")
    assert more.returncode == 0, more.stderr[-2000:]
    assert "train.max_steps=6 but this run's lr schedule ends at step 4" in more.stdout
    lrs = {r["step"]: r["lr"] for r in records(kept, "train_loss")}
    # default.yaml's warmup_fraction 0.0667 gives no warmup step at 4 steps (nor at 6)
    assert [lrs[s] for s in range(1, 7)] == [lr_at(s, 1e-3, 4, 0, "linear", 0.25) for s in range(6)]
    assert lrs[5] == lrs[6] == 0.25e-3  # past the kept horizon: the final lr, not a re-stretched decay
    again = _run1(stretched, "train.max_steps=6", "optim.schedule=linear", "optim.min_lr_ratio=0.25",
                  "optim.schedule_steps=6", "train.resume=auto")
    assert again.returncode == 0 and "schedule ends" not in again.stdout
    lrs = {r["step"]: r["lr"] for r in records(stretched, "train_loss")}
    assert [lrs[5], lrs[6]] == [lr_at(s, 1e-3, 6, 0, "linear", 0.25) for s in (4, 5)]
    assert lrs[6] > 0.25e-3


def test_fine_tuning_from_an_export_or_a_run_starts_at_its_val_loss(tmp_path):
    from model.export import main as export_main

    base = tmp_path / "base"
    assert _run1(base, "train.max_steps=3", "model.n_layer=1", "model.n_kv_head=1").returncode == 0
    final = records(base, "val_loss")[-1]
    assert final["step"] == 3
    assert export_main([str(base), "--out", str(tmp_path / "export")]) == 0
    for name, source in (("from_export", tmp_path / "export"), ("from_run", base)):
        run = tmp_path / name
        proc = _run1(run, "train.max_steps=1", f"model.init_from={source}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        first = records(run, "val_loss")[0]
        assert first["step"] == 0 and abs(first["val_loss"] - final["val_loss"]) < 1e-5, (name, first, final)
        shape = yaml.safe_load((run / "config.yaml").read_text())["model"]
        assert (shape["n_layer"], shape["n_head"], shape["n_kv_head"], shape["n_embd"]) == (1, 2, 1, 64)
    # a shape key that contradicts the source is an error naming it, before any run directory exists
    bad = _run1(tmp_path / "bad", "train.max_steps=1", f"model.init_from={tmp_path / 'export'}", "model.n_layer=2")
    assert bad.returncode == 2 and "model.n_layer: 2, but model.init_from" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "bad").exists()


def test_data_mix_trains_and_resumes_exactly(tmp_path):
    from data import resolve_dataset

    builtin = resolve_dataset("builtin")  # the same corpus under a second name: a two-source mix
    mix = f"data.mix={{builtin: 2, {builtin}: 1}}"
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _run1(straight, "train.max_steps=4", mix).returncode == 0
    assert _run1(split, "train.max_steps=4", "train.stop_after=2", mix).returncode == 0
    again = _run1(split, "train.max_steps=4", "train.resume=auto", mix)
    assert again.returncode == 0, again.stderr[-2000:]
    loss = {run: [r["train_loss"] for r in records(run, "train_loss")] for run in (straight, split)}
    assert len(loss[straight]) == 4 and loss[split][-2:] == loss[straight][-2:]
    state = torch.load(split / "ckpt" / "step_000004" / "rank_00000.pt", weights_only=False)["loader"]
    assert [(s["dataset"], s["taken"]) for s in state["mix"]] == [("builtin", 3), (str(builtin), 1)]
    other = _run1(split, "train.max_steps=6", "train.resume=auto", f"data.mix={{builtin: 1, {builtin}: 1}}")
    assert other.returncode == 2 and "data.mix" in other.stderr


def test_shuffled_data_order_trains_resumes_exactly_and_reads_other_text(tmp_path):
    """data.order=shuffled end to end on 2 ranks: a resumed run repeats the straight run's losses bit for bit,
    and its losses differ from the sequential order's (the batches hold other windows)."""
    mode = ["optim.name=lion", "comm.mode=onebit", "train.max_steps=6", "data.order=shuffled"]
    train(2, tmp_path / "straight", *mode)
    train(2, tmp_path / "split", *mode, "train.stop_after=3")
    train(2, tmp_path / "split", *mode, "train.resume=auto")
    a = [r["train_loss"] for r in records(tmp_path / "straight", "train_loss")]
    b = [r["train_loss"] for r in records(tmp_path / "split", "train_loss")]
    assert len(a) == 6 and a == b
    assert records(tmp_path / "straight", "params_identical")[-1]["params_identical"]
    train(2, tmp_path / "seq", *mode[:-1])
    seq = [r["train_loss"] for r in records(tmp_path / "seq", "train_loss")]
    assert seq[0] != a[0]
    assert yaml.safe_load((tmp_path / "straight" / "config.yaml").read_text())["data"]["order"] == "shuffled"


def test_a_mix_of_two_tokenizers_of_one_vocabulary_size_is_refused(tmp_path):
    """data.mix's sources must share data.dataset's tokenizer: two tokenizer.json files of 8192 ids passed
    the vocabulary-size check; their manifests (sha256) tell them apart. One tokenizer passes."""
    import json

    import numpy as np

    from data.shards import shard_name, write_shard
    from trainer.config import ConfigError, load_config
    from trainer.dist import DistInfo
    from trainer.inputs import resolve_data

    for name, sha in (("a", "aa"), ("b", "bb"), ("c", "aa")):
        d = tmp_path / name
        d.mkdir()
        for split in ("train", "val"):
            write_shard(d / shard_name(split, 0), np.arange(300, dtype=np.uint16))
        (d / "manifest.json").write_text(json.dumps({"tokenizer": {"name": "tokenizer.json", "sha256": sha * 32,
                                                                   "n_vocab": 8192}}))
    info = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")
    cfg = load_config(["configs/default.yaml"], [f"data.dataset={tmp_path / 'a'}", f"data.mix={{{tmp_path / 'b'}: 1}}"])
    with pytest.raises(ConfigError, match=r"data.mix: \['.*b'\] were prepared with another tokenizer than data.dataset"):
        resolve_data(cfg, info)
    ok = load_config(["configs/default.yaml"], [f"data.dataset={tmp_path / 'a'}", f"data.mix={{{tmp_path / 'c'}: 1}}"])
    assert resolve_data(ok, info)[1] == {str(tmp_path / "c"): tmp_path / "c"}
