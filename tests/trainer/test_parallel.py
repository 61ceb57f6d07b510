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


def test_overlap_on_shards_says_to_turn_it_off_not_to_add_buckets() -> None:
    """comm.overlap=true at S > 1: the fix named is overlap=false (buckets are refused on shards too; it
    said 'set comm.bucket_mb > 0', whose error then said 'set comm.bucket_mb=0')."""
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "variants" / "lioncub_1bit.yaml", ["parallel.shard_size=2", "comm.overlap=true"])
    assert str(e.value) == (
        "1 config problem(s):\n  - comm.overlap: true with parallel.shard_size=2: FSDP already overlaps its "
        "reduce-scatter with backward and the exchange across replicas runs after it; set comm.overlap=false")


PARALLEL_CKPT = Worker("parallel_ckpt.py", "{tmp}/runs", timeout=300,
                       keep=("runs/straight", "runs/straight_params.pt"))  # test_tools_read_a_sharded_checkpoint


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


@pytest.mark.parametrize("cmd", [["-m", "bench.netsim", "--nproc", "4", "--nodes", "3", "--", "true"],
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


def test_remesh_reads_one_old_replica_at_a_time() -> None:
    """remesh_optimizer_state indexes the saved states (trainer/state.py's RankStates loads a rank's
    file when it is read): with the replica count unchanged it reads only its own old replica's
    ranks; with another count it folds the replicas into their mean one at a time, so besides the
    replica being read only old rank 0's state stays alive (it held every old rank's at once)."""
    import weakref
    from collections.abc import Sequence

    import torch

    from trainer.sharded_checkpoint import remesh_optimizer_state

    gen = torch.Generator().manual_seed(1)
    M = [torch.randn(6, 4, generator=gen) for _ in range(3)]  # three old replicas of two shard ranks

    class Saved(Sequence):
        def __init__(self):
            self.read, self.alive, self.peak = [], [], 0

        def __len__(self):
            return 6

        def __getitem__(self, q):
            if not 0 <= q < 6:
                raise IndexError(q)
            self.peak = max(self.peak, sum(ref() is not None for ref in self.alive))
            r, j = divmod(q, 2)
            m = M[r][3 * j:3 * j + 3].clone()
            self.read.append(q)
            self.alive.append(weakref.ref(m))
            return {"state": {0: {"exp_avg": m, "step": torch.tensor(2.0)}}, "param_groups": [{"params": [0]}],
                    "comm": {"step": 2, "world_size": 3, "rank": r}}

    same = Saved()
    out = remesh_optimizer_state(same, 2, 1, 3, 1, 0, 1)  # 3 x 2 -> 3 x 1: replica 1 keeps its own
    assert sorted(set(same.read)) == [2, 3], same.read
    assert torch.equal(out["state"][0]["exp_avg"], M[1]) and out["comm"]["rank"] == 1
    fewer = Saved()
    out = remesh_optimizer_state(fewer, 2, 2, 1, 0, 1, 0)  # 3 x 2 -> 1 x 2: the replicas' mean, chunk 1
    assert sorted(set(fewer.read)) == list(range(6))
    want = (M[0] + M[1] + M[2]) / 3  # fp32 sum in replica order, divided by the count
    assert torch.equal(out["state"][0]["exp_avg"], want[3:])
    assert fewer.peak <= 2, fewer.peak  # old rank 0 and the other rank of the replica being read
    assert torch.equal(remesh_optimizer_state([fewer[q] for q in range(6)], 2, 2, 1, 0, 1, 0)["state"][0]["exp_avg"],
                       want[3:])  # a plain list reads the same


def test_remesh_refusals_say_which_state_cannot_move() -> None:
    """A state the remesh cannot map is refused with its reason: an exchange's per-rank state (DiLoCo's
    outer state, error feedback) by the exchange's keys, an optimizer's own flat-layout entries by theirs."""
    import torch

    from trainer.sharded_checkpoint import remesh_optimizer_state

    base = {"state": {0: {"momentum": torch.zeros(4)}}, "param_groups": [{"params": [0]}]}
    outer = {**base, "comm": {"step": 3, "exchange": {"global": torch.zeros(4), "outer_momentum": torch.zeros(4)}}}
    with pytest.raises(ValueError, match=r"exchange keeps per-rank state sized for the saved mesh \(global, "
                                         r"outer_momentum: error feedback, or a local-update scheme's outer state"):
        remesh_optimizer_state([outer] * 4, 2, 1, 4, 0, 0, 0)
    frozen = {**base, "frozen": torch.zeros(4), "comm": {"step": 3}}
    with pytest.raises(ValueError, match=r"holds \['frozen'\], which is laid out over the saved mesh's flat vector"):
        remesh_optimizer_state([frozen] * 4, 2, 1, 4, 0, 0, 0)

    class Remaps:  # an exchange whose state moves (pbit's generator): this run's exchange says what the rank keeps
        remaps_state = True
        seen = []

        def reshard_state(self, states):
            self.seen.append(states)
            return {"rng_state": "fresh"}

    gen = {**base, "comm": {"step": 3, "exchange": {"rng_state": "old"}}}
    out = remesh_optimizer_state([gen] * 4, 2, 1, 4, 0, 0, 0, exchange=Remaps())
    assert out["comm"]["exchange"] == {"rng_state": "fresh"} and Remaps.seen == [[{"rng_state": "old"}] * 4]  # 2 replicas -> 4: every old rank read
    assert out["comm"]["world_size"] == 4 and torch.equal(out["state"][0]["momentum"], torch.zeros(8))
    with pytest.raises(ValueError, match=r"exchange Remaps keeps per-rank state"):  # one that does not remap
        Remaps.remaps_state = False
        remesh_optimizer_state([gen] * 4, 2, 1, 4, 0, 0, 0, exchange=Remaps())
    Remaps.remaps_state, Remaps.seen = True, []  # the same replica count: the old replica's two ranks, read
    remesh_optimizer_state([{**gen, "comm": {"step": 3, "exchange": {"rng_state": q}}} for q in range(4)],
                           2, 1, 2, 1, 0, 1, exchange=Remaps())
    assert Remaps.seen == [[{"rng_state": 2}, {"rng_state": 3}]]


def test_pbit_remaps_its_generator_and_refuses_another_mode_s_state() -> None:
    """PBit.reshard_state: a fresh stream from its own generator, whatever the old ranks held; a saved state
    that is not a generator's (loco's error feedback after a comm.mode change) is refused, not dropped."""
    import types

    import torch

    from optim.sync.pbit import PBit

    me = types.SimpleNamespace(gen=torch.Generator().manual_seed(5))
    old = {"rng_state": torch.Generator().manual_seed(9).get_state()}
    assert torch.equal(PBit.reshard_state(me, [old, old])["rng_state"], torch.Generator().manual_seed(5).get_state())
    with pytest.raises(ValueError, match=r"holds \['error'\], another mode's; resume with the comm.mode"):
        PBit.reshard_state(me, [{"error": torch.zeros(3)}])


def test_remesh_moves_state_between_shard_dims() -> None:
    """remesh_optimizer_state joins each saved tensor along the dimension the saved state names
    ("shard_dims") and cuts the new rank's chunk along the one the new optimizer names: a Dion matrix
    (8, 6) on its columns at S = 2 (Q's side: M split on dim 1, Q's rows on dim 0) and on its rows at
    S = 4 (6 columns do not split evenly over 4: M on dim 0, Q whole on every rank), 2 replicas -> 1
    (the per-replica momenta averaged once); a vector of 5 (unlisted: dim 0, chunks 3 + 2 -> 2 + 2 + 1 + 0)."""
    import torch

    from trainer.sharded_checkpoint import remesh_optimizer_state

    gen = torch.Generator().manual_seed(0)
    M = [torch.randn(8, 6, generator=gen) for _ in range(2)]  # one momentum per old replica
    v = [torch.randn(5, generator=gen) for _ in range(2)]
    Q = torch.randn(6, 2, generator=gen)  # identical on every rank

    def saved(replica: int, j: int) -> dict:  # old rank 2 * replica + j
        return {"state": {0: {"momentum": M[replica][:, 3 * j:3 * j + 3].clone(), "Q": Q[3 * j:3 * j + 3].clone()},
                          1: {"exp_avg": v[replica][3 * j:3 * j + 3].clone(), "step": torch.tensor(3.0)}},
                "param_groups": [{"params": [0, 1]}], "comm": {"step": 3, "world_size": 2, "rank": replica},
                "shard_dims": {0: {"momentum": 1, "Q": 0}}}

    states = [saved(r, j) for r in range(2) for j in range(2)]
    mean_M, mean_v = torch.stack(M).mean(0), torch.stack(v).mean(0)
    for j in range(4):
        out = remesh_optimizer_state(states, 2, 4, 1, 0, j, 0, dims={0: {"momentum": 0, "Q": None}})
        assert torch.equal(out["state"][0]["momentum"], mean_M[2 * j:2 * j + 2])
        assert torch.equal(out["state"][0]["Q"], Q)
        assert torch.equal(out["state"][1]["exp_avg"], mean_v[2 * j:2 * j + 2])
        assert float(out["state"][1]["step"]) == 3.0
        assert "shard_dims" not in out and out["comm"]["world_size"] == 1
    # and back: S = 4 rows -> S = 2 columns, one replica kept as is
    back = [remesh_optimizer_state(states, 2, 4, 1, 0, j, 0, dims={0: {"momentum": 0, "Q": None}}) for j in range(4)]
    for s in back:
        s["shard_dims"] = {0: {"momentum": 0, "Q": None}}
    for j in range(2):
        out = remesh_optimizer_state(back, 4, 2, 1, 0, j, 0, dims={0: {"momentum": 1, "Q": 0}})
        assert torch.equal(out["state"][0]["momentum"], mean_M[:, 3 * j:3 * j + 3])
        assert torch.equal(out["state"][0]["Q"], Q[3 * j:3 * j + 3])
