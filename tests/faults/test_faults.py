"""Faults, injected on purpose: a run loses nothing and always says why (issue "Lose nothing").

Divergence guard (NaN at one step on one rank; lr 1e3), verified checkpoints with fallback
(garbled, truncated, missing files), one live run per directory, leftover temp directories, a
config error under torchrun, SIGINT, a full disk, elastic restarts after SIGKILL (bit-identical to
an uninterrupted run) and resuming on another world size.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.dist import ROOT, free_port, torchrun
from trainer.checkpoint import NonFiniteError, _rotate, save_checkpoint

TINY = ["model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.eval_steps=1", "train.log_every=1",
        "log.wandb=disabled", "optim.warmup_steps=0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run1(out: Path, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", "configs/default.yaml", *TINY, f"train.out_dir={out}",
                           *overrides], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def final_digest(run: Path) -> str:
    recs = [r for r in records(run) if "param_sha256" in r]
    assert recs and recs[-1]["params_identical"], recs
    return recs[-1]["param_sha256"][0]


# ---- divergence guard ----------------------------------------------------------------------------------
def test_lr_1e3_stops_naming_the_step_and_keeps_good_checkpoints(tmp_path):
    run = tmp_path / "run"
    proc = run1(run, "optim.lr=1e3", "train.max_steps=50", "train.ckpt_every=1", "train.keep_ckpts=1")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "non-finite loss or gradient at step" in proc.stderr and "train.on_nonfinite" in proc.stderr
    bad = next(r for r in records(run) if r.get("event") == "nonfinite")["step"]
    ckpts = sorted(p.name for p in (run / "ckpt").glob("step_*"))
    assert ckpts and int(ckpts[-1][5:]) == bad - 1  # every step before the bad one was saved, nothing after
    for d in (run / "ckpt").glob("step_*"):
        state = torch.load(d / "model.pt")
        assert all(torch.isfinite(t).all() for t in state.values()), d


@pytest.mark.parametrize("policy", ["stop", "skip_step", "rollback"])
def test_nan_on_one_rank_is_seen_by_every_rank(tmp_path, policy):
    out = tmp_path / policy
    torchrun(2, "nonfinite.py", str(out), policy, "5", "1", timeout=300)
    res = json.loads((out / "result.json").read_text())
    assert res["finite"] and res["identical"], res
    events = [r for r in records(out) if r.get("event") == "nonfinite"]
    assert [e["step"] for e in events] == [5] and events[0]["policy"] == policy
    if policy == "stop":
        assert "at step 5" in res["error"]
        assert sorted(p.name for p in (out / "ckpt").glob("step_*")) == ["step_000002", "step_000004"]
        return
    assert res["error"] is None and res["step"] == 8
    if policy == "rollback":
        state = torch.load(out / "ckpt" / "step_000008" / "rank_00000.pt", weights_only=False)
        assert state["skip_batches"] == [5]
        assert any(r.get("event") == "resume" for r in records(out)) is False  # a rollback is not a restart


def test_nonfinite_state_is_never_saved_and_rotation_keeps_the_newest_good(tmp_path):
    root = tmp_path / "ckpt"
    good = {"w": torch.ones(3)}
    save_checkpoint(root, 1, good, {"m": torch.zeros(2)}, {"step": 1, "world_size": 1}, 0, 1, keep=1)
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite values in rank 0.m"):
        save_checkpoint(root, 2, good, {"m": torch.tensor([float("nan")])}, {"step": 2, "world_size": 1}, 0, 1, 1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    # an unverified (older-format) newer checkpoint does not push the last verified one out
    (root / "step_000003").mkdir()
    (root / "step_000003" / "meta.json").write_text('{"step": 3, "world_size": 1}')
    _rotate(root, 1, root / "step_000003")
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000001", "step_000003"]


def test_rotation_sets_aside_a_step_directory_holding_a_users_file(tmp_path, capsys):
    from trainer.rundir import foreign_entries

    root = tmp_path / "ckpt"
    state = ({"w": torch.ones(3)}, {"m": torch.zeros(2)})
    save_checkpoint(root, 1, *state, {"step": 1, "world_size": 1}, 0, 1, keep=1)
    (root / "step_000001" / "plots").mkdir()
    (root / "step_000001" / "plots" / "loss.png").write_bytes(b"png")
    save_checkpoint(root, 2, *state, {"step": 2, "world_size": 1}, 0, 1, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["kept_step_000001", "latest", "step_000002"]
    assert sorted(p.name for p in (root / "kept_step_000001").iterdir()) == ["meta.json", "model.pt", "plots",
                                                                             "rank_00000.pt"]
    said = capsys.readouterr().out
    assert "step_000001 holds files no save wrote (plots/loss.png); rotated out by train.keep_ckpts" in said
    save_checkpoint(root, 3, *state, {"step": 3, "world_size": 1}, 0, 1, keep=1)  # the trainer's alone: deleted
    assert sorted(p.name for p in root.iterdir()) == ["kept_step_000001", "latest", "step_000003"]
    assert "ckpt/kept_step_000001" in foreign_entries(tmp_path)  # overwrite names it, never deletes it


def test_a_step_directory_that_cannot_be_set_aside_is_never_deleted(tmp_path, monkeypatch, capsys):
    import trainer.checkpoint as ckpt
    from trainer.checkpoint import CheckpointError

    root = tmp_path / "ckpt"
    state = ({"w": torch.ones(3)}, {"m": torch.zeros(2)})
    for step in (1, 2):
        save_checkpoint(root, step, *state, {"step": step, "world_size": 1}, 0, 1, keep=2)
    for step in (1, 2):
        (root / f"step_00000{step}" / "notes.txt").write_text("mine")

    def refuse(*_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ckpt, "set_aside_foreign", refuse)
    # a re-save of step 2 (after a fallback past it) stops instead of replacing it
    with pytest.raises(CheckpointError, match="could not write .*kept_step_000002"):
        save_checkpoint(root, 2, *state, {"step": 2, "world_size": 1}, 0, 1, keep=2)
    # rotation leaves step 1 where it is
    save_checkpoint(root, 3, *state, {"step": 3, "world_size": 1}, 0, 1, keep=2)
    assert "step_000001 holds files no save wrote and could not be moved aside" in capsys.readouterr().out
    assert all((root / f"step_00000{s}" / "notes.txt").read_text() == "mine" for s in (1, 2))


# ---- verified checkpoints ---------------------------------------------------------------------------------
def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["garble_model", "garble_rank", "truncate_rank", "missing_model",
                                    "truncate_meta"])
def test_corrupt_latest_checkpoint_falls_back_to_an_older_one(tmp_path, damage):
    run = tmp_path / "run"
    assert run1(run, "train.max_steps=4", "train.ckpt_every=2").returncode == 0
    latest = run / "ckpt" / "step_000004"
    target = {"garble_model": "model.pt", "garble_rank": "rank_00000.pt", "truncate_rank": "rank_00000.pt",
              "missing_model": "model.pt", "truncate_meta": "meta.json"}[damage]
    f = latest / target
    if damage.startswith("garble"):
        _garble(f)
    elif damage == "missing_model":
        f.unlink()
    else:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    proc = run1(run, "train.max_steps=6", "train.ckpt_every=2", "train.resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipped checkpoint step_000004: {f}" in proc.stdout
    assert "resumed from" in proc.stdout and "step_000002 at step 2" in proc.stdout
    assert final_digest(run)


def test_no_intact_checkpoint_is_a_clear_error_and_partial_saves_are_cleaned(tmp_path):
    run = tmp_path / "run"
    assert run1(run, "train.max_steps=2").returncode == 0
    _garble(run / "ckpt" / "step_000002" / "model.pt")
    (run / "ckpt" / ".tmp_step_000003").mkdir()  # a save killed half-way
    proc = run1(run, "train.max_steps=4", "train.resume=auto")
    assert proc.returncode == 2 and "no intact checkpoint" in proc.stderr and "model.pt is corrupt" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run / "ckpt" / ".tmp_step_000003").exists()


def test_full_disk_is_reported_as_such(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        proc = run1(mnt / "run", "train.max_steps=2")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "disk full while writing" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        subprocess.run(["umount", str(mnt)])


def test_metrics_are_appended_not_truncated_by_a_resume(tmp_path):
    run = tmp_path / "run"
    assert run1(run, "train.max_steps=6", "train.ckpt_every=2", "train.stop_after=3").returncode == 0
    before = (run / "metrics.jsonl").read_text()
    assert run1(run, "train.max_steps=6", "train.ckpt_every=2", "train.resume=auto").returncode == 0
    after = (run / "metrics.jsonl").read_text()
    assert after.startswith(before)
    steps = [r["step"] for r in records(run) if "train_loss" in r and "event" not in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # a stop saves a checkpoint: nothing is trained twice
    assert [r["step"] for r in records(run) if r.get("event") == "resume"] == [3]


# ---- one live run per directory --------------------------------------------------------------------------
def _start_long(run: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "train.py", "configs/default.yaml", *TINY, f"train.out_dir={run}",
                             "train.max_steps=100000", "train.ckpt_every=5"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list((run / "ckpt").glob("step_*")):
        time.sleep(0.2)
    assert (run / ".lock").is_file()
    return proc


def test_a_second_live_run_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    live = _start_long(run)
    try:
        for mode in ("auto", "overwrite"):
            proc = run1(run, "train.max_steps=3", f"train.resume={mode}")
            assert proc.returncode == 2 and f"is in use by pid {live.pid}" in proc.stderr, proc.stderr[-2000:]
        assert (run / "config.yaml").is_file() and list((run / "ckpt").glob("step_*"))  # nothing deleted
        live.send_signal(signal.SIGKILL)
        live.wait(timeout=60)
    finally:
        live.kill()
    proc = run1(run, "train.max_steps=100000", "train.stop_after=1", "train.resume=auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"took over the lock of a dead run (process {live.pid} is gone)" in proc.stdout
    assert not (run / ".lock").exists()


# ---- errors under torchrun, signals ----------------------------------------------------------------------------
@pytest.mark.slow
def test_config_error_is_shown_under_torchrun_every_time(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    def launch(_):
        proc = torchrun(2, ROOT / "train.py", "configs/default.yaml", "train.max_stpes=3", check=False, timeout=180,
                        launcher="torchrun")
        return proc.returncode != 0 and "did you mean train.max_steps" in proc.stderr + proc.stdout

    # the message used to be lost on some runs (rank 0 torn down before it printed); three launches at a time
    # overlap the other rank's pause before it reports (whether the extra load changes how often the race would
    # show is not measured: the check is 6 launches, where it was 10)
    with ThreadPoolExecutor(3) as pool:
        shown = list(pool.map(launch, range(6)))
    assert all(shown), shown


def test_sigint_checkpoints_and_a_second_one_exits_at_once(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", "configs/default.yaml", *TINY, f"train.out_dir={run}",
                             "train.max_steps=100000"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "metrics.jsonl").exists():
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "stopping (signal 2)" in out, err[-2000:]
    assert (run / "ckpt" / "latest").is_file()
    run2 = tmp_path / "run2"
    # steps of ~0.5 s (tiny model, 8 x 128 tokens), so the second Ctrl-C lands inside the step the first one
    # ends; it is sent once the first was handled (its message is read): two signals that arrive while the
    # main thread is inside one C call would reach Python as one
    slow = [a for a in TINY if not a.startswith(("model.preset", "data.batch_size", "data.seq_len"))]
    proc = subprocess.Popen([sys.executable, "train.py", "configs/default.yaml", *slow, "model.preset=tiny",
                             "data.batch_size=8", "data.seq_len=128", f"train.out_dir={run2}",
                             "train.max_steps=100000", "train.log_every=100000"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while time.time() < deadline + 120 and not (run2 / "config.yaml").exists():
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)  # the first one stops at the end of this step and checkpoints...
        first = ""
        while "received" not in first:  # lines written before it (warnings) are skipped
            line = proc.stderr.readline()
            if not line:
                break
            first = line
        proc.send_signal(signal.SIGINT)  # ...a second one before that is done leaves at once
        _, err = proc.communicate(timeout=60)
        err = first + err
    finally:
        proc.kill()
    assert "signal 2 received: checkpointing at the end of this step" in first, first
    assert proc.returncode == 130 and "a second Ctrl-C" in err, err[-2000:]


# ---- elastic restarts ------------------------------------------------------------------------------------------
def _rank_pids(agent_pid: int) -> dict[int, int]:
    """RANK -> pid of the worker processes a torchrun agent started."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(d.name)
    return out


def _elastic(run: Path, kills: int, max_steps: int, seed: int = 0) -> subprocess.CompletedProcess:
    """2 ranks under torchrun with restarts; SIGKILL a random rank `kills` times while it trains."""
    rng = random.Random(seed)
    args = [*TINY, f"train.out_dir={run}", f"train.max_steps={max_steps}", "train.ckpt_every=2",
            "train.resume=auto", "comm.init_timeout_s=20"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--nproc_per_node=2",
           # spare restarts: a restarted round that fails to form (rare since trainer/dist.py `_round_store`
           # keeps rounds apart) is started again by the launcher
           f"--max-restarts={kills + 3}", "train.py", "configs/default.yaml", *args]
    log = open(run.parent / f"{run.name}.agent.log", "w")  # for a failure's post-mortem
    agent = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # its own process group: nothing is left behind
    try:
        for k in range(kills):
            target = 2 + (k + 1) * (max_steps - 4) // (kills + 1)  # spread over the run
            deadline, pids = time.time() + 300, {}
            while time.time() < deadline:
                recs = records(run) if (run / "metrics.jsonl").exists() else []
                resumed = [i for i, r in enumerate(recs) if r.get("event") == "resume"]
                # after the k-th kill, wait for the restarted ranks to resume and train past the target
                fresh = recs[resumed[-1] + 1:] if k and len(resumed) >= k else (recs if not k else [])
                done = [r["step"] for r in fresh if "train_loss" in r]
                pids = _rank_pids(agent.pid)
                if done and done[-1] >= target and len(pids) == 2:
                    break
                time.sleep(0.1)
            assert len(pids) == 2, f"kill {k + 1}: no running ranks found before the deadline"
            victim = rng.choice(sorted(pids))
            log.write(f"\n### test: SIGKILL rank {victim} (pid {pids[victim]}) at step {done[-1]}\n")
            log.flush()
            os.kill(pids[victim], signal.SIGKILL)
        agent.wait(timeout=600)
    finally:
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
    out = (run.parent / f"{run.name}.agent.log").read_text()
    return subprocess.CompletedProcess(cmd, agent.returncode, out, out)


@pytest.mark.slow
@pytest.mark.parametrize("kills", [3])
def test_elastic_restarts_after_sigkill_end_bit_identical(tmp_path, kills):
    straight = tmp_path / "straight"
    proc = torchrun(2, ROOT / "train.py", "configs/default.yaml", *TINY, f"train.out_dir={straight}",
                    "train.max_steps=16", "train.ckpt_every=2")
    faulty = tmp_path / "faulty"
    proc = _elastic(faulty, kills, 16, seed=kills)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumes = [r for r in records(faulty) if r.get("event") == "resume"]
    assert kills <= len(resumes) <= kills + 3, resumes
    assert final_digest(faulty) == final_digest(straight)


def test_load_resharded_averages_per_rank_state_once(monkeypatch):
    import optim

    def make():
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3)
        groups = [{"params": [net.weight], "names": ["w"], "role": "mlp", "lr": 0.1, "weight_decay": 0.0,
                   "lr_mult": 1.0},
                  {"params": [net.bias], "names": ["b"], "role": "norm", "lr": 0.1, "weight_decay": 0.0,
                   "lr_mult": 1.0}]
        return net, optim.build_optimizer("lion", groups, comm_mode="pbit",
                                          comm_options={"bits": 8, "quantizer": "l1", "rounding": "stochastic"})

    states = []
    for rank in range(3):  # three "ranks" with different gradients, hence different momenta
        net, opt = make()
        for step in range(2):
            opt.zero_grad()
            net(torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * rank + step))).sum().backward()
            opt.step()
        states.append(opt.state_dict())
    net, opt = make()
    opt.load_resharded(states)
    for i, p in enumerate((net.weight, net.bias)):
        want = sum(s["state"][i]["exp_avg"] for s in states) / 3
        assert torch.equal(opt.state[p]["exp_avg"], want)
    assert opt.steps_done == 2

    # read once from an iterator (trainer/state.py loads each old rank's file as it is read): the same
    # bits, and no state but the first is alive when the next one is read (one per saved rank was held)
    alive = []
    peak = [0]

    def one_at_a_time():
        import weakref
        for s in states:
            peak[0] = max(peak[0], sum(ref() is not None for ref in alive))
            copy = {k: v for k, v in s.items() if k != "state"}
            copy["state"] = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                             for i, st in s["state"].items()}
            alive.append(weakref.ref(copy["state"][0]["exp_avg"]))
            yield copy
            del copy
    net2, opt2 = make()
    opt2.load_resharded(one_at_a_time())
    for p, q in zip((net.weight, net.bias), (net2.weight, net2.bias)):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
    assert peak[0] == 1, peak  # the first state (kept where every rank agrees), never the others

    # the same through trainer/state.py's RankStates, which loads each old rank's file when it is read
    # (Sequence's own iterator kept the last state it yielded alive while it read the next)
    import weakref

    import trainer.state as ts

    alive.clear()
    peak[0] = 0

    def load_verified(path, names):
        peak[0] = max(peak[0], sum(ref() is not None for ref in alive))
        [name] = list(names)
        s = states[int(name.split("_")[1].split(".")[0])]
        copy = {k: v for k, v in s.items() if k != "state"}
        copy["state"] = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                         for i, st in s["state"].items()}
        alive.append(weakref.ref(copy["state"][0]["exp_avg"]))
        return {name: {"optimizer": copy}}, {}
    monkeypatch.setattr(ts, "load_verified", load_verified)
    net3, opt3 = make()
    opt3.load_resharded(iter(ts.RankStates(Path("ckpt"), {"world_size": 3}, {})))
    for p, q in zip((net.weight, net.bias), (net3.weight, net3.bias)):
        assert torch.equal(opt.state[p]["exp_avg"], opt3.state[q]["exp_avg"])
    assert peak[0] == 1, peak


# ---- world-size changes --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode,before,after", [("onebit", 4, 2), ("onebit", 2, 4), ("fp32", 4, 2)])
def test_resume_on_another_world_size(tmp_path, mode, before, after):
    run = tmp_path / "run"
    common = [*TINY, f"train.out_dir={run}", "train.max_steps=6", "train.ckpt_every=2", f"comm.mode={mode}"]
    torchrun(before, ROOT / "train.py", "configs/default.yaml", *common, "train.stop_after=4")
    saved = run / "ckpt" / "step_000004"
    old = [torch.load(saved / f"rank_{r:05d}.pt", weights_only=False) for r in range(before)]
    proc = torchrun(after, ROOT / "train.py", "configs/default.yaml", *common, "train.resume=auto")
    assert f"written by {before} ranks, resumed on {after}" in proc.stdout
    # per-rank momenta (update sync) are averaged once; the state gradient sync shares is carried over
    assert ("one momentum synchronisation" if mode == "onebit" else "gradient sync) carried over") in proc.stdout
    # the data continue at the same global position: tokens = 4 steps x before x B x T, then 2 x after x B x T
    state = torch.load(run / "ckpt" / "step_000006" / "rank_00000.pt", weights_only=False)
    per_rank = 2 * 32
    assert state["loader"]["position"] == 4 * before * per_rank + 2 * after * per_rank
    # the resumed momenta were the mean of the saved ones (one momentum synchronisation)
    if mode == "onebit":  # update sync: every rank file holds its own momenta (gradient sync: rank 0's only)
        moms = [s["optimizer"]["state"][0]["exp_avg"] for s in old]
        assert not all(torch.equal(moms[0], m) for m in moms[1:])  # per-rank state really differed
    assert final_digest(run)


@pytest.mark.slow
def test_sharded_checkpoint_with_a_damaged_rank_file_falls_back_on_fewer_ranks(tmp_path):
    """A sharded run (2 x 2) resumed on 2 ranks reads all 4 old rank files (their states are joined):
    a damaged one that no rank of the new run wrote is found by its checksum before loading, and the
    previous checkpoint is used (it was a hard error: only the reading ranks' own files were checked)."""
    run = tmp_path / "run"
    common = [*TINY, f"train.out_dir={run}", "train.max_steps=6", "train.ckpt_every=2", "comm.mode=onebit",
              "parallel.shard_size=2"]
    torchrun(4, ROOT / "train.py", "configs/default.yaml", *common, "train.stop_after=4")
    damaged = run / "ckpt" / "step_000004" / "rank_00003.pt"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    proc = torchrun(2, ROOT / "train.py", "configs/default.yaml", *common, "train.resume=auto", check=False)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert f"skipped checkpoint step_000004: {damaged}" in proc.stdout, proc.stdout[-3000:]
    assert "step_000002 at step 2 (written as 2 x 2" in proc.stdout, proc.stdout[-3000:]
    assert final_digest(run)
