"""Hybrid sharding (trainer/parallel.py, parallel.shard_size): 4 gloo ranks in tests/workers/
parallel_dist.py (fp32 sync at S = 2, 4 equals the replicated run; onebit at S = 2 equals the
hierarchical vote with 2 ranks per node; the other modes run with the formula's bytes; replicas
bit-identical every step; the memory model within 15 %), tests/workers/parallel_ckpt.py (DCP
checkpoints: exact resume, per-replica momenta, a damaged shard file -> the previous checkpoint),
and the config errors (muon and dion on the mesh: tests/optim/test_mesh_optim.py)."""
from __future__ import annotations

import pytest

from tests.checks import Worker
from tests.dist import ROOT
from trainer.config import ConfigError, load_config, validate

PARALLEL_DIST = Worker("parallel_dist.py", "{tmp}/runs", timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,check", PARALLEL_DIST.cases([4]))
def test_sharded_equals_replicated(nproc, check) -> None:
    PARALLEL_DIST.check(nproc, check)


@pytest.mark.parametrize("variant,overrides,message", [
    ("lioncub_1bit", ["parallel.shard_size=3"], "parallel.shard_size: 3 does not divide the world size 4"),
    ("lioncub_1bit", ["parallel.shard_size=0"], "parallel.shard_size: 0 must be >= 1"),
    ("lioncub_hier", ["parallel.shard_size=2"], "comm.mode=hierarchical does not run across replicas"),
    ("lion_fp32", ["parallel.shard_size=2", "comm.bucket_mb=1"], "comm.bucket_mb"),
    ("lion_fp32", ["parallel.shard_size=2", "train.mc_eval_file=items.jsonl"], "train.mc_eval_file"),
])
def test_config_errors_name_the_key(variant, overrides, message) -> None:
    try:
        cfg = load_config(ROOT / "configs" / "variants" / f"{variant}.yaml", overrides)
    except ConfigError as e:
        assert message in str(e), str(e)
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg, world_size=4)


PARALLEL_CKPT = Worker("parallel_ckpt.py", "{tmp}/runs", timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,check", PARALLEL_CKPT.cases([4]))
def test_sharded_checkpoint_resumes_exactly(nproc, check) -> None:
    PARALLEL_CKPT.check(nproc, check)


@pytest.mark.slow
def test_tools_read_a_sharded_checkpoint() -> None:
    """eval, sample and export read a sharded run's checkpoint: DCP shards -> whole tensors."""
    import torch

    from model import load_model

    PARALLEL_CKPT.check(4, "straight")
    runs = PARALLEL_CKPT.run(4)["tmp"] / "runs"
    loaded = load_model(runs / "straight")
    want = torch.load(runs / "straight_params.pt")
    got = dict(loaded.model.named_parameters())
    assert loaded.step == 4 and set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("cmd", [["-m", "launch.netsim", "--nproc", "4", "--nodes", "3", "--", "true"],
                                 ["-m", "bench.step_breakdown", "--nproc", "4", "--nodes", "3", "--report-only"]])
def test_nodes_must_divide_nproc(cmd) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--nodes 3 must" in out.stderr and "divide --nproc 4" in out.stderr, out.stderr


def test_shard_group_must_fit_a_node(monkeypatch) -> None:
    import torch

    from trainer.parallel import make_mesh

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"parallel.shard_size: 4 does not divide the ranks per node \(LOCAL_WORLD_SIZE=2\)"):
        make_mesh(4, 8, torch.device("cpu"))
    assert not make_mesh(1, 8, torch.device("cpu")).sharded  # S = 1 builds nothing
