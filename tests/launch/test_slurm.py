"""launch/slurm/train.sbatch on a real one-node Slurm cluster (tests/launch/slurm_cluster.py), CPU + gloo.

The cluster (munged, slurmctld, slurmd) lives in a temp dir for this module and is killed by PID
afterwards; the tests skip, saying why, only where it cannot exist (not root, or the Debian
packages munge/slurmctld/slurmd/slurm-client are not installed - .ci/run installs them).
The script's network-profile and rendezvous logic is also checked without Slurm (dry run).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.dist import free_port
from tests.launch.slurm_cluster import TERMINAL_STATES, SlurmCluster, missing_requirements

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
# The tiny model with small batches: a few steps take seconds on a shared 2-core CPU.
TINY = ["model.preset=debug", "data.batch_size=4", "data.seq_len=64", "train.eval_steps=2",
        "train.log_every=1", "log.wandb=disabled"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing_requirements()
    if why:
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield c
    finally:
        c.close()


def _submit(cluster: SlurmCluster, tmp: Path, *overrides: str, out_name: str = "job.out",
            **env: str) -> tuple[int, Path]:
    out = tmp / out_name
    job_env = {"GPUS": "cpu", "CPU_PROCS": "2", "RDZV_PORT": str(free_port()),
               "WANDB_MODE": "disabled", **env}
    job_env = {k: v for k, v in job_env.items() if v is not None}
    if subprocess.run(["getent", "ahostsv4", cluster.node], capture_output=True).returncode != 0:
        job_env["HEAD_IP"] = "127.0.0.1"   # a CI container whose hostname does not resolve
    job_id = cluster.sbatch(SBATCH, "configs/default.yaml", *TINY, f"train.out_dir={tmp / 'run'}", *overrides,
                            options=["--nodes=1", f"--cpus-per-task={cluster.cpus}", f"--output={out}",
                                     "--job-name=lctest"],
                            env=job_env, cwd=ROOT)
    return job_id, out


def _records(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]


def _explain(cluster: SlurmCluster, out: Path) -> str:
    job_out = out.read_text(errors="replace")[-6000:] if out.exists() else "(no job output)"
    return f"--- job output ---\n{job_out}\n{cluster.logs()}"


def test_sbatch_trains_tiny_model(cluster, tmp_path):
    job_id, out = _submit(cluster, tmp_path, "train.max_steps=4")
    info = cluster.wait(job_id, timeout=120)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _explain(cluster, out)
    log = out.read_text()

    # the launch line: one torchrun per node, c10d rendezvous on the first node, 2 CPU ranks
    cmd = next(l for l in log.splitlines() if l.startswith("+ srun "))
    assert "--ntasks-per-node=1" in cmd and f"--cpus-per-task={cluster.cpus}" in cmd
    assert "--nnodes=1:1" in cmd and "--max-restarts=0" in cmd and "--nproc_per_node=2" in cmd and "--rdzv_backend=c10d" in cmd
    assert re.search(rf"--rdzv_endpoint=[\d.]+:\d+ --rdzv_id={job_id}\b", cmd), cmd
    assert "train.device=cpu" in cmd and cmd.rstrip().endswith("train.resume=auto"), cmd   # a new run (checked free)
    assert f"job {job_id} restart 0 (a new run)" in log
    assert f"OMP_NUM_THREADS={max(1, cluster.cpus // 2)} " in log
    assert "NCCL_DEBUG=WARN" in log and "NCCL_IB_DISABLE=0" in log   # default profile ib
    assert "gloo world 2 on cpu" in log, _explain(cluster, out)

    run = tmp_path / "run"
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["preset"] == "debug" and cfg["train"]["max_steps"] == 4
    assert cfg["train"]["device"] == "cpu" and cfg["train"]["resume"] == "auto"
    recs = _records(run)
    train = [r for r in recs if "train_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    # an untrained GPT over a 50k vocabulary starts near ln(50304) = 10.8
    assert all(math.isfinite(r["train_loss"]) and 5 < r["train_loss"] < 12 for r in train), train
    assert all(r["step_ms"] > 0 and r["comm_bytes"] > 0 for r in train), train
    assert any("val_loss" in r and r["step"] == 4 for r in recs), recs
    assert any(r.get("params_identical") is True for r in recs), recs
    ckpts = list((run / "ckpt").iterdir())
    assert ckpts, "no checkpoint written under ckpt/"


def test_usr1_requeues_and_resumes_then_term_checkpoints(cluster, tmp_path):
    """The preemption paths, end to end.

    USR1 (what --signal=B:USR1@120 sends before the time limit): the script forwards it, the
    trainer checkpoints at step k, the script requeues the job and the rerun resumes at k.
    Then scancel (SIGTERM to every process, as on preemption): the trainer checkpoints at j > k
    and the job ends CANCELLED without another requeue. max_steps is out of reach on purpose, so
    no step of this depends on how fast the machine is.
    """
    job_id, out = _submit(cluster, tmp_path, "train.max_steps=100000")
    run = tmp_path / "run"

    def wait_for_train_record(after_step: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while True:
            recs = _records(run) if (run / "metrics.jsonl").exists() else []
            if any("train_loss" in r and r["step"] > after_step for r in recs):
                return
            assert cluster.job(job_id)["JobState"] not in TERMINAL_STATES, _explain(cluster, out)
            assert time.monotonic() < end, f"no train record after step {after_step}\n" + _explain(cluster, out)
            time.sleep(0.2)

    # signal only once the trainer's handlers are installed (before its first train record)
    wait_for_train_record(0)
    cluster.run("scancel", "--batch", "--signal=USR1", str(job_id))   # the batch shell only, like B:

    # Slurm holds a requeued job back for cred_expire (120 s) so that no credential of the old
    # run is reused. Start it sooner, but not in the second slurmd revoked the old one (a
    # credential from that same second counts as revoked: the job would fail to launch).
    end = time.monotonic() + 120
    while True:
        info = cluster.job(job_id)
        if info["JobState"] == "PENDING" and info.get("Restarts") == "1":
            cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+3")
            break
        assert info["JobState"] not in TERMINAL_STATES, _explain(cluster, out)
        assert time.monotonic() < end, f"job not requeued (state {info['JobState']})\n" + _explain(cluster, out)
        time.sleep(0.2)
    end = time.monotonic() + 120
    while not re.search(r"resumed from \S+ at step \d+", out.read_text()):
        assert cluster.job(job_id)["JobState"] not in TERMINAL_STATES, _explain(cluster, out)
        assert time.monotonic() < end, "requeued job did not resume\n" + _explain(cluster, out)
        time.sleep(0.2)
    log = out.read_text()
    k = int(re.search(r"stopping \(signal 10\) at step (\d+)", log).group(1))
    assert int(re.search(r"resumed from \S+ at step (\d+)", log).group(1)) == k
    assert (run / "ckpt" / f"step_{k:06d}").exists(), sorted(p.name for p in (run / "ckpt").iterdir())
    assert "requeueing job" in log and f"job {job_id} restart 1 " in log

    wait_for_train_record(k)
    cluster.run("scancel", str(job_id))
    info = cluster.wait(job_id, timeout=90)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "1"), _explain(cluster, out)
    log = out.read_text()
    stopped = re.search(r"stopping \(signal 15\) at step (\d+)", log)
    assert stopped, _explain(cluster, out)
    j = int(stopped.group(1))
    assert j > k and (run / "ckpt" / f"step_{j:06d}").exists(), (k, j)
    assert log.count("requeueing job") == 1, _explain(cluster, out)
    # the rerun continued the log where the checkpoint left it: every step once, in order
    train_steps = [r["step"] for r in _records(run) if "train_loss" in r]
    assert train_steps == list(range(1, j + 1)), train_steps


def _dry_run(tmp_path: Path, nodes: str = "nodeA", *overrides: str, **env: str) -> subprocess.CompletedProcess:
    """The script outside Slurm with DRY_RUN=1: fake job variables, a stub scontrol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "scontrol"
    stub.write_text("#!/bin/sh\n# show hostnames LIST: one name per comma\necho \"$3\" | tr , '\\n'\n")
    stub.chmod(0o755)
    n = len(nodes.split(","))
    full = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "GLOO_"))},
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "DRY_RUN": "1",
            "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": nodes, "SLURM_NNODES": str(n),
            "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_CPUS_PER_TASK": "16", "HEAD_IP": "10.1.2.3", **env}
    overrides = overrides or (f"train.out_dir={tmp_path / 'run'}",)
    return subprocess.run(["bash", str(SBATCH), "configs/default.yaml", "train.max_steps=9", *overrides], env=full,
                          capture_output=True, text=True, timeout=60)


def test_sbatch_profiles_and_rendezvous_dry_run(tmp_path):
    ib = _dry_run(tmp_path, nodes="nodeA,nodeB", GPUS="4")
    assert ib.returncode == 0, ib.stderr
    assert "--nnodes=2:2 --nproc_per_node=4" in ib.stdout and "--rdzv_endpoint=10.1.2.3:" in ib.stdout
    assert "OMP_NUM_THREADS=4 " in ib.stdout      # 16 CPUs of the node's task shared by 4 ranks
    assert "NCCL_IB_DISABLE=0" in ib.stdout and "NCCL_IB_HCA" not in ib.stdout
    assert "train.device=cpu" not in ib.stdout and "train.max_steps=9" in ib.stdout

    # elastic: restarts, and continuing on the nodes that remain (srun must not kill the step)
    el = _dry_run(tmp_path, nodes="nodeA,nodeB,nodeC", GPUS="4", MAX_RESTARTS="2", MIN_NODES="2")
    assert el.returncode == 0, el.stderr
    assert "--nnodes=2:3 " in el.stdout and "--max-restarts=2 " in el.stdout and "--kill-on-bad-exit=0" in el.stdout
    assert "train.resume=auto" in el.stdout
    assert "--kill-on-bad-exit=1" in ib.stdout
    bad_min = _dry_run(tmp_path, nodes="nodeA,nodeB", GPUS="4", MIN_NODES="3")
    assert bad_min.returncode == 2 and "MIN_NODES must be between 1 and the job's 2 node(s)" in bad_min.stderr
    # ... refused before the job starts for a mode whose state cannot move to fewer ranks (DiLoCo, error
    # feedback: every restart on fewer nodes would fail on resume); accepted with the world held fixed
    out = f"train.out_dir={tmp_path / 'run'}"
    for mode, more in (("diloco", ["comm.diloco.inner_steps=3"]), ("loco", [])):
        el = _dry_run(tmp_path, "nodeA,nodeB,nodeC", out, f"comm.mode={mode}", *more, GPUS="4", MAX_RESTARTS="2",
                      MIN_NODES="2")
        assert el.returncode == 2 and "+ srun" not in el.stdout, el.stdout
        assert f"comm.mode={mode} keeps per-rank exchange state" in el.stderr and "MIN_NODES" in el.stderr, el.stderr
        fixed = _dry_run(tmp_path, "nodeA,nodeB,nodeC", out, f"comm.mode={mode}", *more, GPUS="4", MAX_RESTARTS="2")
        assert fixed.returncode == 0, fixed.stderr
    # a shard group wider than a node: refused before the job starts (the ranks' mesh would refuse it)
    wide = _dry_run(tmp_path, "nodeA,nodeB", out, "parallel.shard_size=8", GPUS="4")
    assert wide.returncode == 2 and "+ srun" not in wide.stdout, wide.stdout
    assert "parallel.shard_size: 8 does not divide the ranks per node (4)" in wide.stderr, wide.stderr
    assert _dry_run(tmp_path, "nodeA,nodeB", out, "parallel.shard_size=4", GPUS="4").returncode == 0

    # the profile wins over NCCL_IB_* values exported by the submitting shell
    eth = _dry_run(tmp_path, GPUS="4", NET_PROFILE="ethernet", NCCL_SOCKET_IFNAME="eth1", NCCL_IB_HCA="mlx5_1")
    assert eth.returncode == 0, eth.stderr
    assert "NCCL_IB_DISABLE=1" in eth.stdout and "NCCL_SOCKET_IFNAME=eth1" in eth.stdout
    assert "NCCL_IB_HCA" not in eth.stdout
    assert "GLOO_SOCKET_IFNAME=eth1" in eth.stdout

    one = _dry_run(tmp_path, GPUS="4", NET_PROFILE="ib-1nic", IB_HCA="mlx5_3", NCCL_IB_DISABLE="1")
    assert one.returncode == 0, one.stderr
    assert "NCCL_IB_HCA==mlx5_3" in one.stdout and "NCCL_IB_DISABLE=0" in one.stdout, one.stdout

    bad = _dry_run(tmp_path, GPUS="4", NET_PROFILE="wifi")
    assert bad.returncode == 2 and "unknown NET_PROFILE 'wifi'" in bad.stderr and "ethernet" in bad.stderr

    # a multi-node job must not hand the other nodes a loopback rendezvous address
    loop = _dry_run(tmp_path, nodes="nodeA,nodeB", GPUS="4", HEAD_IP="127.0.1.1")
    assert loop.returncode == 2 and "loopback 127.0.1.1" in loop.stderr, loop.stderr

    # GPUs per node: Slurm's count first, else what nvidia-smi lists, else a clear error
    assert "--nproc_per_node=8" in _dry_run(tmp_path, SLURM_GPUS_ON_NODE="8").stdout
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: H100 (UUID: a)'\necho 'GPU 1: H100 (UUID: b)'\necho 'GPU 2: H100 (UUID: c)'\n")
    smi.chmod(0o755)
    assert "--nproc_per_node=3" in _dry_run(tmp_path).stdout
    smi.write_text("#!/bin/sh\nexit 9\n")
    none = _dry_run(tmp_path)
    assert none.returncode == 2 and "no GPUs found" in none.stderr and "GPUS=cpu" in none.stderr, none.stderr

    cpu = _dry_run(tmp_path, GPUS="cpu", CPU_PROCS="3", SLURM_CPUS_PER_TASK="2")
    assert cpu.returncode == 0, cpu.stderr
    assert "--nproc_per_node=3" in cpu.stdout and "train.device=cpu" in cpu.stdout
    assert "OMP_NUM_THREADS=1 " in cpu.stdout     # never 0 threads when ranks outnumber CPUs


def _port(p: subprocess.CompletedProcess) -> int:
    return int(re.search(r"--rdzv_endpoint=[\d.]+:(\d+) ", p.stdout).group(1))


def test_sbatch_rendezvous_port_is_per_job_and_free(tmp_path):
    import socket

    a = _dry_run(tmp_path, SLURM_JOB_ID="123", GPUS="cpu")
    b = _dry_run(tmp_path, SLURM_JOB_ID="124", GPUS="cpu")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    # from the job id, below the ephemeral ports: two jobs on one node get two ports
    assert 10000 <= _port(a) < 30000 and _port(a) != _port(b)
    with socket.socket() as s:  # the job's port is taken on this (head) node: the next free one
        s.bind(("", _port(a)))
        s.listen()
        c = _dry_run(tmp_path, SLURM_JOB_ID="123", GPUS="cpu")
        assert c.returncode == 0 and _port(c) != _port(a) and 10000 <= _port(c) < 30000, c.stdout
    assert _port(_dry_run(tmp_path, SLURM_JOB_ID="123", GPUS="cpu", RDZV_PORT="31111")) == 31111
    bad = _dry_run(tmp_path, GPUS="cpu", RDZV_PORT="http")
    assert bad.returncode == 2 and "RDZV_PORT must be a port number, got 'http'" in bad.stderr


def test_sbatch_continues_a_run_only_when_asked(tmp_path):
    run = tmp_path / "run"
    out = f"train.out_dir={run}"
    new = _dry_run(tmp_path, "nodeA", out, GPUS="cpu")
    assert new.returncode == 0 and new.stdout.splitlines()[-1].rstrip().endswith("train.resume=auto"), new.stdout
    assert "(a new run)" in new.stdout
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    # resubmitted: refused as train.py refuses, before anything starts
    again = _dry_run(tmp_path, "nodeA", out, GPUS="cpu")
    assert again.returncode == 2 and "+ srun" not in again.stdout, again.stdout
    assert f"error: run directory {run} already exists and is not empty; resubmit with RESUME=1 to continue it" \
        in again.stderr, again.stderr
    asked = _dry_run(tmp_path, "nodeA", out, GPUS="cpu", RESUME="1")
    assert asked.returncode == 0 and asked.stdout.splitlines()[-1].rstrip().endswith("train.resume=auto"), asked.stderr
    assert "(RESUME=1: continuing the run)" in asked.stdout
    # an explicit train.resume is obeyed on a submission ...
    over = _dry_run(tmp_path, "nodeA", out, "train.resume=overwrite", GPUS="cpu")
    assert over.returncode == 0 and over.stdout.splitlines()[-1].rstrip().endswith("train.resume=overwrite"), over.stderr
    # ... but a requeued job (the USR1 path, a preemption) always continues its run
    requeued = _dry_run(tmp_path, "nodeA", out, "train.resume=overwrite", GPUS="cpu", SLURM_RESTART_COUNT="1")
    assert requeued.returncode == 0, requeued.stderr
    assert requeued.stdout.splitlines()[-1].rstrip().endswith("train.resume=overwrite train.resume=auto"), requeued.stdout
    both = _dry_run(tmp_path, "nodeA", out, "train.resume=overwrite", GPUS="cpu", RESUME="1")
    assert both.returncode == 2 and "RESUME=1 continues the run, but the overrides say train.resume=overwrite" \
        in both.stderr
    assert _dry_run(tmp_path, "nodeA", out, GPUS="cpu", RESUME="yes").returncode == 2
    # a config error: one message from the check, exit 2, nothing launched
    typo = _dry_run(tmp_path, "nodeA", f"train.out_dir={tmp_path / 'other'}", "train.max_stpes=3", GPUS="cpu")
    assert typo.returncode == 2 and "train.max_stpes: unknown key; did you mean train.max_steps?" in typo.stderr
    assert "Traceback" not in typo.stderr and "+ srun" not in typo.stdout


def test_sbatch_resubmission_refused_then_continued_with_resume(cluster, tmp_path):
    job_id, out = _submit(cluster, tmp_path, "train.max_steps=2", RDZV_PORT=None)
    info = cluster.wait(job_id, timeout=120)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _explain(cluster, out)
    port = int(re.search(r"--rdzv_endpoint=[\d.]+:(\d+) ", out.read_text()).group(1))
    assert 10000 <= port < 30000   # the job's own port, not a fixed 29500

    job2, out2 = _submit(cluster, tmp_path, "train.max_steps=3", out_name="job2.out")
    info = cluster.wait(job2, timeout=120)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), _explain(cluster, out2)
    assert "resubmit with RESUME=1 to continue it" in out2.read_text(), _explain(cluster, out2)

    job3, out3 = _submit(cluster, tmp_path, "train.max_steps=3", out_name="job3.out", RESUME="1")
    info = cluster.wait(job3, timeout=120)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _explain(cluster, out3)
    assert re.search(r"resumed from \S+step_000002 at step 2", out3.read_text()), _explain(cluster, out3)
    assert [r["step"] for r in _records(tmp_path / "run") if "train_loss" in r] == [1, 2, 3]
