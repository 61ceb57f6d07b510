"""Checkpoints of a sharded run (launched by tests/trainer/test_parallel.py): 4 ranks, parallel.shard_size=2,
Lion Cub onebit. A run stopped at step 2 (train.stop_after) and resumed ends bit-identical to an
uninterrupted 4-step run; before the save the replicas' momenta differ (per-replica state) and after
the load every rank's momenta equal what it saved; every rank writes a model shard file (DCP); a
damaged shard file is found by its checksum and the previous checkpoint used, again ending exactly
where the straight run does; on another mesh (2 x 2 -> 1 x 4) every rank's momentum is its chunk of
the mean of the replicas' whole momenta; AdamW's state moves 2 x 2 -> 4 x 1 exactly; pbit's generator
moves 2 x 2 -> 4 x 1 as a fresh stream per new rank; a flat-vector
state (binsgdm) on another mesh is a config error naming the saved mesh. Each is a named check
(CHECKS; tests/workers/_checks.py records its outcome)."""
from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer.config import ConfigError, load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.logger import banner  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402
from _trainer import fit  # noqa: E402  (tests/workers/ is the script's directory)

BASE = ["model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.max_steps=4", "train.eval_every=0",
        "train.eval_steps=1", "log.wandb=disabled", "optim.lr=1e-3", "comm.kernels=eager", "train.ckpt_every=1", "train.keep_ckpts=5",
        "parallel.shard_size=2", "train.log_every=1"]
CHECKS = ("straight", "stop_and_resume_exact", "damaged_shard_falls_back", "lioncub_another_mesh",
          "adamw_another_mesh", "pbit_another_mesh", "binsgdm_refused_on_another_mesh")


def trainer(out: Path, extra: list[str], variant: str = "lioncub_1bit") -> Trainer:
    return Trainer(load_config(ROOT / f"configs/variants/{variant}.yaml", BASE + [f"train.out_dir={out}"] + extra),
                   INFO)


def momenta(tr: Trainer) -> torch.Tensor:
    return torch.cat([tr.optimizer.momentum_of(e.param).reshape(-1).clone() for e in tr.optimizer.layout.entries])


def full(tr: Trainer) -> list[torch.Tensor]:
    return [(p.full_tensor() if tr.parallel.sharded else p).detach().clone() for _, p in sorted(tr.model.named_parameters())]


def gather_entries(tr: Trainer) -> list[list[torch.Tensor]]:
    """Every rank's momentum of every layout entry (local shards), by rank."""
    mine = [tr.optimizer.momentum_of(e.param).detach().clone() for e in tr.optimizer.layout.entries]
    out = [None] * INFO.world_size
    dist.all_gather_object(out, mine)
    return out


def rows(t: torch.Tensor, shards: int, index: int) -> torch.Tensor:
    chunk = -(-t.shape[0] // shards)
    return t[index * chunk:(index + 1) * chunk]


def main(tmp: str) -> None:
    global INFO
    INFO = init_distributed("cpu")
    tmp_dir = Path(tmp)
    checks.begin("straight")
    a = trainer(tmp_dir / "straight", ["train.resume=never"])
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        fit(a)
    # the console names the mesh: at the start, and in the end's claim of identical parameters
    assert "gloo world 4 on cpu, mesh 2 x 2 (replicas x shard size)" in banner(a), banner(a)
    if INFO.is_main:
        assert "parameters bit-identical on 4 rank(s) (mesh 2 x 2 (replicas x shard size): whole tensors" \
            in said.getvalue(), said.getvalue()
    whole = dict(zip(sorted(n for n, _ in a.model.named_parameters()), full(a)))
    if INFO.is_main:  # for tests/trainer/test_parallel.py: model.load reads the sharded checkpoint
        torch.save(whole, tmp_dir / "straight_params.pt")
    checks.begin("stop_and_resume_exact")
    b = trainer(tmp_dir / "stopped", ["train.resume=never", "train.stop_after=2"])
    assert fit(b)["stopped"]
    saved = momenta(b)
    other = [torch.empty_like(saved) for _ in range(INFO.world_size)]
    dist.all_gather(other, saved)
    assert not torch.equal(other[0], other[2]), "replicas 0 and 1 (ranks 0, 2) hold the same momenta"
    c = trainer(tmp_dir / "stopped", ["train.resume=auto"])
    assert c.step == 2 and torch.equal(momenta(c), saved), "momenta changed across save and load"
    fit(c)
    assert all(torch.equal(x, y) for x, y in zip(full(a), full(c))), "resumed run differs from the straight one"
    checks.begin("damaged_shard_falls_back")
    # a damaged shard file of the newest checkpoint: found by its checksum, the previous one is used
    step4 = tmp_dir / "stopped" / "ckpt" / "step_000004"
    shard_files = sorted((step4 / "model").glob("__*.distcp"))
    assert len(shard_files) == INFO.world_size, shard_files  # every rank wrote its part
    dist.barrier()
    if INFO.is_main:
        with open(shard_files[1], "r+b") as f:
            f.seek(10)
            byte = f.read(1)
            f.seek(10)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    d = trainer(tmp_dir / "stopped", ["train.resume=auto"])
    assert d.step == 3, f"resumed at step {d.step}, expected the fallback to step 3"
    fit(d)
    assert all(torch.equal(x, y) for x, y in zip(full(a), full(d))), "run resumed from the fallback differs"
    checks.begin("lioncub_another_mesh")
    # another mesh: 2 replicas x 2 -> 1 x 4 (Lion Cub: the replicas' momenta averaged once, cut in 4)
    old = gather_entries(d)
    e = trainer(tmp_dir / "stopped", ["train.resume=auto", "parallel.shard_size=4", "train.max_steps=5"])
    assert e.step == 4
    for k, entry in enumerate(e.optimizer.layout.entries):
        whole = [torch.cat([old[r * 2 + s][k] for s in range(2)]) for r in range(2)]
        want = rows(torch.stack(whole).mean(0), 4, INFO.rank)
        assert torch.equal(e.optimizer.momentum_of(entry.param), want.view_as(entry.param)), entry.name
    assert all(torch.equal(x, y) for x, y in zip(full(d), full(e))), "model changed on the new mesh"
    fit(e)  # trains on: parameters identical on every rank (checked by fit)
    checks.begin("adamw_another_mesh")
    # AdamW (one shared state): 2 x 2 -> 4 x 1 (replicated) carries the state over exactly
    f = trainer(tmp_dir / "adamw", ["train.resume=never", "train.stop_after=2"], "adamw_fp32")
    fit(f)
    old = gather_entries(f)
    g = trainer(tmp_dir / "adamw", ["train.resume=auto", "parallel.shard_size=1"], "adamw_fp32")
    assert g.step == 2 and all(torch.equal(x, y) for x, y in zip(full(f), full(g)))
    for k, entry in enumerate(g.optimizer.layout.entries):
        want = torch.cat([old[s][k] for s in range(2)])
        assert torch.equal(g.optimizer.momentum_of(entry.param), want.view_as(entry.param)), entry.name
    fit(g)
    checks.begin("pbit_another_mesh")
    # pbit's exchange state (a generator) moves: 2 x 2 -> 4 x 1, every rank on the fresh stream of its new
    # rank, as a world-size change gives it (it was refused as exchange state sized for the saved mesh)
    h = trainer(tmp_dir / "pbit", ["train.resume=never", "train.stop_after=2"], "lioncub_4bit")
    fit(h)
    k = trainer(tmp_dir / "pbit", ["train.resume=auto", "parallel.shard_size=1"], "lioncub_4bit")
    fresh = trainer(tmp_dir / "pbit_fresh", ["train.resume=never", "parallel.shard_size=1"], "lioncub_4bit")
    assert k.step == 2 and all(torch.equal(x, y) for x, y in zip(full(h), full(k)))
    assert torch.equal(k.optimizer.exchange.gen.get_state(), fresh.optimizer.exchange.gen.get_state())
    fit(k)  # trains on: parameters identical on every rank (checked by fit)
    checks.begin("binsgdm_refused_on_another_mesh")
    try:  # state laid out over the saved mesh's flat vector cannot move
        fit(trainer(tmp_dir / "bsgdm", ["train.resume=never", "train.stop_after=1"], "binsgdm"))
        trainer(tmp_dir / "bsgdm", ["train.resume=auto", "parallel.shard_size=4"], "binsgdm")
        raise AssertionError("binsgdm's flat state was resumed on another mesh")
    except ConfigError as err:
        assert "parallel.shard_size=2 on 4 ranks" in str(err), err
    checks.end()
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    from _checks import Checks  # tests/workers/ is the script's directory
    from _exit import exit_cleanly
    checks = Checks(CHECKS)
    checks.guard(main, sys.argv[1])
    exit_cleanly()
